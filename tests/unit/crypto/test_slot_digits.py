"""Several values a slot: a sum of slots reads back as the summed values wherever they stay within the bound."""

import numpy as np
import pytest

from consilium.crypto.primes import is_prime
from consilium.crypto.slot_digits import SlotDigits


def _digits(bound: int, per_slot: int) -> SlotDigits:
    modulus = (2 * bound + 1) ** per_slot
    while not is_prime(modulus):  # the smallest prime t >= M^k: no room to spare
        modulus += 1
    return SlotDigits(base=2 * bound + 1, per_slot=per_slot, modulus=modulus)


def _sum(digits: SlotDigits, vectors) -> np.ndarray:
    slots = sum(digits.to_slots(vector).astype(object) for vector in vectors) % digits.modulus
    return digits.from_slots(slots.astype(np.int64), len(vectors[0]))


@pytest.mark.parametrize("per_slot", [1, 2, 3])
@pytest.mark.parametrize("length", [1, 7, 1000])  # the last slot full or not
def test_a_sum_within_the_bound_reads_back_exactly(per_slot, length):
    bound = 527_853 if per_slot < 3 else 1000
    digits = _digits(bound, per_slot)
    rng = np.random.default_rng(length)
    vectors = list(rng.integers(-bound // 3, bound // 3, size=(3, length), endpoint=True))
    vectors.append(-np.sum(vectors, axis=0) + rng.choice([-bound, bound], size=length))  # every sum on the bound
    assert digits.slots_for(length) == -(-length // per_slot)
    slots = digits.to_slots(vectors[0])
    assert slots.shape == (digits.slots_for(length),) and slots.min() >= 0 and slots.max() < digits.modulus
    np.testing.assert_array_equal(_sum(digits, vectors), np.sum(vectors, axis=0))


@pytest.mark.parametrize("per_slot", [1, 2, 3])
def test_one_contribution_may_leave_the_bound_when_the_sum_does_not(per_slot):
    digits = _digits(1000, per_slot)
    first = np.array([2**62, -(2**63), 5000, -1001, 3, 1000], dtype=np.int64)
    second = np.array([-(2**62) + 7, 2**63 - 1, -4000, 1, -3, 0], dtype=np.int64)
    np.testing.assert_array_equal(_sum(digits, [first, second]), [7, -1, 1000, -1000, 0, 1000])


def test_the_bound_is_tight():
    """M^k <= t is what makes it exact: one value past the bound in a full slot is read wrongly."""
    digits = _digits(1000, 2)
    np.testing.assert_array_equal(_sum(digits, [np.array([1000, -1000])]), [1000, -1000])
    assert not np.array_equal(_sum(digits, [np.array([1001, 0])]), [1001, 0])
