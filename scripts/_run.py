"""How every launcher runs: the allocator's settings, the limit of open files, and a user's mistake as one line.

Light on purpose: the launchers of keys and rosters run it without loading torch or SEAL.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Callable

from consilium.protocol.wire.transport import raise_descriptor_limit

__all__ = ["run_with"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # the most glibc accepts on 64-bit
_TRIM_THRESHOLD = 1 << 30


def run_with(main: Callable[[], None], user_errors: tuple[type[BaseException], ...]) -> int:
    """Run ``main``; a user error becomes ``error: <reason>`` on stderr and exit status 2.

    Every party may hold many connections (a server under a flood, a tallier's MPC listener), each
    an open file: the limit is raised to the hard limit first."""
    _reuse_freed_memory()
    raise_descriptor_limit()
    try:
        main()
    except user_errors as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def _reuse_freed_memory() -> None:
    """Have glibc keep freed blocks of up to 32 MiB for reuse instead of unmapping them (elsewhere: nothing).

    A round allocates and frees arrays of ``d`` values many times over (rounding each example, the
    noise, the key shares, the ciphertexts). By default glibc maps many of them afresh, and the
    kernel's zeroing of the new pages took as long as the computing: at ``d`` = 977,370 a hospital
    spent as much time in the kernel as in the program, and rounding 15 examples took 0.67 s instead
    of 0.12 s (measured on a 2-core machine; ``consilium-bench-round`` measures the whole round).
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    if not (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)):
        logging.getLogger(__name__).debug("glibc refused the allocator settings; freed memory is unmapped as usual")
