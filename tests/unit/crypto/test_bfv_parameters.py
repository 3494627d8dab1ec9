from fractions import Fraction

import numpy as np
import pytest

from consilium.crypto.bfv import PublicContext
from consilium.crypto.one_time_keys import key_share_bytes
from consilium.crypto.bfv_parameters import ParameterError, _decryption_error_bound, select_bfv_parameters
from consilium.crypto.primes import is_prime


@pytest.mark.parametrize("contributors", [1, 2, 3, 10, 100, 1000])
@pytest.mark.parametrize("length", [10, 1586, 9000])
def test_parameters_satisfy_the_bounds_they_claim(contributors, length):
    params = select_bfv_parameters(max_contributors=contributors, vector_length=length, sum_bound=2500 * contributors)
    degree, t, q = params.poly_modulus_degree, params.plain_modulus, params.ciphertext_modulus
    assert is_prime(t) and t % (2 * degree) == 1
    assert is_prime(q) and q % (2 * degree) == 1
    assert params.max_contributors >= contributors
    # No wrap: k summed values within the bound, as balanced digits base 2S + 1, stay inside (-t/2, t/2].
    assert (2 * params.sum_bound + 1) ** params.values_per_slot <= t
    # Decryption: K_max roundings of 1/2 and the summed fresh errors E stay below q / (2t) in every
    # coefficient, but with probability 2^-40 a round; E is exactly Binomial(42 K, 1/2) - 21 K.
    k = params.max_contributors
    assert k / 2 + _exact_error_quantile(k, params.chunk_count * degree) - 1 < q / (2 * t)
    assert params.chunk_count * degree >= params.slot_count
    check_slots = params.slot_count - -(-length // params.values_per_slot)
    forgery = Fraction(-(-(2**32) // min(t, 2**32)), 2**32)  # a check slot's chance to pass a forgery
    assert forgery**check_slots <= Fraction(1, 2**128)


@pytest.mark.parametrize("contributors", [1, 2, 10, 100, 1000])
@pytest.mark.parametrize("coefficients", [2048, 40 * 8192])
def test_the_error_bound_is_the_exact_binomial_quantile_or_one_above(contributors, coefficients):
    exact = _exact_error_quantile(contributors, coefficients)
    assert exact <= _decryption_error_bound(contributors, coefficients) <= exact + 1


def test_the_error_tail_saves_bits_for_many_contributors():
    many = select_bfv_parameters(max_contributors=100, vector_length=1000, sum_bound=5000)
    assert many.ciphertext_modulus < many.plain_modulus * (100 + 2 * 21 * 100) / 4  # 2 bits below the worst case


def _exact_error_quantile(contributors, coefficients):
    """The smallest a with P(|E| >= a) <= 2^-40 / coefficients, in exact integer arithmetic."""
    half = 21 * contributors
    trials = 2 * half
    budget = 2**trials
    tail, term = 0, 1  # term = C(trials, half + a), walking a down from half
    for error in range(half, 0, -1):
        tail += term
        if 2 * tail * coefficients * 2**40 > budget:
            return error + 1
        term = term * (half + error) // (half - error + 1)
    return 1


def test_the_computed_primes_are_the_ones_seal_builds():
    for contributors in (2, 10, 100, 1000):
        params = select_bfv_parameters(
            max_contributors=contributors, vector_length=500, sum_bound=10_000 * contributors
        )
        PublicContext(params)  # raises BfvError if SEAL's (N, t, q) differ from ours


@pytest.mark.parametrize(
    "contributors, length, bound",
    [(1, 10**5, 2046), (10, 100, 4190208), (100, 1, 2084864), (1000, 5000, 1028096), (1, 1, 8380416)],
)
def test_the_plaintext_modulus_is_never_one_of_seal_s_primes(contributors, length, bound):
    """t and the coefficient primes are all primes = 1 mod 2N, chosen apart: in these requests they met,
    and SEAL refuses such a set (t must be coprime to q)."""
    params = select_bfv_parameters(max_contributors=contributors, vector_length=length, sum_bound=bound)
    PublicContext(params)


def test_fewer_contributors_never_cost_more_bytes():
    sizes = []
    for k in (1, 3, 10, 30, 100, 300):
        params = select_bfv_parameters(max_contributors=k, vector_length=4000, sum_bound=2000 * k)
        sizes.append(params.chunk_count * key_share_bytes(params))
    assert sizes == sorted(sizes)


def test_a_short_vector_gets_the_smallest_ring_and_a_long_one_no_padding_waste():
    assert select_bfv_parameters(max_contributors=3, vector_length=50, sum_bound=3000).poly_modulus_degree == 2048
    checks = 10  # 128 bits at t = 12289
    params = select_bfv_parameters(max_contributors=3, vector_length=3 * 2048 - checks, sum_bound=3000)
    assert params.slot_count == params.chunk_count * params.poly_modulus_degree == 3 * 2048


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_contributors": 0}, "max_contributors"),
        ({"vector_length": 0}, "vector_length"),
        ({"sum_bound": 0}, "sum_bound"),
        ({"sum_bound": 2**60}, "sum_bound"),
        ({"max_contributors": 10**9, "sum_bound": 2**30}, "cannot sum"),
    ],
)
def test_impossible_requests_get_a_clear_error(kwargs, message):
    request = {"max_contributors": 3, "vector_length": 100, "sum_bound": 3000, **kwargs}
    with pytest.raises(ParameterError, match=message):
        select_bfv_parameters(**request)


def test_miller_rabin_agrees_with_trial_division():
    def trial(n):
        return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))

    numbers = list(range(2000)) + list(np.random.default_rng(1).integers(10**6, 10**7, 300))
    assert all(is_prime(int(n)) == trial(int(n)) for n in numbers)


def test_key_shares_count_in_the_upload_and_can_favour_a_smaller_degree():
    """At the round benchmark's 1M setting, five shares of one polynomial each weigh as much as a third
    of the largest degree's upload: counted, the smallest total is found at a smaller N."""
    from consilium.crypto.bfv_parameters import _upload_bits

    plain = select_bfv_parameters(max_contributors=5, vector_length=977_370, sum_bound=567_319)
    shared = select_bfv_parameters(max_contributors=5, vector_length=977_370, sum_bound=567_319, key_shares=5)
    assert shared.poly_modulus_degree < plain.poly_modulus_degree
    assert _upload_bits(shared, 5) < _upload_bits(plain, 5)
    assert _upload_bits(plain) <= _upload_bits(shared)
    with pytest.raises(ParameterError, match="key_shares"):
        select_bfv_parameters(max_contributors=5, vector_length=10, sum_bound=10, key_shares=-1)
