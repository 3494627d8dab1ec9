"""One-time BFV keys: each upload under a key of its own, whose Shamir shares other hospitals hold.

The protocol and the argument for each property are in ``docs/explanation/secure-round.md``; this
module is its arithmetic, on SEAL (``tenseal.sealapi``) through ``crypto.bfv``.

**An upload.** For round ``r`` of run ``R`` every party derives the public polynomials ``a_c``
(``c = 0..C-1``, one per ciphertext) from SHAKE-256 of ``(R, r, c)``; they never travel. A
hospital draws ``k`` uniform in ``R_q = Z_q[X]/(X^N + 1)`` from the OS and sends only::

    U[c] = Delta m[c] + e[c] - a_c k   (mod q)

``Delta m + e`` is SEAL's own symmetric encryption under an all-zero key (its first polynomial is
then exactly the scaled plaintext plus SEAL's fresh error, the error ``crypto.bfv_parameters``
bounds); ``a_c k`` is SEAL's product in NTT form. ``(U[c], a_c)`` is therefore a BFV ciphertext
under the secret ``k``: the sum over a set ``S`` is one under ``K_S = sum_{i in S} k_i``, with the
summed error the parameters were chosen for. ``k`` is uniform, not ternary: RLWE in its standard
form, at least as hard.

**Everything in NTT form.** ``a_c`` and ``k`` are drawn directly as their NTT values (the NTT is a
bijection of ``R_q``, so uniform stays uniform) and Shamir sharing is linear, so shares, releases
and the rebuilt key stay in NTT form too: SEAL multiplies by them pointwise and only the product is
transformed back.

**Shares.** A key is dealt once, as it is drawn (``crypto.key_shares``): coefficient by
coefficient, ``k`` is the constant term of a random polynomial of degree ``tau - 1`` over ``Z_q``
(``q`` is prime); party ``x`` (1-based) gets its value at ``x``. Any ``tau`` values rebuild the
constant term by Lagrange interpolation; fewer are uniform and independent of it.

**Zero slots.** The last slots of an upload (where check slots were, ``BfvParameters.slot_count``)
hold 0, so a sum decrypts to 0 there. A wrong rebuilt key ``K + eps`` adds ``a_c eps`` to each
ciphertext, uniform for an ``eps`` drawn independently of the ``a_c``: every zero slot is then
uniform modulo ``t``, and ``crypto.bfv_parameters.zero_slot_count(t)`` of them pass together with probability at most
``2^-128``. That catches a release damaged by mistake, not one fitted by a dishonest releaser: the
condition is linear in ``eps``, so ``eps = (lambda a_C)^-1 y`` with ``y`` zero at those slots passes
it (the design's section "Verifiable dealing and releases" checks each dealing and release instead).
"""

from __future__ import annotations

import hashlib
import os
from typing import Sequence

import numpy as np
import tenseal.sealapi as seal

from consilium.crypto.bfv import BfvError, PublicContext, _MemoryFile, pack_words, unpack_words
from consilium.crypto.key_shares import Dealing, KeyShareError, uniform

__all__ = [
    "OneTimeKey",
    "check_zero_slots",
    "decrypt_sum",
    "key_share_bytes",
    "pack_ring",
    "public_polynomials",
    "sum_uploads",
    "unpack_ring",
]


def public_polynomials(params, *, run: str, round_number: int) -> np.ndarray:
    """``a_c`` for every ciphertext ``c`` of round ``round_number`` of ``run``, ``(C, N)`` uint64 in NTT
    form: SHAKE-256 of the label, read as words of ``ceil(log2 q)`` bits, those below ``q`` kept."""
    label = b"consilium/one-time-key/a/v1|%s|%d|" % (run.encode(), round_number)
    return np.stack(
        [
            uniform(params.ciphertext_modulus, params.poly_modulus_degree, lambda size, c=c: _shake(label, c, size))
            for c in range(params.chunk_count)
        ]
    )


class OneTimeKey:
    """A hospital's key for one upload, dealt as it is drawn (``dealing``: ``crypto.key_shares``): it
    encrypts once, and only its shares, and the dealing's proof, may leave."""

    def __init__(self, context: PublicContext, *, threshold: int, parties: int) -> None:
        self._context = context
        self._q = context.params.ciphertext_modulus
        self._key = uniform(self._q, context.params.poly_modulus_degree, os.urandom)  # NTT form
        try:
            self.dealing = Dealing(self._key, threshold=threshold, parties=parties, modulus=self._q)
        except KeyShareError as error:
            raise BfvError(str(error)) from None
        self._used = False

    def encrypt(self, slots: np.ndarray, public: np.ndarray) -> list[bytes]:
        """The upload (packed ``U[c]``) of ``C * N`` slots in ``[0, t)``, under this key and ``public``
        (``public_polynomials``). ``BfvError`` on a second call: a key encrypts one upload."""
        if self._used:
            raise BfvError("a one-time key encrypts one upload; draw a new key for another")
        self._used = True
        params = self._context.params
        if slots.shape != (params.chunk_count * params.poly_modulus_degree,):
            raise BfvError(f"an upload holds {params.chunk_count} ciphertexts of {params.poly_modulus_degree} slots")
        with _MemoryFile() as file:
            encryptor = seal.Encryptor(self._context.seal, _zero_key(self._context))
            key = self._context.load_ntt_plaintext(file, self._key)
            scaled = []
            for c, chunk in enumerate(slots.reshape(params.chunk_count, -1)):
                ciphertext = seal.Ciphertext()
                encryptor.encrypt_symmetric(self._context.load_plaintext(file, chunk), ciphertext)  # (Delta m + e, a')
                noisy = self._context.ring_elements(file, ciphertext)[0]
                product = _times(self._context, file, public[c], key)
                scaled.append(_subtract(noisy, product, self._q))
        return pack_ring(self._context, np.stack(scaled))


