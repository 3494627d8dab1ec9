"""Privacy accounting: the noise a released sum actually carries, and a durable ledger of it.

**Noise actually present.** Each contributing hospital adds ``N(0, sigma^2 C^2 / K_min)`` to its
clipped gradient sum (``training.dopamine``). The decrypted sum of ``K_c`` contributions therefore
carries ``N(0, K_c sigma^2 C^2 / K_min)``, while adding or removing one record changes it by at most
``C`` in L2 norm. To an observer who knows ``k`` of the noise shares (the server knows none; a
contributing hospital knows its own), one round is the sampled Gaussian mechanism with sampling rate
``q`` and noise multiplier::

    z = sigma * sqrt((K_c - k) / K_min)

Dividing by ``B`` and ``K_c``, momentum and the model itself are post-processing. Rounds compose;
Opacus's RDP accountant (default) or PRV accountant turns the steps into ``(epsilon, delta)``. With
``K_c = K_min`` and ``k = 0`` this is exactly central DP-SGD with noise multiplier sigma.

Two approximations, stated rather than hidden: each share is rounded to the fixed-point grid before
summation, so the noise is Gaussian plus a rounding term whose standard deviation is about 1/220 of
a share's (``training.dopamine.encoding_range``); and a clamped coordinate is no longer the Gaussian
mechanism, so clamps are counted and reported. An exact integer mechanism (Skellam or the
distributed discrete Gaussian) is the planned replacement.

**The ledger** records every release a party's data took part in, written to disk before the
release leaves (so a crash can only over-count) and read back on start, so a restart never resets
epsilon.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import Counter
from pathlib import Path

from opacus.accountants import PRVAccountant, RDPAccountant

__all__ = [
    "ACCOUNTANTS",
    "VIEWS",
    "LedgerError",
    "PrivacyLedger",
    "aggregate_noise_multiplier",
    "round_noise_multipliers",
]

ACCOUNTANTS = ("rdp", "prv")
# Who looks at the released sum: the server knows no noise share, a fellow contributor its own.
VIEWS = ("server", "peer_hospital")
_FORMAT = "consilium-privacy-ledger"
_VERSION = 1


class LedgerError(RuntimeError):
    """A privacy ledger that cannot be read or written."""


def aggregate_noise_multiplier(noise_multiplier: float, contributors: int, quorum: int, known_shares: int = 0) -> float:
    """``sigma * sqrt((K_c - k) / K_min)``: the noise multiplier of a sum of ``K_c`` shares, ``k`` of them known."""
    if not 0 <= known_shares <= contributors:
        raise ValueError(f"known_shares must be between 0 and {contributors}, got {known_shares}")
    return noise_multiplier * math.sqrt((contributors - known_shares) / quorum)


def round_noise_multipliers(noise_multiplier: float, contributors: int, quorum: int) -> dict[str, float]:
    """The noise multiplier of one released sum, for each view in ``VIEWS``."""
    return {
        "server": aggregate_noise_multiplier(noise_multiplier, contributors, quorum),
        # A lone contributor has no contributing peer; the others know no share of its sum.
        "peer_hospital": aggregate_noise_multiplier(noise_multiplier, contributors, quorum, min(1, contributors - 1)),
    }


class PrivacyLedger:
    """Steps of the sampled Gaussian mechanism, keyed (e.g. ``run/round``), optionally kept in a file."""

    def __init__(self, path: Path | None = None, accountant: str = "rdp") -> None:
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"unknown accountant {accountant!r}; choose from {', '.join(ACCOUNTANTS)}")
        self._path = path
        self._accountant = accountant
        self._entries: dict[str, dict] = {}
        if path is not None and path.exists():
            self._entries = _read(path)

    @property
    def steps(self) -> int:
        return len(self._entries)

    def record(self, key: str, *, sample_rate: float, noise_multipliers: dict[str, float]) -> None:
        """Add or replace the step ``key``, and make it durable before returning."""
        if set(noise_multipliers) != set(VIEWS):
            raise ValueError(f"need a noise multiplier for each of {VIEWS}")
        self._entries[key] = {"sample_rate": float(sample_rate), "noise_multipliers": dict(noise_multipliers)}
        if self._path is not None:
            _write_atomically(self._path, {"format": _FORMAT, "version": _VERSION, "entries": self._entries})

    def epsilon(self, delta: float, *, view: str = "server", extra: tuple[float, float] | None = None) -> float:
        """Epsilon at ``delta`` spent so far, plus one more step ``(noise_multiplier, sample_rate)`` if given."""
        if view not in VIEWS:
            raise ValueError(f"unknown view {view!r}; choose from {', '.join(VIEWS)}")
        steps = Counter((e["noise_multipliers"][view], e["sample_rate"]) for e in self._entries.values())
        if extra is not None:
            steps[extra] += 1
        if not steps:
            return 0.0
        if any(z <= 0 for z, _ in steps):
            return math.inf
        accountant = RDPAccountant() if self._accountant == "rdp" else PRVAccountant()
        accountant.history = [(z, q, count) for (z, q), count in steps.items()]
        return float(accountant.get_epsilon(delta))


def _read(path: Path) -> dict[str, dict]:
    try:
        document = json.loads(path.read_text())
        if document.get("format") != _FORMAT or document.get("version") != _VERSION:
            raise ValueError("not a privacy ledger of a known version")
        entries = document["entries"]
        for entry in entries.values():
            if not (0 < float(entry["sample_rate"]) <= 1 and set(entry["noise_multipliers"]) == set(VIEWS)):
                raise ValueError("an entry is malformed")
        return entries
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise LedgerError(
            f"privacy ledger {path} is unreadable ({error}); refusing to continue, as it is the only "
            "record of the privacy already spent"
        ) from None


def _write_atomically(path: Path, document: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(descriptor, "w") as handle:
            json.dump(document, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as error:
        raise LedgerError(f"cannot write privacy ledger {path}: {error}") from None
