"""Settings read back from a peer's message: every field present, of its declared type, and finite.

A run's settings reach a hospital from the server, which it does not trust to be well formed:
``True`` is not a count, ``2.9`` is not 2, and ``1e300`` is not an epoch budget. Each value must
already have its field's type (an int may stand for a float); the dataclass then checks ranges.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypeVar

__all__ = ["from_typed_dict"]

T = TypeVar("T")
_TYPES = {"int": (int,), "float": (int, float), "str": (str,)}


def from_typed_dict(cls: type[T], values: dict, what: str, *, extra: dict[str, Any] | None = None) -> T:
    """``cls`` built from ``values``, which must hold exactly its fields (and ``extra``'s keys with those values)."""
    extra = extra or {}
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    if not isinstance(values, dict) or set(values) != set(fields) | set(extra):
        shown = sorted(values) if isinstance(values, dict) else type(values).__name__
        raise ValueError(f"{what} need exactly {sorted(set(fields) | set(extra))}, got {shown}")
    for key, expected in extra.items():
        if values[key] != expected:
            raise ValueError(f"{what} need {key} {expected!r}, got {values[key]!r}")
    for name, kind in fields.items():
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, _TYPES[kind]):
            raise ValueError(f"{what}: {name} must be {kind}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{what}: {name} must be finite, got {value!r}")
    return cls(**{name: float(values[name]) if fields[name] == "float" else values[name] for name in fields})
