"""Several values in one BFV slot: the balanced digits of one integer in base ``M = 2 S + 1``.

A slot holds an integer modulo the plaintext modulus ``t``. ``k`` values go into one slot as::

    slot = v_0 + v_1 M + ... + v_{k-1} M^{k-1}   (mod t)

That map from ``Z^k`` to ``Z_t`` respects addition, so a sum of slots is the slot of the summed
values. A sum whose every value lies in ``[-S, S]`` is an integer of absolute value at most
``S (M^k - 1) / (M - 1) = (M^k - 1) / 2``, below ``t / 2`` once ``t >= M^k``. Reading its slot in
``(-t/2, t/2]`` and peeling off balanced digits base ``M`` (each in ``[-S, S]``) gives back every
summed value exactly; the last digit takes what is left, so ``k = 1`` reads a slot in
``(-t/2, t/2]``. The values themselves may be any integers: one contributor's may leave ``[-S, S]``
as long as the sum does not. A summed value beyond the bound is read wrongly and can take the other
values of its slot with it, as a single value would wrap modulo ``t``: ``S`` is the caller's promise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SlotDigits"]


@dataclass(frozen=True)
class SlotDigits:
    base: int  # M = 2 S + 1
    per_slot: int  # k
    modulus: int  # t >= M^k

    def slots_for(self, length: int) -> int:
        return -(-length // self.per_slot)

    def to_slots(self, values: np.ndarray) -> np.ndarray:
        """``values`` (int64), ``per_slot`` to a slot, as slots in ``[0, t)``."""
        rows = self._rows(np.asarray(values, dtype=np.int64))
        if self.per_slot == 1:
            return np.mod(rows[:, 0], self.modulus)
        half = self.base // 2
        shifted = (rows + half).view(np.uint64)  # in [0, M) exactly for values in [-S, S], even where int64 wraps
        outside = np.unique(np.flatnonzero(shifted >= self.base) // self.per_slot)
        powers = np.array([pow(self.base, digit, self.modulus) for digit in range(self.per_slot)], dtype=object)
        exact = (
            np.mod(rows[outside], self.modulus).astype(object) @ powers
        ) % self.modulus  # Python integers: no overflow
        rows[outside] = 0
        slots = rows[:, -1].copy()
        for digit in reversed(range(self.per_slot - 1)):  # Horner: |slots| <= (M^k - 1) / 2 < t / 2
            slots *= self.base
            slots += rows[:, digit]
        np.mod(slots, self.modulus, out=slots)
        slots[outside] = exact
        return slots

    def from_slots(self, slots: np.ndarray, length: int) -> np.ndarray:
        """The ``length`` summed values of slots in ``[0, t)``: exact while each lies in ``[-S, S]``."""
        rest = _balanced(np.asarray(slots, dtype=np.int64), self.modulus)
        half = self.base // 2
        digits = []
        for _ in range(self.per_slot - 1):
            digit = (rest + half) % self.base - half
            digits.append(digit)
            rest = (rest - digit) // self.base
        digits.append(rest)
        return np.stack(digits, axis=1).reshape(-1)[:length]

    def _rows(self, values: np.ndarray) -> np.ndarray:
        padded = np.zeros(self.slots_for(values.size) * self.per_slot, dtype=np.int64)
        padded[: values.size] = values
        return padded.reshape(-1, self.per_slot)


def _balanced(values: np.ndarray, modulus: int) -> np.ndarray:
    """Integers modulo ``t`` read in ``(-t/2, t/2]``."""
    reduced = np.mod(values, modulus)
    return np.where(reduced > modulus // 2, reduced - modulus, reduced)
