"""The Shamir split and the pseudorandom sharing (PRSS) ``harden_mpyc`` puts under MPyC (``tallier.mpc_values``): the
same shares MPyC's own would give in distribution, computed in NumPy. Three or more parties are simulated in one
process from the keys each would hold; ``tests/integration/test_tallier_mpc.py`` runs them for real."""

import itertools

import numpy as np
import pytest
from consilium.crypto.mpc_field import mpyc_runtime
from consilium.tallier.mpc_values import harden_mpyc
from mpyc import thresha


def _field(bit_length=11):
    field = mpyc_runtime([]).SecInt(bit_length).field
    harden_mpyc(field.modulus)
    return field


def _on_one_polynomial(field, shares, t):
    """The value every ``t + 1`` consecutive parties' shares rebuild; ``AssertionError`` unless they all agree."""
    points = [(i + 1, row) for i, row in enumerate(shares)]
    rebuilt = [
        [int(v) for v in thresha.np_recombine(field, points[start : start + t + 1]).value]
        for start in range(len(points) - t)
    ]
    assert all(values == rebuilt[0] for values in rebuilt)
    return rebuilt[0]


@pytest.mark.parametrize("t, m", [(0, 1), (1, 3), (2, 5), (3, 7)])
def test_the_split_shares_rebuild_the_secrets_from_any_t_plus_one_parties(t, m):
    field = _field()
    secrets = [0, 1, field.modulus - 1] + [int(v) for v in np.random.default_rng().integers(0, 2**40, 500)]
    shares = thresha.np_random_split(field, field.array(np.array(secrets, dtype=object)), t, m)
    assert shares.shape == (m, len(secrets)) and {type(v) for v in shares.reshape(-1)} == {int}
    assert _on_one_polynomial(field, shares, t) == secrets


def test_the_split_draws_fresh_coefficients():
    field = _field()
    zeros = field.array(np.zeros(2000, dtype=object))
    first, second = (thresha.np_random_split(field, zeros, 1, 3)[0] for _ in range(2))
    assert len(set(first)) > 1990 and not np.array_equal(first, second)


@pytest.mark.parametrize("m, t, bound", [(3, 1, None), (3, 1, 1 << 30), (5, 2, None)])
def test_every_party_s_pseudorandom_shares_lie_on_one_polynomial_of_uniform_values(m, t, bound):
    field = _field()
    bound = bound or field.order
    keys = {subset: bytes([len(subset)]) + bytes(subset) * 4 for subset in itertools.combinations(range(m), m - t)}
    shares = [
        thresha.np_pseudorandom_share(
            field, m, i, {s: thresha.PRF(k, bound) for s, k in keys.items() if i in s}, b"uci", 3000
        ).value
        for i in range(m)
    ]
    values = _on_one_polynomial(field, np.array(shares, dtype=object), t)
    limit = len(keys) * (bound - 1)  # a sum of one value below the bound per key
    assert all(0 <= v <= limit for v in values) and len(set(values)) > 2990
    again = thresha.np_pseudorandom_share(
        field, m, 0, {s: thresha.PRF(k, bound) for s, k in keys.items() if 0 in s}, b"uci", 3000
    ).value
    assert np.array_equal(again, shares[0])  # a function of the keys and the common input alone
