"""Batched BFV secure summation on TenSEAL: who can do what is carried by the type.

- ``SecretContext`` (hospitals) holds the shared secret key: it encrypts an update and decrypts a
  sum. Encryption is symmetric: every hospital holds the secret key anyway, the aggregator then gets
  no public key and so cannot encrypt (it cannot forge a contribution), and symmetric ciphertexts
  carry less noise.
- ``PublicContext`` (aggregator) holds the parameters and nothing else: loading one that carries a
  secret key is refused.
- ``CiphertextSum`` (aggregator) adds contributions in place; ``+=`` costs ~0.03 ms where
  ``copy()`` costs ~5 ms, so nothing on this path copies a ciphertext.

A vector of integers travels as ``chunk_count`` serialized ciphertexts of ``poly_modulus_degree``
slots; slots hold integers modulo ``t``, so values are reduced, never clamped, and a decrypted sum
reads in ``(-t/2, t/2]``. Every contributor puts a 1 in the count slot after its values, so a decrypted sum states how many
ciphertexts went into it: hospitals check the aggregator's claim against it, and a sum made under
another key decrypts to a count that does not match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import tenseal as ts

from crypto.bfv_parameters import BfvParameters

__all__ = [
    "BfvError",
    "CiphertextSum",
    "DecryptedSum",
    "PublicContext",
    "SecretContext",
    "max_ciphertext_bytes",
]

# Serialized size of one ciphertext without compression, with room for TenSEAL's framing.
_CIPHERTEXT_BYTES_SLACK = 4096


class BfvError(ValueError):
    """A context or ciphertext that does not fit the agreed parameters or key."""


@dataclass(frozen=True)
class DecryptedSum:
    total: np.ndarray  # int64, in (-t/2, t/2]: the sum of the contributors' vectors modulo t
    contributors: int  # read from the count slot, not taken from the aggregator's word


def max_ciphertext_bytes(params: BfvParameters) -> int:
    """Upper bound on one serialized ciphertext (two polynomials of 8-byte coefficients)."""
    return 2 * params.poly_modulus_degree * 8 + _CIPHERTEXT_BYTES_SLACK


class SecretContext:
    """A hospital's BFV context, holding the federation's shared secret key."""

    def __init__(self, context: ts.Context, params: BfvParameters) -> None:
        _check_matches(context, params)
        if not context.has_secret_key():
            raise BfvError("this BFV context holds no secret key")
        self._context = context
        self.params = params

    @classmethod
    def generate(cls, params: BfvParameters) -> "SecretContext":
        context = ts.context(
            ts.SCHEME_TYPE.BFV,
            poly_modulus_degree=params.poly_modulus_degree,
            plain_modulus=params.plain_modulus,
            coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
            encryption_type=ts.ENCRYPTION_TYPE.SYMMETRIC,
        )
        return cls(context, params)

    @classmethod
    def from_bytes(cls, data: bytes, params: BfvParameters) -> "SecretContext":
        return cls(_parse_context(data), params)

    def to_bytes(self) -> bytes:
        """The secret context. Only ever leaves a hospital sealed to another hospital."""
        return self._context.serialize(
            save_public_key=False, save_secret_key=True, save_galois_keys=False, save_relin_keys=False
        )

    def public_bytes(self) -> bytes:
        """The parameters alone: what the aggregator needs to load and add ciphertexts."""
        return self._context.serialize(
            save_public_key=False, save_secret_key=False, save_galois_keys=False, save_relin_keys=False
        )

    def encrypt(self, values: np.ndarray) -> list[bytes]:
        """The ciphertexts of an integer vector, each value taken modulo t."""
        values = np.asarray(values)
        if values.shape != (self.params.vector_length,) or not np.issubdtype(values.dtype, np.integer):
            raise BfvError(f"expected a vector of {self.params.vector_length} integers, got {values.dtype} of shape {values.shape}")
        t = self.params.plain_modulus
        reduced = np.mod(values.astype(np.int64), t)
        slots = np.append(np.where(reduced > t // 2, reduced - t, reduced), 1)  # the balanced range SEAL encodes
        degree = self.params.poly_modulus_degree
        return [
            ts.bfv_vector(self._context, slots[start : start + degree].tolist()).serialize()
            for start in range(0, slots.size, degree)
        ]

    def decrypt_sum(self, chunks: Sequence[bytes]) -> DecryptedSum:
        vectors = _load_chunks(self._context, self.params, chunks)
        slots = np.concatenate([np.asarray(vector.decrypt(), dtype=np.int64) for vector in vectors])
        contributors = int(slots[-1])
        if not 1 <= contributors <= self.params.max_contributors:
            raise BfvError(
                f"the count slot decrypts to {contributors}: the sum was not made under this key or was corrupted"
            )
        return DecryptedSum(total=slots[:-1], contributors=contributors)


class PublicContext:
    """The aggregator's BFV context: parameters only, no key of any kind."""

    def __init__(self, data: bytes, params: BfvParameters) -> None:
        context = _parse_context(data)
        _check_matches(context, params)
        if context.has_secret_key():
            raise BfvError("refusing a context that carries the secret key: the aggregator must never hold it")
        self._context = context
        self.params = params

    def load_chunks(self, chunks: Sequence[bytes]) -> list[ts.BFVVector]:
        return _load_chunks(self._context, self.params, chunks)


