"""Check slots: a decrypted sum proves it adds one fresh contribution from each listed contributor.

The hospitals share a 32-byte check key ``K`` that the server never holds (it travels sealed with
the BFV secret key). In round ``r`` of run ``R`` hospital ``k`` appends ``L`` check slots to its
vector ``x_k`` of ``d`` integers, all modulo the plaintext modulus ``t``::

    c_{k,l} = <a_l, x_k> + tag_{k,l}        l = 1..L

``a_l`` are the challenges of a linear hash modulo ``t`` (``crypto.linear_hash``) seeded with
``HMAC-SHA256(K, R | r)``: a coefficient takes any one value with probability at most ``p``
(``1 / t`` to within ``2^-32``). ``tag_{k,l}`` is ChaCha20 keystream keyed with
``HMAC-SHA256(K, R | r | k)``, a 256-bit word mapped to ``floor(w t / 2^256)`` in ``Z_t``: uniform to within
a statistical distance of ``t / 2^256 < 2^-196``. A hospital told that a sum ``(y, c)`` adds the
contributions of the set ``S`` accepts it only if, for every ``l``::

    c_l = <a_l, y> + sum_{k in S} tag_{k,l}

**Why a dishonest server cannot pass it.** Whatever the server computes (sums of ciphertexts from
any rounds and positions, plaintext products, which convolve the slots (they are the plaintext's
coefficients, ``crypto.bfv``; a monomial moves them, no key needed), plaintexts added, or anything
below the plaintext level), what the hospital decrypts is a function of the slots it was sent, the BFV key,
the encryption randomness and the server's own coins. None of these depends on the coefficients
``a_l`` but the check slots, and every check slot is padded by a tag of its own (a hospital
contributes at most once a round, across restarts too, for as long as its ledger survives:
``protocol.hospital``), which makes it uniform and independent of ``a_l``. Fix all of them: that
fixes the decrypted ``(y, c)``, and with it the error ``e = sum_{k in S} x_k - y`` and the offsets
``d_l = c_l - sum_{k in S} c_{k,l}``. As ``sum_{k in S} c_{k,l} = <a_l, sum_{k in S} x_k> + sum_{k
in S} tag_{k,l}``, check ``l`` holds exactly when ``<a_l, e> = -d_l``. If ``e = 0``, ``y`` is the
honest sum and there is nothing to forge. Otherwise ``a_l`` is independent of ``e`` and ``d_l``, and
``<a_l, e>`` takes any one value with probability at most ``p`` (``t`` is prime and ``a_{l,i} < t``:
fixing the other coordinates, each value of ``a_{l,i}`` with ``e_i != 0`` gives a different ``<a_l,
e>``; ``CheckKey`` refuses any other ``t``). Independent ``a_l`` over the fewest ``L`` slots with
``p^L <= 2^-128`` pass a wrong sum with probability at most ``2^-128`` a try, plus ``2^-196`` for
each tag of the round the server received; a hospital checks one sum a round, so a round gives the
server at most ``K`` tries. This treats HMAC-SHA256 and ChaCha20 as pseudorandom functions. It rules
out ``3 Enc(x_2)``, a contribution left out or counted twice, a replayed round, a transparent or
forged ciphertext, a sum whose data slots were scaled or shifted, and a check slot added into the
data of another ciphertext. A hospital that uploaded twice in one round would break it: the
difference of its two uploads carries no tag.

**What it does not rule out.** A server can send different valid sums, for different sets ``S``,
to different hospitals in one round; ``crypto.endorsement`` closes that.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from crypto.linear_hash import LinearHash, challenge_count
from crypto.primes import is_prime

__all__ = ["CHECK_KEY_BYTES", "MembershipError", "check_slot_count", "CheckKey"]

CHECK_KEY_BYTES = 32
MAX_PLAIN_MODULUS_BITS = 60  # SEAL's largest plaintext modulus
_TAG_BITS = 256  # a tag is uniform on Z_t to within t / 2^256: the argument needs it uniform
_NONCE = bytes(16)  # each label has its own key, so one counter-and-nonce serves


class MembershipError(ValueError):
    """A decrypted sum that is not the sum of one fresh contribution from each listed contributor."""


def check_slot_count(plain_modulus: int) -> int:
    """``L``: as many check slots as a linear hash modulo ``t`` needs challenges (``crypto.linear_hash``)."""
    return challenge_count(plain_modulus)


class CheckKey:
    """The hospitals' shared check key, bound to one run and one plaintext modulus."""

    def __init__(self, key: bytes, *, run_id: str, plain_modulus: int) -> None:
        if len(key) != CHECK_KEY_BYTES:
            raise MembershipError(f"a check key has {CHECK_KEY_BYTES} bytes, got {len(key)}")
        if not (2 < plain_modulus < 2**MAX_PLAIN_MODULUS_BITS and is_prime(plain_modulus)):
            raise MembershipError(
                f"check slots need a prime plaintext modulus below 2^{MAX_PLAIN_MODULUS_BITS}, got {plain_modulus}"
            )
        self._key = key
        self.run_id = run_id
        self._t = plain_modulus
        self.slots = check_slot_count(plain_modulus)

    @classmethod
    def generate(cls, *, run_id: str, plain_modulus: int) -> "CheckKey":
        return cls(secrets.token_bytes(CHECK_KEY_BYTES), run_id=run_id, plain_modulus=plain_modulus)

    def to_bytes(self) -> bytes:
        return self._key

    def products(self, slots: np.ndarray, *, round_number: int, first: int = 0) -> list[int]:
        """``<a_l, y>`` modulo t for each ``l``, over the data slots ``y`` (in ``[0, t)``) at positions
        ``first, first + 1, ...`` of the vector: a vector's products are the sums of its pieces'."""
        seed = hmac.new(self._key, self._label(b"coefficients|%d" % round_number), hashlib.sha256).digest()
        return LinearHash(seed, modulus=self._t, label=b"coefficients").products(slots, first=first)

    def check_slots(self, products: Sequence[int], *, round_number: int, hospital: str) -> list[int]:
        """This hospital's check slots for this round, given the products of its whole vector
        (summed over its pieces: each is reduced modulo t here)."""
        return [(product + tag) % self._t for product, tag in zip(products, self._tags(round_number, hospital))]

    def verify(
        self, checks: Sequence[int], *, products: Sequence[int], round_number: int, contributors: Sequence[str]
    ) -> None:
        """``MembershipError`` unless a decrypted sum whose data slots have ``products`` (``products``, summed
        over its pieces) and whose check slots are ``checks`` adds one fresh contribution from each of
        ``contributors``."""
        if len(set(contributors)) != len(contributors):
            raise MembershipError(f"round {round_number}: a contributor is listed twice in {list(contributors)}")
        expected = [product % self._t for product in products]
        for hospital in contributors:
            expected = [total + tag for total, tag in zip(expected, self._tags(round_number, hospital))]
        if [int(check) % self._t for check in checks] != [total % self._t for total in expected]:
            raise MembershipError(
                f"round {round_number}: the sum is not one fresh contribution from each of {list(contributors)}"
            )

    def _tags(self, round_number: int, hospital: str) -> list[int]:
        size = _TAG_BITS // 8
        words = self._keystream(b"tags|%d|" % round_number + hospital.encode(), size * self.slots)
        return [
            int.from_bytes(words[i : i + size], "little") * self._t >> _TAG_BITS for i in range(0, len(words), size)
        ]

    def _keystream(self, label: bytes, size: int) -> bytes:
        key = hmac.new(self._key, self._label(label), hashlib.sha256).digest()
        return Cipher(algorithms.ChaCha20(key, _NONCE), mode=None).encryptor().update(bytes(size))

    def _label(self, label: bytes) -> bytes:
        return b"consilium/check-slots/v6|" + self.run_id.encode() + b"|" + label
