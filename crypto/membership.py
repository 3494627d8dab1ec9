"""Check slots: a decrypted sum proves it adds one fresh contribution from each listed contributor.

The hospitals share a 32-byte check key ``K`` that the server never holds (it travels sealed with
the BFV secret key). In round ``r`` of run ``R`` hospital ``k`` appends ``L`` check slots to its
vector ``x_k`` of ``d`` integers, all modulo the plaintext modulus ``t``::

    c_{k,l} = <a_l, x_k> + tag_{k,l}        l = 1..L

``a_l`` (in ``Z_t^d``) and ``tag_{k,l}`` (in ``Z_t``) are ChaCha20 keystream keyed with
``HMAC-SHA256(K, R | r | l)`` and ``HMAC-SHA256(K, R | r | k)``, read as 32-bit words ``w``, each
mapped to ``floor(w t / 2^32)`` (exact in 64-bit arithmetic, as ``t < 2^32``). Each value then has
``floor(2^32 / t)`` or ``ceil(2^32 / t)`` of the ``2^32`` words as preimages, so it is drawn with
probability at most ``p = 1/t + 2^-32``, and "uniform" below means only that cap: the draw can be
as far as about ``t / 2^32`` from uniform in statistical distance, which the argument never uses.
(Half the keystream of 64-bit words reduced modulo ``t``, and no division: half the cost.)
A hospital told that a sum ``(y, c)`` adds the contributions of the set ``S`` accepts it only if,
for every ``l``::

    c_l = <a_l, y> + sum_{k in S} tag_{k,l}

**Why a dishonest server cannot pass it.** The server holds no key (no public key, no Galois or
relinearisation key), so from the ciphertexts it has received it can compute, slot by slot, only
``y = sum_j D_j x_j + p``: a sum of contributions ``x_j`` from any rounds, each multiplied slot-wise
by a plaintext ``D_j``, plus a plaintext ``p``. Anything else decrypts to values independent of the
key's check. In check slot ``l`` each contribution ``j`` brings its own ``tag_j``, uniform and
unknown to the server, with coefficient ``D_j[l]``; unless that coefficient is exactly 1 for each
fresh contribution of ``S`` and 0 for every other, the check holds with probability at most ``p``.
With those coefficients the check reads ``<a_l, e> = p_l`` for the error ``e = sum_{k in S} x_k - y``,
and ``a_l`` is uniform and independent of everything the server has seen, so a nonzero ``e``
passes with probability at most ``p`` (``t`` is prime: fixing the other coordinates, each value of
``a_{l,i}`` with ``e_i != 0`` gives a different ``<a_l, e>``; ``CheckKey`` refuses any other ``t``).
Independent ``a_l`` and tags over ``L = ceil(128 / -log2 p)`` slots give a forgery probability of
at most ``p^L <= 2^-128``. This rules out ``3 Enc(x_2)``, a contribution left out or counted twice,
a replayed round, a transparent or forged ciphertext, and a sum whose data slots were scaled or
shifted.

**What it does not rule out.** A server can send different valid sums, for different sets ``S``,
to different hospitals in one round; ``crypto.endorsement`` closes that.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from fractions import Fraction
from typing import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from crypto.primes import is_prime

__all__ = ["CHECK_KEY_BYTES", "MembershipError", "check_slot_count", "CheckKey"]

CHECK_KEY_BYTES = 32
SOUNDNESS_BITS = 128
_WORD_BITS = 32
_NONCE = bytes(16)  # each label has its own key, so one nonce serves: every party recomputes the same stream


class MembershipError(ValueError):
    """A decrypted sum that is not the sum of one fresh contribution from each listed contributor."""


def check_slot_count(plain_modulus: int) -> int:
    """``L``: the fewest slots with ``p^L <= 2^-128``, in exact arithmetic (a rounded logarithm can
    give one too few: at ``t = 65537``, ``p`` is just above ``2^-16``)."""
    p = Fraction(1, plain_modulus) + Fraction(1, 2**_WORD_BITS)
    slots, forgery = 1, p
    while forgery > Fraction(1, 2**SOUNDNESS_BITS):
        slots, forgery = slots + 1, forgery * p
    return slots


class CheckKey:
    """The hospitals' shared check key, bound to one run and one plaintext modulus."""

    def __init__(self, key: bytes, *, run_id: str, plain_modulus: int) -> None:
        if len(key) != CHECK_KEY_BYTES:
            raise MembershipError(f"a check key has {CHECK_KEY_BYTES} bytes, got {len(key)}")
        if not (2 < plain_modulus < 2**32 and is_prime(plain_modulus)):
            raise MembershipError(f"check slots need a prime plaintext modulus below 2^32, got {plain_modulus}")
        self._key = key
        self._run_id = run_id
        self._t = plain_modulus
        self.slots = check_slot_count(plain_modulus)

    @classmethod
    def generate(cls, *, run_id: str, plain_modulus: int) -> "CheckKey":
        return cls(secrets.token_bytes(CHECK_KEY_BYTES), run_id=run_id, plain_modulus=plain_modulus)

    def to_bytes(self) -> bytes:
        return self._key

    def append(self, values: np.ndarray, *, round_number: int, hospital: str) -> np.ndarray:
        """``values`` (integers) followed by this hospital's check slots for this round."""
        reduced = np.mod(np.asarray(values, dtype=np.int64), self._t)
        checks = (self._inner_products(reduced, round_number) + self._tags(round_number, hospital)) % self._t
        return np.concatenate([reduced, checks.astype(np.int64)])

    def verify(self, slots: np.ndarray, *, round_number: int, contributors: Sequence[str]) -> np.ndarray:
        """The data slots of a decrypted sum of ``contributors``' updates; ``MembershipError`` if it is not one."""
        if len(set(contributors)) != len(contributors):
            raise MembershipError(f"round {round_number}: a contributor is listed twice in {list(contributors)}")
        slots = np.mod(np.asarray(slots, dtype=np.int64), self._t)
        values, checks = slots[: -self.slots], slots[-self.slots :]
        expected = self._inner_products(values, round_number)
        for hospital in contributors:
            expected = expected + self._tags(round_number, hospital)
        if not np.array_equal(checks, expected % self._t):
            raise MembershipError(
                f"round {round_number}: the sum is not one fresh contribution from each of {list(contributors)}"
            )
        return values

    def _inner_products(self, reduced: np.ndarray, round_number: int) -> np.ndarray:
        x = reduced.astype(np.uint64)
        # a, x < t: a block of this many products sums below 2^64, so np.dot (which wraps) is exact on it.
        block = (2**64 - 1) // (self._t - 1) ** 2
        products = np.empty(self.slots, dtype=np.int64)
        for l in range(self.slots):
            a = self._uniform(b"coefficients|%d|%d" % (round_number, l), x.size)
            products[l] = sum(int(np.dot(a[i : i + block], x[i : i + block])) % self._t for i in range(0, x.size, block)) % self._t
        return products

    def _tags(self, round_number: int, hospital: str) -> np.ndarray:
        return self._uniform(b"tags|%d|" % round_number + hospital.encode(), self.slots).astype(np.int64)

    def _uniform(self, label: bytes, size: int) -> np.ndarray:
        """``size`` values in ``Z_t`` from the keystream of ``label``'s key (see the module docstring)."""
        key = hmac.new(self._key, b"consilium/check-slots/v3|" + self._run_id.encode() + b"|" + label, hashlib.sha256)
        keystream = Cipher(algorithms.ChaCha20(key.digest(), _NONCE), mode=None).encryptor().update(bytes(4 * size))
        words = np.frombuffer(keystream, dtype="<u4").astype(np.uint64)
        words *= np.uint64(self._t)  # in place: d values a slot, twice a round
        words >>= np.uint64(_WORD_BITS)
        return words
