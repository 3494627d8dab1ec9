"""Linear hashes: exact modulo m whatever m's size, just enough challenges for 2^-128, linear in the vector."""

from fractions import Fraction

import numpy as np
import pytest

from consilium.crypto.linear_hash import LinearHash, challenge_count


# 14 to 60 bits: a value spans two to eight bytes, each multiplied by a 32-bit coefficient in float64.
@pytest.mark.parametrize("modulus", [12289, 40353793, 4294957057, 1114517667841, 1152921504606846883])
def test_hashes_are_the_inner_products_modulo_m(modulus):
    hashes = LinearHash(bytes(range(32)), modulus=modulus, label=b"test")
    values = np.random.default_rng().integers(0, modulus, size=300_000)  # many blocks of 2^13
    values[:280_000] = 2 ** (modulus.bit_length() - 1) - 1  # every byte full but the top one: the largest block sums
    products = hashes.products(values)
    assert len(products) == challenge_count(modulus)
    # The same coefficients, in Python integers: no overflow can hide there.
    for l, product in enumerate(products):
        rho = hashes._coefficients(l, values.size, 0)
        assert rho.max() < min(modulus, 2**32)
        assert product == sum(int(p) * int(q) for p, q in zip(rho, values)) % modulus


@pytest.mark.parametrize(
    "modulus, count", [(65537, 8), (1073153, 7), (40353793, 6), (4294957057, 5), (4294967311, 4), (2**61 - 1, 4)]
)
def test_challenges_are_just_enough_for_2_to_the_minus_128(modulus, count):
    """Each challenge passes a forgery with probability p = ceil(2^32 / r) / 2^32, r = min(m, 2^32)."""
    p = Fraction(-(-(2**32) // min(modulus, 2**32)), 2**32)
    assert challenge_count(modulus) == count
    assert p**count <= Fraction(1, 2**128) < p ** (count - 1)


def test_a_vector_s_hashes_are_the_sums_of_its_pieces_and_of_its_summands():
    q = 1152921504606846883
    hashes = LinearHash(bytes(32), modulus=q, label=b"test")
    rng = np.random.default_rng()
    x, y = rng.integers(0, q, size=70_000), rng.integers(0, q, size=70_000)
    whole = hashes.products(x)
    pieces = [hashes.products(x[:65_536]), hashes.products(x[65_536:], first=65_536)]
    assert whole == [(a + b) % q for a, b in zip(*pieces)]
    assert hashes.products((x + y) % q) == [(a + b) % q for a, b in zip(whole, hashes.products(y))]
    other_seed = LinearHash(bytes(31) + b"\1", modulus=q, label=b"test")
    assert other_seed.products(x) != whole


def test_a_seed_or_modulus_of_the_wrong_form_is_refused():
    with pytest.raises(ValueError, match="32 bytes"):
        LinearHash(bytes(16), modulus=65537, label=b"test")
    with pytest.raises(ValueError, match="prime"):
        LinearHash(bytes(32), modulus=65536, label=b"test")


def test_a_value_outside_the_field_is_refused_not_read_by_its_low_bytes():
    hashes = LinearHash(bytes(32), modulus=65537, label=b"test")
    for bad in ([65537], [-1], [2**24 + 3]):
        with pytest.raises(ValueError, match="values in"):
            hashes.products(np.array(bad))
