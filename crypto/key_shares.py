"""Shamir shares of a one-time key that every recipient and every verifier can check, naming a cheat.

The design and its arguments are in ``docs/explanation/secure-round.md`` (section "Verifiable dealing and releases"); this module
is the arithmetic. All values are modulo the prime ``q`` (the BFV ciphertext modulus); a key is a
vector of ``N`` such values (``crypto.one_time_keys``, NTT form), and party ``x`` is 1-based.

**Dealing.** The dealer draws ``F_1..F_{tau-1}`` uniform, so ``f(x) = k + F_1 x + ... + F_{tau-1}
x^{tau-1}``, and ``lambda`` scalar mask polynomials ``g^m`` of degree ``tau - 1`` uniform over
``Z_q``. Party ``x`` receives ``(f(x), (g^m(x))_m)``: a ``DealtShare``.

**Proof.** Once the challenges ``gamma^m`` exist (a ``crypto.linear_hash.LinearHash``, its count
``lambda``, fixed after every share and release is committed), the dealer publishes
``P^m_t = <gamma^m, F_t> + g^m_t`` (``F_0 = k``), so that ``P^m(x) = <gamma^m, f(x)> + g^m(x)``.

**Checks.** A recipient checks its share: ``<gamma^m, f(x)> + g^m(x) = P^m(x)`` for every ``m``. A
release of party ``x`` for a set ``S`` is ``z = sum_{i in S} f_i(x)`` with ``G^m = sum_i g_i^m(x)``;
anyone checks ``<gamma^m, z> + G^m = sum_i P_i^m(x)``. For a value fixed before ``gamma`` that is off
by ``delta != 0`` the check fails but with probability ``p`` a challenge (``crypto.linear_hash``),
``2^-128`` for all of them. ``g^m(0)`` is uniform given any ``tau - 1`` values of it, so ``P``
reveals nothing of ``<gamma^m, k>``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from consilium.crypto.linear_hash import LinearHash, challenge_count

__all__ = [
    "DealtShare",
    "Dealing",
    "KeyShareError",
    "Release",
    "check_release",
    "check_share",
    "interpolate",
    "rebuild",
    "release",
]


class KeyShareError(ValueError):
    """Shares, proofs or releases that do not fit the key they claim to belong to."""


@dataclass(frozen=True)
class DealtShare:
    """What party ``x`` receives of one dealer's key: ``f(x)`` and the masks' values ``g^m(x)``."""

    share: np.ndarray  # N values below q, uint64
    masks: tuple[int, ...]


@dataclass(frozen=True)
class Release:
    """What party ``x`` releases for a set: the sums of the shares and masks it holds from its members."""

    share: np.ndarray
    masks: tuple[int, ...]


class Dealing:
    """A dealer's sharing polynomial for one key, kept until it has published its proof."""

    def __init__(self, key: np.ndarray, *, threshold: int, parties: int, modulus: int) -> None:
        if not 2 <= threshold <= parties < modulus:
            raise KeyShareError(f"a threshold of {threshold} among {parties} parties cannot be dealt")
        self.modulus, self.threshold = modulus, threshold
        self._coefficients = [key] + [uniform(modulus, key.size, os.urandom) for _ in range(threshold - 1)]
        words = np.frombuffer(os.urandom(16 * challenge_count(modulus) * threshold), dtype="<u8")
        # 128 bits reduced modulo q < 2^62: within 2^-66 of uniform.
        self._masks = [
            [
                (int(words[2 * (m * threshold + t)]) << 64 | int(words[2 * (m * threshold + t) + 1])) % modulus
                for t in range(threshold)
            ]
            for m in range(challenge_count(modulus))
        ]
        self.shares = tuple(self._share(x) for x in range(1, parties + 1))
        self._proved = False

    def proof(self, challenges: LinearHash) -> tuple[tuple[int, ...], ...]:
        """``P^m`` for each challenge ``m``: ``tau`` coefficients, lowest degree first. Once: the masks
        are a one-time pad, and two proofs under different challenges would give away linear forms
        of the key."""
        if self._proved:
            raise KeyShareError("a dealing is proved once")
        _check_challenges(challenges, self.modulus, len(self._masks))
        self._proved = True
        products = [challenges.products(coefficient) for coefficient in self._coefficients]  # [t][m]
        proof = tuple(
            tuple((products[t][m] + mask[t]) % self.modulus for t in range(self.threshold))
            for m, mask in enumerate(self._masks)
        )
        self._coefficients, self._masks = [], []  # the key and the masks are spent (Python cannot wipe them)
        return proof

    def _share(self, x: int) -> DealtShare:
        # Horner's rule, in uint64 where no step can overflow (value x + coefficient < q (x + 1) <= 2^64),
        # else in Python integers.
        exact = self.modulus * (x + 1) <= 2**64
        value = np.zeros(self._coefficients[0].size, dtype=np.uint64 if exact else object)
        for coefficient in reversed(self._coefficients):
            value = (
                value * (np.uint64(x) if exact else x) + (coefficient if exact else coefficient.astype(object))
            ) % (np.uint64(self.modulus) if exact else self.modulus)
        return DealtShare(value.astype(np.uint64), tuple(_evaluate(mask, x, self.modulus) for mask in self._masks))


