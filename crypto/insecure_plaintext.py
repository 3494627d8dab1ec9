"""Secure aggregation switched OFF: plaintext stand-ins for ``crypto.bfv``, for one benchmark only.

``consilium-bench-round`` times the same Dopamine round with secure aggregation on and off. Off, a
hospital sends its integer update in the clear and the server sums it: the server sees every
hospital's update, which carries only that hospital's share of the noise, so **no privacy claim
holds** in this mode. It exists for that comparison alone; its name says so wherever it is chosen
(``--insecure-plaintext-benchmark``), and a hospital only ever sends plaintext when its own operator
chose this, never because a server asked.

The stand-ins keep ``SecretContext``'s and ``CiphertextSum``'s interface, so that the round is the
same code in both modes. An upload is one chunk: the vector modulo ``t`` as little-endian 32-bit
words (``t < 2^32``, so the same bytes as float32); the sum is reduced modulo ``t`` like the
encrypted one. Check slots are part of secure aggregation and are left out.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from crypto.bfv import BfvError
from crypto.bfv_parameters import BfvParameters

__all__ = ["InsecurePlaintextSum", "InsecurePlaintextUploads"]

_WORD = np.dtype("<u4")


class InsecurePlaintextUploads:
    """A hospital's updates and sums in the clear, in place of ``SecretContext``."""

    def __init__(self, params: BfvParameters) -> None:
        self.params = params

    def encrypt_update(self, values: np.ndarray, *, round_number: int, hospital: str) -> list[bytes]:
        """The update itself, modulo t. Nothing is encrypted."""
        values = np.asarray(values)
        if values.shape != (self.params.vector_length,) or not np.issubdtype(values.dtype, np.integer):
            raise BfvError(f"expected a vector of {self.params.vector_length} integers, got {values.dtype} of shape {values.shape}")
        return [np.mod(values, self.params.plain_modulus).astype(_WORD).tobytes()]

    def decrypt_sum(self, chunks: Sequence[bytes], *, round_number: int, contributors: Sequence[str]) -> np.ndarray:
        """The sum in ``(-t/2, t/2]``. Nothing is decrypted or checked."""
        total = _words(chunks, self.params)
        return np.where(total > self.params.plain_modulus // 2, total - self.params.plain_modulus, total)


class InsecurePlaintextSum:
    """The server's sum of plaintext updates, in place of ``CiphertextSum``."""

    def __init__(self, params: BfvParameters) -> None:
        self._params = params
        self._total = np.zeros(params.vector_length, dtype=np.int64)
        self.contributions = 0

    def add(self, chunks: Sequence[bytes]) -> None:
        if self.contributions >= self._params.max_contributors:
            raise BfvError(f"this sum already holds {self.contributions} contributions, the most these parameters allow")
        self._total = (self._total + _words(chunks, self._params)) % self._params.plain_modulus
        self.contributions += 1

    def to_chunks(self) -> list[bytes]:
        if not self.contributions:
            raise BfvError("the sum is empty")
        return [self._total.astype(_WORD).tobytes()]


def _words(chunks: Sequence[bytes], params: BfvParameters) -> np.ndarray:
    if len(chunks) != 1 or len(chunks[0]) != params.vector_length * _WORD.itemsize:
        raise BfvError(f"a plaintext update is one chunk of {params.vector_length * _WORD.itemsize} bytes")
    words = np.frombuffer(chunks[0], dtype=_WORD).astype(np.int64)
    if np.any(words >= params.plain_modulus):
        raise BfvError("a plaintext update has words outside [0, t)")
    return words
