"""The prime field of the talliers' MPC, which the hospitals share their votes over.

The talliers compare noisy vote totals inside MPyC's ``SecInt(l)``, which computes modulo a prime
``p > 2^(l + kappa + 1)`` (statistical security ``kappa = 30``). A comparison is right while the
difference of the two totals lies in ``[-2^(l-1), 2^(l-1))``, so totals bounded by ``|T| <= b``
need ``2 b < 2^(l-1)``: ``MpcField.for_bound`` takes the smallest such ``l`` and MPyC's prime for it.
The hospitals share modulo that same ``p`` (``crypto.secret_sharing``), and the talliers check
that their MPC computes modulo it, or the sums they input would be noise.

MPyC is honest-majority: with ``J`` parties, ``t = floor((J - 1) / 2)`` of them learn nothing. With
two, ``t = 0`` and MPyC's shares are the inputs themselves, so ``MIN_PARTIES`` is three.

MPyC reads its settings from ``sys.argv`` when a runtime is set up (and when first imported), so
``mpyc_runtime`` swaps its arguments in for that moment only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["MIN_PARTIES", "MpcField", "import_mpyc", "mpyc_runtime"]

MIN_PARTIES = 3
_MIN_BIT_LENGTH = 8
_MAX_BIT_LENGTH = 32  # MPyC's prime for SecInt(l) has l + 32 bits, and shares travel as 64-bit words


@dataclass(frozen=True)
class MpcField:
    bit_length: int  # l of SecInt(l)
    modulus: int  # its prime p

    @classmethod
    def for_bound(cls, bound: int) -> "MpcField":
        """The smallest field whose comparisons are right for totals in ``[-bound, bound]``."""
        length = max(_MIN_BIT_LENGTH, (2 * bound).bit_length() + 1)
        if length > _MAX_BIT_LENGTH:
            raise ValueError(
                f"totals up to {bound} need {length}-bit comparisons; at most {_MAX_BIT_LENGTH} are supported"
            )
        return cls(length, mpyc_runtime([]).SecInt(length).field.modulus)

    def holds(self, bound: int) -> bool:
        """Whether this field's comparisons are right for totals in ``[-bound, bound]``."""
        return 2 * bound < 2 ** (self.bit_length - 1) and self.modulus > 2 ** (self.bit_length + 1)


def mpyc_runtime(arguments: list[str]):
    """A fresh MPyC runtime set up with command-line ``arguments`` (none: one local party), never logging."""
    arguments = [sys.argv[0], "--no-log", *arguments]
    saved = sys.argv
    try:
        sys.argv = list(arguments)
        import mpyc.runtime  # the first import sets up a runtime too, and leaves sys.argv stripped

        sys.argv = list(arguments)
        return mpyc.runtime.setup()
    finally:
        sys.argv = saved


def import_mpyc():
    """``mpyc.runtime``, imported without reading this process's command line (as its first import would)."""
    saved = sys.argv
    try:
        sys.argv = [sys.argv[0], "--no-log"]
        import mpyc.runtime

        return mpyc.runtime
    finally:
        sys.argv = saved
