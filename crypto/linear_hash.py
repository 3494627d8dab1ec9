"""Random linear hashes modulo a prime: ``<rho_l, x> mod m`` for challenges ``rho_l`` drawn from a seed.

A hash is linear, so the hash of a sum is the sum of the hashes: that is what lets a hospital check
a sum it holds against hashes its contributors signed of their own parts, without seeing them.

**The challenges.** ``rho_l`` is ChaCha20 keystream keyed with ``HMAC-SHA256(seed, label | l)``.
Each coefficient is a 32-bit word ``w`` mapped to ``floor(w r / 2^32)`` in ``[0, r)``,
``r = min(m, 2^32)`` (the word itself once ``m > 2^32``): a coefficient needs 32 bits of chance,
not ``log2 m``, and that keeps the products short. A value of that map has at most
``ceil(2^32 / r)`` preimages, so a coefficient takes any one value with probability at most
``p = ceil(2^32 / r) / 2^32`` (``1 / m`` to within ``2^-32``; exactly ``2^-32`` for ``m > 2^32``).

**Soundness.** For a prime ``m`` and a vector ``delta != 0 (mod m)`` fixed before the seed is,
``<rho_l, delta> = c`` holds with probability at most ``p`` for any ``c``: fix every coordinate but
one with ``delta_i != 0``; then one value of ``rho_{l,i}`` modulo ``m`` solves it, and
``rho_{l,i} < m`` takes it with probability at most ``p``. Independent challenges, ``count(m)`` of
them, the fewest with ``p^L <= 2^-128``, all pass with probability at most ``2^-128``. This treats
HMAC-SHA256 and ChaCha20 as pseudorandom functions; a seed that is a hash of what it must bind
(Fiat-Shamir) costs a forger one hash evaluation a try.

**Exact in floating point.** The products run in float64 BLAS over each value's bytes: a block of
``2^13`` products of a byte and a 32-bit coefficient sums below ``2^53``, where every partial sum
of integers is exact whatever order BLAS adds in. Challenges are drawn a stretch at a time, so
memory stays bounded whatever the vector's length; a vector's hashes are the sums of its pieces'.
"""

from __future__ import annotations

import hashlib
import hmac
from fractions import Fraction

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from threadpoolctl import ThreadpoolController

from consilium.crypto.primes import is_prime

__all__ = ["SOUNDNESS_BITS", "LinearHash", "challenge_count"]

SOUNDNESS_BITS = 128
MAX_MODULUS_BITS = 62  # values are read as int64 words
_COEFFICIENT_BITS = 32
_LIMB_BITS = 8  # a value's bytes: a product of a coefficient and a limb stays below 2^40...
_BLOCK = 2 ** (53 - _COEFFICIENT_BITS - _LIMB_BITS)  # ...and 2^13 of them sum below 2^53, exact in float64
_STRETCH = 2**16  # coefficients drawn at a time: a whole number of keystream blocks (16 a block)
_NONCE = bytes(12)  # each challenge has its own key, so one nonce serves: every party recomputes the same stream
_BLOCK_BYTES = 64  # ChaCha20's block
# One BLAS thread for the products: each is small, and OpenBLAS's idle threads spin after it, taking
# the core from the party's other work (a 1M update's products took 20 ms with them and 6.5 ms
# with one thread, on 2 cores).
_BLAS = ThreadpoolController()


def challenge_count(modulus: int) -> int:
    """``L``: the fewest challenges with ``p^L <= 2^-128``, in exact arithmetic: at ``m = 65537``, ``p``
    is exactly ``2^-16``, where a logarithm in floating point decides the count by its rounding."""
    p = Fraction(-(-(2**_COEFFICIENT_BITS) // _coefficient_range(modulus)), 2**_COEFFICIENT_BITS)
    count, forgery = 1, p
    while forgery > Fraction(1, 2**SOUNDNESS_BITS):
        count, forgery = count + 1, forgery * p
    return count


class LinearHash:
    """The ``count`` hashes ``<rho_l, x> mod modulus`` whose challenges the ``seed`` (32 bytes) fixes."""

    def __init__(self, seed: bytes, *, modulus: int, label: bytes) -> None:
        if len(seed) != 32:
            raise ValueError(f"a linear hash's seed has 32 bytes, got {len(seed)}")
        if not (2 < modulus < 2**MAX_MODULUS_BITS and is_prime(modulus)):
            raise ValueError(f"linear hashes need a prime modulus below 2^{MAX_MODULUS_BITS}, got {modulus}")
        self._seed, self._label, self.modulus = seed, label, modulus
        self.count = challenge_count(modulus)

    def products(self, values: np.ndarray, *, first: int = 0) -> list[int]:
        """``<rho_l, x> mod m`` for each ``l``, over ``values`` (each in ``[0, m)``) at positions
        ``first, first + 1, ...`` of the vector hashed."""
        limb_count = -(-self.modulus.bit_length() // _LIMB_BITS)
        x = np.ascontiguousarray(values, dtype="<i8").ravel()
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.modulus):
            # Only a value's low limbs are read: one at or above m would hash as another (review 3, finding 4).
            raise ValueError(f"a linear hash takes values in [0, {self.modulus})")
        totals = np.zeros((self.count, limb_count), dtype=object)  # Python integers: no overflow
        with _BLAS.limit(limits=1, user_api="blas"):
            for start in range(0, x.size, _STRETCH):
                self._add_stretch(totals, x[start : start + _STRETCH], first + start, limb_count)
        return [
            sum(int(total) << (_LIMB_BITS * position) for position, total in enumerate(row)) % self.modulus
            for row in totals
        ]

    def _add_stretch(self, totals: np.ndarray, piece: np.ndarray, first: int, limbs: int) -> None:
        """Add the products of ``piece``, the values from position ``first`` on, to ``totals`` (by limb)."""
        bytes_ = piece.view(np.uint8).reshape(-1, 8)[:, :limbs].astype(np.float64)
        coefficients = np.empty((self.count, piece.size))
        for l in range(self.count):
            coefficients[l] = self._coefficients(l, piece.size, first)
        for block in range(0, piece.size, _BLOCK):
            sums = coefficients[:, block : block + _BLOCK] @ bytes_[block : block + _BLOCK]
            totals += sums.astype(np.int64)  # each below 2^53, exact

    def _coefficients(self, challenge: int, size: int, first: int) -> np.ndarray:
        """Coefficients ``first`` to ``first + size - 1`` of challenge ``challenge``, in ``[0, min(m, 2^32))``."""
        word_bytes = _COEFFICIENT_BITS // 8
        offset = word_bytes * first
        if offset % _BLOCK_BYTES:
            raise ValueError(f"a keystream is entered at a block: position {first} is not a multiple of 16")
        key = hmac.new(self._seed, self._label + b"|%d" % challenge, hashlib.sha256).digest()
        nonce = (offset // _BLOCK_BYTES).to_bytes(4, "little") + _NONCE  # RFC 7539: the block counter, then the nonce
        stream = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(word_bytes * size))
        words = np.frombuffer(stream, dtype="<u4")
        coefficient_range = _coefficient_range(self.modulus)
        if coefficient_range == 2**_COEFFICIENT_BITS:
            return words  # the words themselves
        words = words.astype(np.uint64)
        words *= np.uint64(coefficient_range)
        words >>= np.uint64(_COEFFICIENT_BITS)
        return words


def _coefficient_range(modulus: int) -> int:
    return min(modulus, 2**_COEFFICIENT_BITS)