def key_share_bytes(params) -> int:
    """The bytes of one share, release or key on the wire: ``N`` values of ``ceil(log2 q)`` bits."""
    return -(-params.poly_modulus_degree * params.ciphertext_modulus.bit_length() // 8)


def pack_ring(context: PublicContext, polynomials: np.ndarray) -> list[bytes]:
    """Polynomials of ``R_q`` (rows of ``N`` values below ``q``), each packed to ``ceil(log2 q)`` bits a value."""
    bits = context.params.ciphertext_modulus.bit_length()
    return [pack_words(np.ascontiguousarray(row, dtype="<u8").tobytes(), bits) for row in polynomials]


def unpack_ring(context: PublicContext, packed: Sequence[bytes], what: str) -> np.ndarray:
    """Packed polynomials back to ``(len(packed), N)`` uint64; ``BfvError`` on a wrong size or a value
    at or above ``q``."""
    params = context.params
    size, bits = key_share_bytes(params), params.ciphertext_modulus.bit_length()
    rows = []
    for index, blob in enumerate(packed):
        if type(blob) is not bytes or len(blob) != size:
            raise BfvError(f"{what} {index} must be {size} bytes")
        rows.append(np.frombuffer(unpack_words(blob, params.poly_modulus_degree, bits), dtype="<u8"))
    polynomials = np.stack(rows) if rows else np.zeros((0, params.poly_modulus_degree), dtype=np.uint64)
    if polynomials.size and int(polynomials.max()) >= params.ciphertext_modulus:
        raise BfvError(f"{what} holds a value at or above the ciphertext modulus")
    return polynomials


def sum_uploads(context: PublicContext, uploads: Sequence[np.ndarray]) -> np.ndarray:
    """The coefficient-wise sum modulo ``q`` of unpacked uploads (what the server computes)."""
    q = np.uint64(context.params.ciphertext_modulus)
    total = np.zeros_like(uploads[0])
    for upload in uploads:
        total += upload  # both below q < 2^60: no overflow
        total[total >= q] -= q
    return total


def decrypt_sum(context: PublicContext, total: np.ndarray, key: np.ndarray, public: np.ndarray) -> np.ndarray:
    """The slots (int64, in ``[0, t)``) of the summed uploads ``total`` under the rebuilt ``key``."""
    q = context.params.ciphertext_modulus
    slots = []
    with _MemoryFile() as file:
        decryptor = seal.Decryptor(context.seal, _zero_key(context))
        sum_key = context.load_ntt_plaintext(file, key)
        for c, row in enumerate(total):
            opened = _add(row, _times(context, file, public[c], sum_key), q)  # Delta M + E
            ciphertext = context.load_ring_elements(file, np.stack([opened, public[c]]), ntt=False)
            plaintext = seal.Plaintext()
            decryptor.decrypt(ciphertext, plaintext)  # c0 + c1 * 0: only the scaling and rounding
            slots.append(context.plaintext_coefficients(file, plaintext))
    return np.concatenate(slots)


def check_zero_slots(context: PublicContext, slots: np.ndarray, data_slots: int) -> None:
    """``BfvError`` unless every slot from ``data_slots`` to the last zero slot decrypted to 0."""
    zero = slots[data_slots : context.params.slot_count]
    if np.any(zero):
        raise BfvError("the sum's zero slots are not zero: the key rebuilt from the releases is wrong")


def _times(context: PublicContext, file: _MemoryFile, public: np.ndarray, key: seal.Plaintext) -> np.ndarray:
    """``a k`` in coefficient form, for ``a`` and ``k`` in NTT form: SEAL's pointwise product, transformed back."""
    pair = context.load_ring_elements(file, np.stack([public, public]), ntt=True)
    context.evaluator.multiply_plain_inplace(pair, key)
    context.evaluator.transform_from_ntt_inplace(pair)
    return context.ring_elements(file, pair)[0]


def _subtract(x: np.ndarray, y: np.ndarray, modulus: int) -> np.ndarray:
    return np.where(x >= y, x - y, x + (np.uint64(modulus) - y))


def _add(x: np.ndarray, y: np.ndarray, modulus: int) -> np.ndarray:
    total = x + y
    return np.where(total >= np.uint64(modulus), total - np.uint64(modulus), total)


def _zero_key(context: PublicContext) -> seal.SecretKey:
    """A secret key of all zeros: encryption under it leaves ``Delta m + e``, decryption only scales."""
    key = seal.KeyGenerator(context.seal).secret_key()
    key.data().set_zero()
    return key


def _shake(label: bytes, chunk: int, size: int) -> bytes:
    return hashlib.shake_256(label + b"%d" % chunk).digest(size)
