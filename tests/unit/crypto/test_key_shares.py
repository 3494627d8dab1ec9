"""Checked key shares: an honest dealing and its releases pass, a share or release off the polynomial is caught."""

import itertools
import os

import numpy as np
import pytest

from consilium.crypto.key_shares import (
    Dealing,
    KeyShareError,
    check_release,
    check_share,
    rebuild,
    release,
    uniform,
)
from consilium.crypto.linear_hash import LinearHash

Q = 4503599626682369  # the 52-bit ciphertext prime of the 1M parameters
SIZE = 1000


def _challenges(seed=b"\x07" * 32, modulus=Q):
    return LinearHash(seed, modulus=modulus, label=b"dealing")


def _dealings(dealers=4, threshold=3):
    keys = [uniform(Q, SIZE, os.urandom) for _ in range(dealers)]
    return keys, [Dealing(key, threshold=threshold, parties=dealers, modulus=Q) for key in keys]


def test_honest_shares_and_releases_check_and_any_threshold_rebuilds_the_sum():
    keys, dealings = _dealings()
    challenges = _challenges()
    proofs = [dealing.proof(challenges) for dealing in dealings]
    for dealing, proof in zip(dealings, proofs):
        assert all(check_share(dealt, x, proof, challenges, threshold=3) for x, dealt in enumerate(dealing.shares, 1))
    releases = {x: release([d.shares[x - 1] for d in dealings], Q) for x in range(1, 5)}
    assert all(check_release(r, x, proofs, challenges, threshold=3) for x, r in releases.items())
    total = sum(key.astype(object) for key in keys) % Q
    for subset in itertools.combinations(releases, 3):
        np.testing.assert_array_equal(rebuild({x: releases[x].share for x in subset}, 3, Q), total)


def test_a_share_off_the_dealer_s_polynomial_fails_its_recipient_s_check_only():
    _, (dealing, *_) = _dealings()
    challenges = _challenges()
    proof = dealing.proof(challenges)
    bad = dealing.shares[1].share.copy()
    bad[17] = (int(bad[17]) + 1) % Q
    forged = type(dealing.shares[1])(bad, dealing.shares[1].masks)
    assert not check_share(forged, 2, proof, challenges, threshold=3)
    assert check_share(dealing.shares[0], 1, proof, challenges, threshold=3)
    masked = type(dealing.shares[1])(
        dealing.shares[1].share, (dealing.shares[1].masks[0] + 1,) + dealing.shares[1].masks[1:]
    )
    assert not check_share(masked, 2, proof, challenges, threshold=3)


def test_a_wrong_release_fails_and_the_others_pass():
    _, dealings = _dealings()
    challenges = _challenges()
    proofs = [dealing.proof(challenges) for dealing in dealings]
    releases = {x: release([d.shares[x - 1] for d in dealings], Q) for x in range(1, 5)}
    wrong = releases[3].share.copy()
    wrong[0] = (int(wrong[0]) + 5) % Q
    assert not check_release(type(releases[3])(wrong, releases[3].masks), 3, proofs, challenges, threshold=3)
    # A release for another set (one dealer left out) is not one for this set.
    assert not check_release(release([d.shares[2] for d in dealings[:3]], Q), 3, proofs, challenges, threshold=3)
    assert all(check_release(releases[x], x, proofs, challenges, threshold=3) for x in (1, 2, 4))


def test_a_proof_of_another_degree_count_or_range_fails():
    _, (dealing, *_) = _dealings()
    challenges = _challenges()
    proof = dealing.proof(challenges)
    dealt = dealing.shares[0]
    higher = tuple(p + (0,) for p in proof)  # degree tau: would admit shares off every degree-2 polynomial
    for bad in (higher, proof[:-1], ((Q,) + proof[0][1:],) + proof[1:], ((1.0,) + proof[0][1:],) + proof[1:]):
        assert not check_share(dealt, 1, bad, challenges, threshold=3)
    with pytest.raises(KeyShareError, match="modulo this key's prime"):
        _dealings()[1][0].proof(_challenges(modulus=2052097))


def test_the_proof_is_the_challenges_products_masked_and_says_nothing_by_itself():
    """P^m(0) = <gamma^m, k> + g^m(0): two dealings of one key publish unrelated proofs."""
    key = uniform(Q, SIZE, os.urandom)
    challenges = _challenges()
    first, second = (Dealing(key, threshold=2, parties=3, modulus=Q) for _ in "ab")
    products = challenges.products(key)
    masks = [[list(mask) for mask in dealing._masks] for dealing in (first, second)]
    proofs = [dealing.proof(challenges) for dealing in (first, second)]
    for dealt_masks, proof in zip(masks, proofs):
        assert [p[0] for p in proof] == [(products[m] + mask[0]) % Q for m, mask in enumerate(dealt_masks)]
    assert proofs[0] != proofs[1]
    with pytest.raises(KeyShareError, match="proved once"):
        first.proof(_challenges(b"\x08" * 32))


def test_a_dealing_needs_a_threshold_within_the_parties():
    key = uniform(Q, 8, os.urandom)
    for threshold, parties in ((1, 3), (4, 3)):
        with pytest.raises(KeyShareError, match="cannot be dealt"):
            Dealing(key, threshold=threshold, parties=parties, modulus=Q)
    with pytest.raises(KeyShareError, match="exactly 2 releases"):
        rebuild({1: key}, 2, Q)
