"""Command-line flags a method declares beside its settings, and the checks of their values.

A method (``training.methods.registry``, ``training.voting.vote_privacy``, ``training.methods.baselines``) lists the flags it
reads as ``Flag`` values, each with its default for that method; the launchers build their
argument groups from those lists (``scripts._cli``). Two methods may declare the same flag with
different defaults and help: it is one argument, and each method fills in its own default.
Every ``kind`` turns the text a user typed into a value or raises ``argparse.ArgumentTypeError``
with a one-line reason.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

__all__ = [
    "Flag",
    "below_one",
    "image_size",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "probability",
    "rate",
    "widths",
]


@dataclass(frozen=True)
class Flag:
    name: str  # as typed: "--noise-multiplier"
    kind: Callable[[str], Any]
    default: Any  # this method's; None where it depends on something else (the data, another flag)
    help: str

    @property
    def destination(self) -> str:
        """The attribute argparse stores it under: ``noise_multiplier``."""
        return self.name[2:].replace("-", "_")


def positive_float(text: str) -> float:
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {text}")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {text}")
    return value


def probability(text: str) -> float:
    """A number in (0, 1): delta, a quantile."""
    value = _number(text, float)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {text}")
    return value


def rate(text: str) -> float:
    """A number in (0, 1]: a sampling rate."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def below_one(text: str) -> float:
    """A number in [0, 1): momentum, a confidence threshold."""
    value = _number(text, float)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def widths(text: str) -> tuple[int, ...]:
    """Comma-separated hidden widths; empty for a linear model."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated widths, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"widths must be positive, got {text!r}")
    return values


def image_size(text: str) -> tuple[int, int]:
    """``H,W`` or ``N`` (square) pixels, each from 1 to 4096."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HEIGHT,WIDTH or SIZE in pixels, got {text!r}") from None
    values = values * 2 if len(values) == 1 else values
    if len(values) != 2 or not all(1 <= v <= 4096 for v in values):
        raise argparse.ArgumentTypeError(f"expected HEIGHT,WIDTH or SIZE of 1 to 4096 pixels, got {text!r}")
    return values


def _number(text: str, kind: type):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text}") from None
    if kind is float and value != value:
        raise argparse.ArgumentTypeError("not a number: nan")
    return value
