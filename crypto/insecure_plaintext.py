"""Secure aggregation switched OFF: plaintext stand-ins for ``crypto.bfv``, for one benchmark only.

``consilium-bench-round`` times the same Dopamine round with secure aggregation on and off. Off, a
hospital sends its integer update in the clear and the server sums it: the server sees every
hospital's update, which carries only that hospital's share of the noise, so **no privacy claim
holds** in this mode. It exists for that comparison alone; its name says so wherever it is chosen
(``--insecure-plaintext-benchmark``), and a hospital only ever sends plaintext when its own operator
chose this, never because a server asked.

In this mode a round is an upload and the sum sent back (``protocol.run.server``, ``protocol.run.hospital``):
no key, share, endorsement or release. An upload is one chunk: the vector modulo ``2^32`` as little-endian 32-bit
words (the same bytes as float32), summed modulo ``2^32``: exact like the encrypted sum within the
sum bound, which is below ``2^31``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from consilium.crypto.bfv import BfvError
from consilium.crypto.bfv_parameters import BfvParameters

__all__ = ["InsecurePlaintextSum", "InsecurePlaintextUploads"]

_WORD = np.dtype("<u4")


class InsecurePlaintextUploads:
    """A hospital's updates and sums in the clear."""

    def __init__(self, params: BfvParameters) -> None:
        self.params = params

    def encrypt_update(self, values: np.ndarray, *, round_number: int, hospital: str) -> list[bytes]:
        """The update itself, modulo 2^32. Nothing is encrypted."""
        values = np.asarray(values)
        if values.shape != (self.params.vector_length,) or not np.issubdtype(values.dtype, np.integer):
            raise BfvError(
                f"expected a vector of {self.params.vector_length} integers, got {values.dtype} of shape {values.shape}"
            )
        return [values.astype(_WORD).tobytes()]  # numpy's cast to uint32 is the reduction modulo 2^32

    def decrypt_sum(self, chunks: Sequence[bytes], *, round_number: int, contributors: Sequence[str]) -> np.ndarray:
        """The sum in ``[-2^31, 2^31)``. Nothing is decrypted or checked."""
        return _words(chunks, self.params).view("<i4").astype(np.int64)


class InsecurePlaintextSum:
    """The server's sum of plaintext updates."""

    def __init__(self, params: BfvParameters) -> None:
        self._params = params
        self._total = np.zeros(params.vector_length, dtype=_WORD)
        self.contributions = 0

    def add(self, chunks: Sequence[bytes]) -> None:
        if self.contributions >= self._params.max_contributors:
            raise BfvError(
                f"this sum already holds {self.contributions} contributions, the most these parameters allow"
            )
        self._total += _words(chunks, self._params)  # uint32 wraps: the sum modulo 2^32
        self.contributions += 1

    def to_chunks(self) -> list[bytes]:
        if not self.contributions:
            raise BfvError("the sum is empty")
        return [self._total.tobytes()]


def _words(chunks: Sequence[bytes], params: BfvParameters) -> np.ndarray:
    if len(chunks) != 1 or type(chunks[0]) is not bytes or len(chunks[0]) != params.vector_length * _WORD.itemsize:
        raise BfvError(f"a plaintext update is one chunk of {params.vector_length * _WORD.itemsize} bytes")
    return np.frombuffer(chunks[0], dtype=_WORD)