class CiphertextSum:
    """Adds encrypted vectors in place. A contribution that fails validation changes nothing."""

    def __init__(self, context: PublicContext) -> None:
        self._context = context
        self._vectors: list[ts.BFVVector] | None = None
        self.contributions = 0

    def add(self, chunks: Sequence[bytes]) -> None:
        if self.contributions >= self._context.params.max_contributors:
            raise BfvError(
                f"this sum already holds {self.contributions} contributions, the most these parameters allow"
            )
        vectors = self._context.load_chunks(chunks)
        if self._vectors is None:
            self._vectors = vectors
        else:
            for total, vector in zip(self._vectors, vectors):
                total += vector
        self.contributions += 1

    def to_chunks(self) -> list[bytes]:
        if self._vectors is None:
            raise BfvError("the sum is empty")
        return [vector.serialize() for vector in self._vectors]


def _parse_context(data: bytes) -> ts.Context:
    try:
        return ts.context_from(data)
    except Exception as error:  # TenSEAL raises ValueError, RuntimeError or TypeError on bad input
        raise BfvError(f"not a TenSEAL context: {error}") from None


def _check_matches(context: ts.Context, params: BfvParameters) -> None:
    data = context.seal_context().data
    first = data.first_context_data()
    actual = (
        first.parms().poly_modulus_degree(),
        2 * first.plain_upper_half_threshold() - 1,
        first.total_coeff_modulus(),
    )
    expected = (params.poly_modulus_degree, params.plain_modulus, params.ciphertext_modulus)
    if actual != expected:
        raise BfvError(
            "BFV context does not match the agreed parameters: (N, t, q) = %s, expected %s" % (actual, expected)
        )


def _load_chunks(context: ts.Context, params: BfvParameters, chunks: Sequence[bytes]) -> list[ts.BFVVector]:
    if len(chunks) != params.chunk_count:
        raise BfvError(f"expected {params.chunk_count} ciphertexts, got {len(chunks)}")
    limit = max_ciphertext_bytes(params)
    vectors = []
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, bytes):
            raise BfvError(f"ciphertext {index} is {type(chunk).__name__}, not bytes")
        if len(chunk) > limit:
            raise BfvError(f"ciphertext {index} has {len(chunk)} bytes, more than {limit} possible for these parameters")
        try:
            vector = ts.bfv_vector_from(context, chunk)
        except Exception as error:  # TenSEAL's parsers raise several types on foreign or corrupt data
            raise BfvError(f"ciphertext {index} is not a BFV ciphertext for these parameters: {error}") from None
        expected = min(params.poly_modulus_degree, params.slot_count - index * params.poly_modulus_degree)
        if vector.size() != expected:
            raise BfvError(f"ciphertext {index} holds {vector.size()} slots, expected {expected}")
        vectors.append(vector)
    return vectors
