"""Checked shares: what the talliers' two checks see of an honest ballot, a forged one and a shifted share.

The checks run inside the MPC in ``tallier.mpc`` (``tests/integration/test_tallier_mpc.py`` runs them there);
here the same arithmetic runs in the clear on the reconstructed values, to show what each check
can and cannot tell."""

import numpy as np
import pytest

from consilium.crypto.checked_shares import CheckedLayout, _share_bits, challenge, share_checked, tag_combination
from consilium.crypto.mpc_field import MpcField
from consilium.crypto.secret_sharing import ShareError, reconstruct

LAYOUT = CheckedLayout(40, -90, 120)
FIELD = MpcField.for_bound(LAYOUT.totals_bound(3))
P = FIELD.modulus


def _checks(shares: list[np.ndarray], seed: int) -> tuple[int, int]:
    """The bit check and the tag check of ``tallier.mpc``, computed on the whole values."""
    bits, _, key = (part.astype(object) for part in LAYOUT.split(np.array(_sum(shares), dtype=object)))
    spread = challenge(seed, LAYOUT.entries * LAYOUT.bits, P, "bits")
    weights = challenge(seed, LAYOUT.entries, P, "tags")
    flat = bits.reshape(-1)
    bit_check = sum(s * b * (b - 1) for s, b in zip(spread, flat)) % P
    combined = sum(tag_combination(LAYOUT.split(share)[1], weights, P) for share in shares) % P
    per_bit = [sum(w * int(bits[i, k]) for i, w in enumerate(weights)) % P for k in range(LAYOUT.bits)]
    tag_check = (combined - sum(int(c) * u for c, u in zip(key, per_bit))) % P
    return bit_check, tag_check


def _sum(shares):
    return [sum(int(share[i]) for share in shares) % P for i in range(len(shares[0]))]


def test_an_honest_ballot_rebuilds_its_votes_and_passes_both_checks():
    votes = np.random.default_rng().integers(LAYOUT.low, LAYOUT.high + 1, size=LAYOUT.entries)
    shares = share_checked(votes, LAYOUT, 3, P)
    assert all(len(share) == LAYOUT.values and share.dtype == np.uint64 for share in shares)
    bits, _, _ = LAYOUT.split(reconstruct(shares, P))
    assert set(np.unique(bits)) <= {0, 1}
    assert np.array_equal(LAYOUT.low + bits @ np.array(LAYOUT.weights), votes)
    assert _checks(shares, seed=12345) == (0, 0)


def test_votes_outside_the_range_cannot_be_shared_honestly():
    with pytest.raises(ShareError, match=r"outside \[-90, 120\]"):
        share_checked(np.full(LAYOUT.entries, 121), LAYOUT, 3, P)


def test_a_hospital_that_forges_non_bits_under_a_valid_tag_fails_the_bit_check_only():
    bits = LAYOUT.decompose(np.zeros(LAYOUT.entries, dtype=np.int64))
    bits[3::10, 0] += 200  # 200 more votes for class 3 of every query: no longer bits
    bit_check, tag_check = _checks(_share_bits(bits, 3, P), seed=7)
    assert bit_check != 0 and tag_check == 0


def test_a_tallier_that_shifts_its_share_fails_the_tag_check():
    votes = np.random.default_rng().integers(LAYOUT.low, LAYOUT.high + 1, size=LAYOUT.entries)
    shares = share_checked(votes, LAYOUT, 3, P)
    shifted = shares[1].copy()
    shifted[3 * LAYOUT.bits] = (int(shifted[3 * LAYOUT.bits]) + 200) % P  # a bit of count 3
    assert _checks([shares[0], shifted, shares[2]], seed=99)[1] != 0
    cancelled = shares[1].copy()  # the bits moved so that the rebuilt count stays the same
    cancelled[0] = (int(cancelled[0]) + 2) % P
    cancelled[1] = (int(cancelled[1]) - 1) % P
    assert _checks([shares[0], cancelled, shares[2]], seed=99)[1] != 0


def test_the_challenge_is_a_function_of_the_seed_and_the_purpose():
    first = challenge(5, 1000, P, "bits")
    assert first == challenge(5, 1000, P, "bits") and all(0 <= c < P for c in first)
    assert first != challenge(6, 1000, P, "bits") and first[:10] != challenge(5, 10, P, "tags")
    assert len(set(first)) == 1000


@pytest.mark.parametrize("low, high", [(-34, 35), (-88, 118), (0, 0), (0, 1), (5, 6), (-747, 1147)])
def test_every_entry_of_the_range_has_bits_and_every_bit_pattern_rebuilds_an_entry_of_the_range(low, high):
    layout = CheckedLayout(high - low + 1, low, high)
    every = np.arange(low, high + 1)
    bits = layout.decompose(every)
    assert set(np.unique(bits)) <= {0, 1} and np.array_equal(low + bits @ np.array(layout.weights), every)
    assert low + sum(layout.weights) == high and min(layout.weights) >= 0  # all ones: high; all zeros: low
    assert layout.totals_bound(100) == 100 * max(-low, high)


def test_an_empty_range_is_refused():
    with pytest.raises(ValueError, match="range"):
        CheckedLayout(10, 5, 4)