def check_share(
    dealt: DealtShare, x: int, proof: Sequence[Sequence[int]], challenges: LinearHash, *, threshold: int
) -> bool:
    """Whether party ``x``'s share of a dealing lies on the polynomial of degree ``threshold - 1`` its
    dealer's ``proof`` states."""
    return _holds(dealt.share, dealt.masks, x, [proof], challenges, threshold)


def release(shares: Sequence[DealtShare], modulus: int) -> Release:
    """Party ``x``'s release for a set: the sums modulo ``q`` of the shares and masks its members dealt it."""
    total = sum(dealt.share.astype(object) for dealt in shares) % modulus
    masks = tuple(sum(values) % modulus for values in zip(*(dealt.masks for dealt in shares)))
    return Release(total.astype(np.uint64), masks)


def check_release(
    released: Release, x: int, proofs: Sequence[Sequence[Sequence[int]]], challenges: LinearHash, *, threshold: int
) -> bool:
    """Whether party ``x``'s release is the sum of what the dealers whose ``proofs`` are given dealt it."""
    return _holds(released.share, released.masks, x, proofs, challenges, threshold)


def rebuild(releases: Mapping[int, np.ndarray], threshold: int, modulus: int) -> np.ndarray:
    """The constant term (a sum of keys) from exactly ``threshold`` shares or releases keyed by party."""
    if len(releases) != threshold:
        raise KeyShareError(f"rebuilding needs exactly {threshold} releases, got {len(releases)}")
    return interpolate(releases, 0, modulus)


def interpolate(points: Mapping[int, np.ndarray], x: int, modulus: int) -> np.ndarray:
    """The polynomial through ``points`` (degree ``len(points) - 1``, coefficient by coefficient) at ``x``,
    by Lagrange."""
    total = np.zeros(next(iter(points.values())).size, dtype=object)
    for xi, values in points.items():
        numerator, denominator = 1, 1
        for other in points:
            if other != xi:
                numerator, denominator = numerator * (x - other) % modulus, denominator * (xi - other) % modulus
        total += values.astype(object) * (numerator * pow(denominator, -1, modulus) % modulus)
    return (total % modulus).astype(np.uint64)


def uniform(modulus: int, count: int, source) -> np.ndarray:
    """``count`` values uniform below ``modulus``: words of ``bitlength(modulus)`` bits from ``source(size)``,
    those at or above ``modulus`` rejected (fewer than half of them, as ``modulus > 2^(bits-1)``)."""
    bits = modulus.bit_length()
    mask = np.uint64(2**bits - 1)
    drawn = 2 * count + 64
    while True:
        words = np.frombuffer(source(8 * drawn), dtype="<u8") & mask
        kept = words[words < np.uint64(modulus)]
        if kept.size >= count:
            return kept[:count].copy()
        drawn *= 2  # an extendable output is prefix-stable: asking for more keeps every party's first values


def _holds(
    values: np.ndarray,
    masks: Sequence[int],
    x: int,
    proofs: Sequence[Sequence[Sequence[int]]],
    challenges: LinearHash,
    threshold: int,
) -> bool:
    """A proof of another degree, count or range than a dealing's fails: a polynomial of higher degree
    would let a dealer's shares lie off any one of degree ``threshold - 1``."""
    modulus = challenges.modulus
    if len(masks) != challenges.count or any(
        len(proof) != challenges.count
        or any(len(p) != threshold or any(type(c) is not int or not 0 <= c < modulus for c in p) for p in proof)
        for proof in proofs
    ):
        return False
    products = challenges.products(values)
    return all(
        (products[m] + masks[m]) % modulus == sum(_evaluate(proof[m], x, modulus) for proof in proofs) % modulus
        for m in range(challenges.count)
    )


def _evaluate(coefficients: Sequence[int], x: int, modulus: int) -> int:
    value = 0
    for coefficient in reversed(coefficients):
        value = (value * x + coefficient) % modulus
    return value


def _check_challenges(challenges: LinearHash, modulus: int, count: int) -> None:
    if challenges.modulus != modulus or challenges.count != count:
        raise KeyShareError("the challenges are not modulo this key's prime")
