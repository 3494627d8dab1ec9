"""Additive secret sharing of integer vectors modulo a prime, for votes sent to the talliers.

A vote vector ``v`` (signed integers) becomes ``J`` shares: ``J - 1`` vectors drawn uniformly from
``Z_p`` and a last one, ``v - (r_1 + ... + r_{J-1}) mod p``. Any ``J - 1`` shares are uniform and
independent of ``v``; all ``J`` add up to ``v mod p``. Sums of shares add up to sums of votes, so a
tallier adds the shares it receives locally and only the total is ever reconstructed (inside the
MPC, ``tallier.mpc``). The signed value is recovered from ``[-p/2, p/2)``: the caller makes
sure, with ``check_fits``, that no sum it will reconstruct leaves that range.

Uniform draws take as many random bits from the OS as ``p`` has, and draw again where the number
is not below ``p`` (rejection sampling: exactly uniform, at most two tries a value on average), all
of a call's values at once. ``p`` fits in 64 bits, so shares travel as little-endian ``uint64``.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from consilium.errors import ConsiliumError
from consilium.crypto.primes import is_prime

__all__ = [
    "ShareError",
    "add",
    "check_fits",
    "from_bytes",
    "random_array",
    "random_elements",
    "reconstruct",
    "share",
    "share_elements",
    "to_bytes",
    "uniform_below",
]

_MAX_MODULUS_BITS = 64


class ShareError(ConsiliumError, ValueError):
    """A share vector of the wrong length or outside the field, or values that do not fit it."""


def check_fits(bound: int, modulus: int) -> None:
    """Refuse a modulus whose signed range ``[-p/2, p/2)`` cannot hold every value up to ``|bound|``."""
    _check_modulus(modulus)
    if not 0 <= bound < modulus // 2:
        raise ShareError(f"values up to {bound} do not fit the field of {modulus.bit_length()} bits")


def share(values: np.ndarray, parties: int, modulus: int) -> list[np.ndarray]:
    """``parties`` additive shares of the signed integer vector ``values``, each a ``uint64`` vector."""
    _check_modulus(modulus)
    if parties < 2:
        raise ShareError(f"sharing needs at least 2 parties, got {parties}")
    values = np.asarray(values)
    if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
        raise ShareError("only a vector of integers can be shared")
    largest = max((abs(int(v)) for v in values), default=0)  # Python integers: |int64 min| overflows int64
    if largest >= modulus // 2:
        raise ShareError(f"a value of {largest} does not fit the field of {modulus.bit_length()} bits")
    return share_elements([int(v) % modulus for v in values], parties, modulus)


def share_elements(elements: list[int], parties: int, modulus: int) -> list[np.ndarray]:
    """``parties`` additive shares of field elements (integers in ``[0, p)``), each a ``uint64`` vector."""
    _check_modulus(modulus)
    if parties < 2:
        raise ShareError(f"sharing needs at least 2 parties, got {parties}")
    masks = [random_elements(len(elements), modulus) for _ in range(parties - 1)]
    last = [(v - sum(column)) % modulus for v, column in zip(elements, zip(*masks))]
    return [np.array(mask, dtype=np.uint64) for mask in masks] + [np.array(last, dtype=np.uint64)]


def reconstruct(shares: list[np.ndarray], modulus: int) -> np.ndarray:
    """The signed vector that ``shares`` add up to, as ``int64``."""
    total = _sum(shares, modulus)
    return np.array([value - modulus if value >= (modulus + 1) // 2 else value for value in total], dtype=np.int64)


def to_bytes(vector: np.ndarray) -> bytes:
    return np.asarray(vector, dtype="<u8").tobytes()


def from_bytes(data: bytes, length: int, modulus: int) -> np.ndarray:
    """A share vector of ``length`` elements of ``Z_p`` from the wire, or ``ShareError``."""
    _check_modulus(modulus)
    if len(data) != 8 * length:
        raise ShareError(f"a share of {length} values has {8 * length} bytes, got {len(data)}")
    vector = np.frombuffer(data, dtype="<u8").astype(np.uint64)
    if vector.size and int(vector.max()) >= modulus:
        raise ShareError("a share value lies outside the field")
    return vector


def add(total: list[int], vector: np.ndarray, modulus: int) -> list[int]:
    """``total + vector mod p`` element by element (Python integers: ``2p`` overflows ``uint64``)."""
    return [(a + int(b)) % modulus for a, b in zip(total, vector, strict=True)]


def _sum(shares: list[np.ndarray], modulus: int) -> list[int]:
    if not shares:
        raise ShareError("nothing to reconstruct")
    total = [0] * len(shares[0])
    for vector in shares:
        total = add(total, vector, modulus)
    return total


def random_elements(count: int, modulus: int) -> list[int]:
    """``count`` uniform elements of ``Z_p`` from the OS's generator (module docstring)."""
    return random_array(count, modulus).tolist()


def random_array(count: int, modulus: int) -> np.ndarray:
    """``count`` uniform elements of ``Z_p``, ``p`` below ``2^64``, as a ``uint64`` vector, from the OS."""
    if not 1 < modulus < 2**_MAX_MODULUS_BITS:
        raise ShareError(f"uniform draws need a modulus above 1 and below 2^{_MAX_MODULUS_BITS}, got {modulus}")
    return uniform_below(modulus, count, os.urandom)


def uniform_below(bound: int, count: int, stream: Callable[[int], bytes]) -> np.ndarray:
    """``count`` uniform values below ``bound`` (at most ``2^64``) as ``uint64``, by rejection: 8-byte words of
    ``stream(size)`` (the OS, or the first ``size`` bytes of an XOF, so that every caller with one seed gets the same
    values) cut to ``bound``'s bit length, those not below it skipped; more words where too few were kept."""
    mask = np.uint64((1 << (bound - 1).bit_length()) - 1)
    words = count + count // 2 + 16  # at least half are kept
    while True:
        draws = np.frombuffer(stream(8 * words), dtype="<u8") & mask
        kept = draws[draws < bound]
        if kept.size >= count:
            return kept[:count]
        words *= 2


def _check_modulus(modulus: int) -> None:
    if not (3 <= modulus < 2**_MAX_MODULUS_BITS and is_prime(modulus)):
        raise ShareError(f"the field modulus must be an odd prime below 2^{_MAX_MODULUS_BITS}, got {modulus}")
