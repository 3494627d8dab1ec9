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
epsilon. It is an append-only file of JSON lines, one fsynced line per record, so a long run costs
the same per round as a short one; a later line for the same step replaces an earlier one (a
reservation settled with the noise actually present). A final line cut short by a crash was never
acknowledged, so nothing was released on its strength: it is dropped on the next start.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from pathlib import Path

from opacus.accountants import PRVAccountant, RDPAccountant

__all__ = [
    "ACCOUNTANTS",
    "LEDGER_FILE",
    "VIEWS",
    "LedgerError",
    "PrivacyLedger",
    "aggregate_noise_multiplier",
    "round_noise_multipliers",
]

ACCOUNTANTS = ("rdp", "prv")
LEDGER_FILE = "privacy_ledger.jsonl"
# Who looks at the released sum: the server knows no noise share, a fellow contributor its own.
VIEWS = ("server", "peer_hospital")
_HEADER = {"format": "consilium-privacy-ledger", "version": 2}

log = logging.getLogger("consilium.accounting")


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
        elif path is not None:
            _append(path, _HEADER)

    @property
    def steps(self) -> int:
        return len(self._entries)

    def record(self, key: str, *, sample_rate: float, noise_multipliers: dict[str, float]) -> None:
        """Add or replace the step ``key``, and make it durable before returning."""
        if set(noise_multipliers) != set(VIEWS):
            raise ValueError(f"need a noise multiplier for each of {VIEWS}")
        entry = {"sample_rate": float(sample_rate), "noise_multipliers": {k: float(v) for k, v in noise_multipliers.items()}}
        if self._path is not None:
            _append(self._path, {"key": key, **entry})
        self._entries[key] = entry

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
        text = path.read_bytes().decode()
    except (OSError, UnicodeDecodeError) as error:
        raise LedgerError(f"cannot read privacy ledger {path}: {error}") from None
    complete, _, torn = text.rpartition("\n")
    if torn:
        # An unterminated last line is a record cut short by a crash, which was never acknowledged,
        # so nothing was released on its strength. Anything else unreadable is refused below.
        if not complete and not _line(_HEADER).decode().startswith(torn):
            raise _unreadable(path, "not a privacy ledger")
        log.warning("privacy ledger %s: dropping an incomplete last record", path)
        _truncate(path, len(complete.encode()) + 1 if complete else 0)
    if not complete:
        _append(path, _HEADER)
        return {}
    try:
        header, *records = (json.loads(line) for line in complete.split("\n"))
        if header != _HEADER:
            raise ValueError("not a privacy ledger of a known version")
        entries = {}
        for record in records:
            key = record.pop("key")
            if not (isinstance(key, str) and 0 < float(record["sample_rate"]) <= 1):
                raise ValueError(f"malformed record for {key!r}")
            if set(record["noise_multipliers"]) != set(VIEWS):
                raise ValueError(f"record {key!r} lacks a view")
            entries[key] = record
        return entries
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise _unreadable(path, str(error)) from None


def _unreadable(path: Path, reason: str) -> LedgerError:
    return LedgerError(
        f"privacy ledger {path} is unreadable ({reason}); refusing to continue, as it is the only "
        "record of the privacy already spent"
    )


def _line(record: dict) -> bytes:
    return (json.dumps(record, separators=(",", ":")) + "\n").encode()


def _append(path: Path, record: dict) -> None:
    line = _line(record)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        created = not path.exists()
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(descriptor, line)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        if created:  # a new file is durable only once its directory entry is
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
    except OSError as error:
        raise LedgerError(f"cannot write privacy ledger {path}: {error}") from None


def _truncate(path: Path, size: int) -> None:
    try:
        os.truncate(path, size)
    except OSError as error:
        raise LedgerError(f"cannot repair privacy ledger {path}: {error}") from None
