"""The privacy ledger's file: JSON lines, each chained to the one before by a MAC, and a head beside it.

Since version 4 every line carries a MAC under the party's ledger key ``k`` (a secret only its party
holds), chained from a start bound to the file's name (``genesis``, ``chain_mac``)::

    m_0 = HMAC-SHA256(k, "consilium ledger genesis|" || name),    m_i = HMAC-SHA256(k, m_{i-1} || r_i)

where ``r_i`` is record ``i`` without its MAC, as sorted, compact JSON. A record edited, deleted or
moved breaks the chain from there on, and another of the party's ledgers cannot stand in for this
one. A cut at the end would break nothing, so the head (``<ledger>.head``, replaced whole after
each line, ``head_text``) holds how many chained lines ``n`` there are, ``m_n``, and its own tag
``HMAC-SHA256(k, "consilium ledger head|n|" || m_n)``. The chain's first record is the version 4
header (``HEADER``) with the SHA-256 of the unchained lines before it, so those cannot change either.

Versions 2 and 3 did not chain their records (``read_unchained``; a ledger of theirs is read once
to be chained on); version 2 recorded Gaussian steps by noise multiplier for the server and peer
views only (``GaussianRelease``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from consilium.training.privacy.rdp import ORDERS, gaussian_rdp, poisson_subsampled_rdp

__all__ = [
    "HEADER",
    "HEAD_SUFFIX",
    "LEGACY_HEADER",
    "V3_HEADER",
    "GaussianRelease",
    "chain_mac",
    "genesis",
    "head_path",
    "head_text",
    "is_chained_header",
    "json_line",
    "read_head",
    "read_unchained",
]

HEADER = {"format": "consilium-privacy-ledger", "version": 4}
V3_HEADER = {"format": "consilium-privacy-ledger", "version": 3}
LEGACY_HEADER = {"format": "consilium-privacy-ledger", "version": 2}
HEAD_SUFFIX = ".head"
_V2_VIEWS = ("server", "peer_hospital")


@dataclass(frozen=True)
class GaussianRelease:
    """A step recorded by ledger version 2: the sampled Gaussian mechanism, server and peer views."""

    sample_rate: float
    noise_multipliers: tuple[tuple[str, float], ...]

    def rdp(self, view: str) -> np.ndarray:
        z = dict(self.noise_multipliers).get(view)
        if z is None:  # version 2 recorded neither the coalition nor the collusion view: nothing is known of them
            return np.full(len(ORDERS), np.inf)
        return poisson_subsampled_rdp(ORDERS, self.sample_rate, gaussian_rdp(ORDERS, noise_multiplier=z))

    @classmethod
    def from_record(cls, record: dict) -> GaussianRelease:
        multipliers = record["noise_multipliers"]
        if set(multipliers) != set(_V2_VIEWS) or not 0 < float(record["sample_rate"]) <= 1:
            raise ValueError("malformed version 2 record")
        return cls(float(record["sample_rate"]), tuple((v, float(multipliers[v])) for v in _V2_VIEWS))


def json_line(record: dict) -> bytes:
    return (json.dumps(record, separators=(",", ":")) + "\n").encode()


def chain_mac(key: bytes, previous: bytes, record: dict) -> bytes:
    """HMAC-SHA256 of the previous MAC and a record (without its own MAC), in one canonical JSON form."""
    return hmac.new(
        key, previous + json.dumps(record, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256
    ).digest()


def genesis(key: bytes, path: Path) -> bytes:
    """Where a ledger's chain starts: bound to its file's name, so a party's ledgers cannot stand in for one another."""
    return hmac.new(key, b"consilium ledger genesis|" + path.name.encode(), hashlib.sha256).digest()


def is_chained_header(line: bytes) -> bool:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(record, dict) and all(record.get(k) == v for k, v in HEADER.items())


def head_path(path: Path) -> Path:
    return path.with_name(path.name + HEAD_SUFFIX)


def head_text(key: bytes, lines: int, chain: bytes) -> bytes:
    """How many chained lines the ledger holds and the MAC of the last: so a cut at its end shows."""
    return json.dumps({"lines": lines, "mac": chain.hex(), "tag": _head_tag(key, lines, chain).hex()}).encode()


def _head_tag(key: bytes, lines: int, chain: bytes) -> bytes:
    return hmac.new(key, b"consilium ledger head|%d|" % lines + chain, hashlib.sha256).digest()


def read_head(path: Path, key: bytes) -> tuple[int, bytes] | None:
    """The head of the ledger at ``path``, ``(lines, MAC of the last)``, or None if it has none; ``ValueError``
    if the head is damaged (its tag does not verify under ``key``)."""
    head = head_path(path)
    if not head.exists():
        return None
    try:
        record = json.loads(head.read_bytes())
        lines, chain = record["lines"], bytes.fromhex(record["mac"])
        if (
            type(lines) is not int
            or lines < 0
            or not hmac.compare_digest(bytes.fromhex(record["tag"]), _head_tag(key, lines, chain))
        ):
            raise ValueError("its MAC does not verify")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        raise ValueError(f"its head {head.name} is damaged: {error!s:.200}") from None
    return lines, chain


def read_unchained(lines: list[bytes]) -> tuple[list[GaussianRelease], list[dict]]:
    """Version 2 and 3 lines, written before records were chained: version 2's steps, each a release,
    and the records after them, as they are; ``ValueError`` if the lines are of no known version."""
    header, *records = (json.loads(line) for line in lines)
    steps = []
    if header == LEGACY_HEADER:
        # Version 2 records come first; a version 3 header marks where newer records begin.
        upgraded = records.index(V3_HEADER) if V3_HEADER in records else None
        # Every line counts: version 2 keyed lines by the server's run id and round, so a
        # later line replacing an earlier one may hide a release. (A reservation and its
        # settlement are then both charged: over-counting is the safe side.)
        steps = [GaussianRelease.from_record(record) for record in records[:upgraded]]
        records = records[upgraded + 1 :] if upgraded is not None else []
    elif header != V3_HEADER:
        raise ValueError("not a privacy ledger of a known version")
    return steps, records
