"""Fixed-point encoding of real vectors into the integers BFV slots hold.

``encode(x) = clip(round(x * scale), -B, B)`` and ``decode(n) = n / scale``. Decoding a sum of
``K`` encodings gives the sum of the inputs to within ``K / (2 * scale)`` per coordinate, as long
as no input was clamped; clamping is counted so that a caller can report it rather than hide it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Encoded", "FixedPointCodec"]


@dataclass(frozen=True)
class Encoded:
    levels: np.ndarray  # int64, each in [-max_level, max_level]
    clamped: int  # how many coordinates were outside [-bound, bound] and were clamped


class FixedPointCodec:
    def __init__(self, *, scale: float, max_level: int) -> None:
        if not scale > 0:
            raise ValueError(f"scale must be positive, got {scale}")
        if max_level < 1:
            raise ValueError(f"max_level must be at least 1, got {max_level}")
        self.scale = scale
        self.max_level = max_level

    def encode(self, values: np.ndarray) -> Encoded:
        values = np.asarray(values, dtype=np.float64)
        if not np.all(np.isfinite(values)):
            raise ValueError("cannot encode NaN or infinite values")
        levels = np.rint(values * self.scale)
        clamped = int(np.count_nonzero(np.abs(levels) > self.max_level))
        np.clip(levels, -self.max_level, self.max_level, out=levels)
        return Encoded(levels=levels.astype(np.int64), clamped=clamped)

    def decode(self, levels: np.ndarray) -> np.ndarray:
        return np.asarray(levels, dtype=np.float64) / self.scale
