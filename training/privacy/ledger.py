"""A party's privacy ledger: every release its data took part in, durable and tamper-evident.

Each release is written to disk before it leaves (so a crash can only over-count) and read back on
start, so a restart never resets epsilon. Each record is keyed by an identifier the ledger draws itself, never by anything the
server chooses: a server that repeats a run id or a round cannot make two releases count as one.
A run id is accepted again only to resume that same run (the same fingerprint: every setting and the
initial model, ``protocol.run.config.RunConfig.fingerprint``); ``begin_run`` then returns the last round
recorded, and a party takes part only in later rounds. A hospital also records each step of the
secure round that commits it, ``endorsed`` and ``released`` (``ROUND_STEPS``), before the message
leaves, and the ledger refuses to record one twice for a round: a hospital never releases twice for a
round, restarted or not (``docs/explanation/secure-round.md``, P5). The file is append-only
JSON lines, one fsynced line per record, each chained to the one before by a MAC under a key only
its party holds (``training.privacy.ledger_file``); a final line cut short by a crash was never
acknowledged (so nothing was released on its strength) and is dropped on the next start; anything
else unreadable is refused. One process at a time may hold a ledger file (an exclusive lock), so two
processes cannot each count only their own releases. Records hold the mechanism's parameters,
not epsilons, so any accountant can read them. A voting round that released nothing is cancelled by a
void record that keeps every tallier's signature (``void``, ``protocol.voting.round_void``); a reader
older than void records refuses a ledger that holds one, rather than count it wrongly.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import hmac
import json
import logging
import os
import secrets
import weakref
from collections import Counter
from pathlib import Path

import numpy as np

from consilium.errors import ConsiliumError
from consilium.training.privacy.durable import append_line, replace_file
from consilium.training.privacy.accounting import VIEWS, Release
from consilium.training.privacy.ledger_file import (
    HEAD_SUFFIX,
    HEADER,
    LEGACY_HEADER,
    V3_HEADER,
    GaussianRelease,
    chain_mac,
    genesis,
    head_path,
    head_text,
    is_chained_header,
    json_line,
    read_head,
    read_unchained,
)
from consilium.training.privacy.rdp import ORDERS, rdp_to_epsilon

__all__ = ["LEDGER_FILE", "ROUND_STEPS", "LedgerError", "PrivacyLedger", "view_index"]

LEDGER_FILE = "privacy_ledger.jsonl"
ROUND_STEPS = ("endorsed", "released")

log = logging.getLogger("consilium.accounting")


class LedgerError(ConsiliumError, RuntimeError):
    """A privacy ledger that cannot be read or written, or a record it must refuse."""


@functools.lru_cache(maxsize=1024)
def _rdp(release: Release | GaussianRelease, view: str) -> np.ndarray:
    """A release's RDP curve for a view: a run repeats a few releases, so each is computed once."""
    curve = release.rdp(view)
    curve.flags.writeable = False  # shared by every caller
    return curve


class PrivacyLedger:
    """Releases a party's data took part in, keyed by identifiers the ledger draws, optionally in a file
    (then tamper-evident under ``key``, a secret only its party holds)."""

    def __init__(self, path: Path | None = None, *, key: bytes | None = None, accept_unchained: bool = False) -> None:
        if path is not None and (key is None or len(key) < 32):
            raise ValueError("a ledger file needs its party's 32-byte MAC key")
        self._path = path
        self._key = key
        self._accept_unchained = accept_unchained  # a version 2 or 3 ledger, read once to be chained on
        self._entries: dict[str, Release | GaussianRelease] = {}
        self._runs: dict[str, str | None] = {}  # run id -> its fingerprint (None in older ledgers)
        self._last_round: dict[str, int] = {}
        self._finished: set[str] = set()
        self._steps: set[tuple[str, int, str]] = set()  # (run id, round, step) taken
        self._charges: dict[tuple[str, int], list[str]] = {}  # (run id, round) -> the keys of its releases
        self._voided: set[tuple[str, int]] = set()  # rounds whose charges a void cancelled
        self._locked = False
        self._size = path.stat().st_size if path is not None and path.exists() else 0
        # Repairs wait for the first write, made under the lock: a torn last line to cut, a chained header.
        self._complete_size = self._size
        self._chain: bytes | None = None  # the last MAC, once the file holds a chained header
        self._chained_lines = 0
        if path is not None:
            self._read(path)

    @property
    def steps(self) -> int:
        return len(self._entries)

    def begin_run(self, run_id: str, fingerprint: str) -> int:
        """Begin a run, durably, or resume one begun with the same fingerprint; returns its last recorded round.

        A run id seen before under another fingerprint is refused (a server may not reuse a run id),
        and so is a run this party finished (``finish_run``)."""
        if refusal := self.begin_refusal(run_id, fingerprint):
            raise LedgerError(refusal)
        if run_id in self._runs:
            return self._last_round.get(run_id, 0)
        self._write({"run": run_id, "fingerprint": fingerprint})
        self._runs[run_id] = fingerprint
        return 0

    def begin_refusal(self, run_id: str, fingerprint: str) -> str:
        """Why ``begin_run`` would refuse the run, or "" where it would begin or resume it; writes nothing."""
        if run_id in self._finished:
            return f"run {run_id} is over for this party (its ledger says so); a party takes part in a run once"
        if self._runs.get(run_id, fingerprint) != fingerprint:
            return (
                f"run {run_id} is already in this privacy ledger with other settings: a server may not reuse a run id"
            )
        return ""

    def finish_run(self, run_id: str) -> None:
        """Mark ``run_id`` over, durably: it is never begun again."""
        if run_id not in self._finished:
            self._write({"finished": run_id})
            self._finished.add(run_id)

    def record(self, release: Release, *, run_id: str, round_number: int) -> None:
        """Add ``release`` under a fresh identifier, durably before returning."""
        if run_id not in self._runs or run_id in self._finished:
            raise LedgerError(f"run {run_id} was not begun in this ledger, or is over")
        key = secrets.token_hex(16)
        self._write({"key": key, "run": run_id, "round": round_number, **release.to_record()})
        self._add(key, release, run_id, round_number)

    def void(self, *, run_id: str, round_number: int, evidence: dict[str, str]) -> None:
        """Cancel, durably, the charges of a round that released nothing, with ``evidence``, every tallier's signed
        void; it stays the run's last round. ``LedgerError`` if not charged here, or voided already."""
        if not self._charges.get((run_id, round_number)) or (run_id, round_number) in self._voided:
            raise LedgerError(f"round {round_number} of run {run_id} was not charged here, or is void already")
        self._write({"run": run_id, "round": round_number, "void": evidence})
        self._cancel(run_id, round_number)

    def voids(self, run_id: str) -> int:
        """How many rounds of ``run_id`` a void cancelled."""
        return sum(run == run_id for run, _ in self._voided)

    def record_step(self, step: str, *, run_id: str, round_number: int) -> None:
        """Write that this party took ``step`` (one of ``ROUND_STEPS``) in a round, durably, before the
        message that takes it leaves; ``LedgerError`` if it took that step in that round already."""
        if step not in ROUND_STEPS or run_id not in self._runs:
            raise LedgerError(f"cannot record step {step!r} of run {run_id}: unknown step, or the run was not begun")
        if (run_id, round_number, step) in self._steps:
            raise LedgerError(f"this party {step} round {round_number} of run {run_id} already; it does so once")
        self._write({"run": run_id, "round": round_number, "step": step})
        self._steps.add((run_id, round_number, step))

    def epsilon(self, delta: float, *, view: str = "server", extra: Release | None = None, times: int = 1) -> float:
        """Epsilon at ``delta`` for ``view`` spent so far, plus ``times`` more releases of ``extra`` if given."""
        view_index(view)
        counts = Counter(self._entries.values())
        if extra is not None and times > 0:
            counts[extra] += times
        if not counts:
            return 0.0
        total = sum(count * _rdp(release, view) for release, count in counts.items())
        return rdp_to_epsilon(ORDERS, total, delta)

    def epsilons(self, delta: float) -> dict[str, float]:
        """Epsilon at ``delta`` spent so far, for each view."""
        return {view: self.epsilon(delta, view=view) for view in VIEWS}

    def spent(self, delta: float) -> str:
        """Epsilon at ``delta`` spent so far, each view in words: a progress line, or a site's status."""
        return f"epsilon at delta {delta:g}: " + ", ".join(
            f"{epsilon:.3f} against the {view.replace('_', ' ')}" for view, epsilon in self.epsilons(delta).items()
        )

    def worst_epsilon(
        self, delta: float, *, up_to: str, extra: Release | None = None, times: int = 1
    ) -> tuple[float, str]:
        """The largest epsilon over ``VIEWS`` from the server's up to ``up_to`` (with ``times`` releases of
        ``extra``, as ``epsilon``), and the first view that reaches it."""
        views = VIEWS[: view_index(up_to) + 1]
        return max(
            ((self.epsilon(delta, view=view, extra=extra, times=times), view) for view in views),
            key=lambda pair: pair[0],
        )

    def last_round(self, run_id: str) -> int:
        """The last round of ``run_id`` this ledger charged (0 for a run it does not name); writes nothing."""
        return self._last_round.get(run_id, 0)

    # -- the file -------------------------------------------------------------------------------

    def _write(self, record: dict) -> None:
        if self._path is None:
            return
        if not self._locked:
            self._lock()
        head = head_path(self._path)
        try:
            if self._complete_size < self._size:
                os.truncate(self._path, self._complete_size)
            if self._chain is None:
                # The head exists before the first chained line: from then on a missing head is damage.
                replace_file(head, head_text(self._key, 0, genesis(self._key, self._path)))
                legacy = self._path.read_bytes()[: self._complete_size] if self._complete_size else b""
                self._chain = genesis(self._key, self._path)
                self._append({**HEADER, "legacy_sha256": hashlib.sha256(legacy).hexdigest()})
            self._append(record)
            replace_file(head, head_text(self._key, self._chained_lines, self._chain))
        except OSError as error:
            raise LedgerError(f"cannot write privacy ledger {self._path}: {error}") from None
        self._complete_size = self._path.stat().st_size
        self._size = self._complete_size

    def _append(self, record: dict) -> None:
        mac = chain_mac(self._key, self._chain, record)
        append_line(self._path, json_line({**record, "mac": mac.hex()}))
        self._chain = mac
        self._chained_lines += 1

    def close(self) -> None:
        """Let another writer have the file now, not when this ledger is collected (a service's next run may
        open it at once); a later write takes the lock again."""
        if self._locked:
            self._unlock()
            self._locked = False

    def _lock(self) -> None:
        """Hold the file exclusively from the first write until this ledger is gone, or closed.

        Readers take no lock. A writer that finds the file grown since it read it refuses to go on:
        its count would miss the other writer's releases."""
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(self._path, os.O_RDONLY | os.O_CREAT, 0o600)
        except OSError as error:
            raise LedgerError(f"cannot open privacy ledger {self._path}: {error}") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(descriptor)
            raise LedgerError(f"privacy ledger {self._path} is in use by another writer") from None
        self._unlock = weakref.finalize(self, os.close, descriptor)
        self._locked = True
        if os.fstat(descriptor).st_size != self._size:
            raise LedgerError(f"privacy ledger {self._path} changed since it was read; open it again")

    def _read(self, path: Path) -> None:
        try:
            head = read_head(path, self._key)
        except ValueError as error:
            raise _unreadable(path, str(error)) from None
        if not self._size:
            if head is not None and head[0]:
                raise _unreadable(
                    path, f"it is empty, but its head ({head_path(path).name}) counts {head[0]} records: truncated"
                )
            return
        try:
            raw = path.read_bytes()
        except OSError as error:
            raise LedgerError(f"cannot read privacy ledger {path}: {error}") from None
        complete, _, torn = raw.rpartition(b"\n")
        lines = complete.split(b"\n") if complete else []
        start = next((i for i, line in enumerate(lines) if is_chained_header(line)), None)
        if torn:
            # An unterminated last line is a record cut short by a crash (a short write on a full
            # disk, zeros after a power loss), which was never acknowledged: its head was not moved
            # over it, so nothing was released on its strength. Anything else unreadable is refused below.
            first_write = head is not None and head[0] == 0  # a new ledger's head comes before its first line
            if (
                not lines
                and not first_write
                and not any(json_line(h).startswith(torn) for h in (V3_HEADER, LEGACY_HEADER))
            ):
                raise _unreadable(path, "not a privacy ledger")
            log.warning("privacy ledger %s: dropping an incomplete last record", path)
            self._complete_size = len(complete) + 1 if complete else 0
        try:
            legacy = lines if start is None else lines[:start]
            if head is not None and start is None and head[0]:
                raise ValueError(f"its head counts {head[0]} chained records, but none is left: truncated")
            if legacy and head is None and not self._accept_unchained:
                raise ValueError(
                    "it was written before ledgers were chained, or its head was deleted and the file replaced; "
                    "if it is this party's own, older ledger, upgrade it once (consilium-hospital --upgrade-ledger)"
                )
            if legacy:
                self._read_legacy(legacy)
            if start is not None:
                self._read_chained(lines[start:], b"".join(line + b"\n" for line in legacy), head)
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
            raise _unreadable(path, str(error)) from None
        except RecursionError:
            raise _unreadable(path, "a record is nested too deeply") from None

    def _read_legacy(self, lines: list[bytes]) -> None:
        """Version 2 and 3 lines, written before records were chained: read as they are."""
        steps, records = read_unchained(lines)
        self._entries.update((f"v2-{number}", step) for number, step in enumerate(steps))
        for record in records:
            self._replay(record)

    def _read_chained(self, lines: list[bytes], legacy: bytes, head: tuple[int, bytes] | None) -> None:
        """Lines each carrying the MAC of the one before it and itself: one edited, deleted or moved
        breaks the chain, and the head (kept beside the file) shows where the chain must reach."""
        if head is None:
            raise ValueError(f"its head ({HEAD_SUFFIX}) is missing: a chained ledger always has one")
        chain = genesis(self._key, self._path)
        for number, line in enumerate(lines):
            record = json.loads(line)
            mac = bytes.fromhex(record.pop("mac"))
            if not hmac.compare_digest(mac, chain_mac(self._key, chain, record)):
                raise ValueError(
                    f"record {number + 1} of its chain was altered, or a record before it was (the MACs do not verify)"
                )
            chain = mac
            if number == head[0] - 1 and not hmac.compare_digest(chain, head[1]):
                raise ValueError("its chain does not pass through its head: records were removed or replaced")
            if number == 0:
                if record != {**HEADER, "legacy_sha256": hashlib.sha256(legacy).hexdigest()}:
                    raise ValueError("the lines before its chained header were altered")
            else:
                self._replay(record)
        if len(lines) < head[0]:
            raise ValueError(f"it holds {len(lines)} chained records, but its head counts {head[0]}: truncated")
        if len(lines) > head[0] + 1:  # one more is a record whose head a crash left behind; more is an old head
            raise ValueError(
                f"it holds {len(lines)} chained records, but its head counts {head[0]}: an old head was put back"
            )
        self._chain, self._chained_lines = chain, len(lines)

    def _replay(self, record: dict) -> None:
        if set(record) in ({"run"}, {"run", "fingerprint"}):
            self._runs[str(record["run"])] = record.get("fingerprint")
        elif set(record) == {"finished"}:
            self._finished.add(str(record["finished"]))
        elif set(record) == {"run", "round", "void"}:
            place, evidence = (record["run"], record["round"]), record["void"]
            if type(place[1]) is not int or not self._charges.get(place) or place in self._voided:
                raise ValueError(f"a void of a round not charged, or voided already {record!r:.200}")
            if not isinstance(evidence, dict) or not all(type(v) is str for v in evidence.values()):
                raise ValueError(f"a void whose evidence is not signatures {record!r:.200}")
            self._cancel(*place)
        elif set(record) == {"run", "round", "step"}:
            step = (record["run"], record["round"], record["step"])
            if (
                step[0] not in self._runs
                or type(step[1]) is not int
                or step[2] not in ROUND_STEPS
                or step in self._steps
            ):
                raise ValueError(f"malformed step record {record!r:.200}")
            self._steps.add(step)
        else:
            key, run, round_number = record.pop("key"), record.pop("run"), record.pop("round")
            if (
                not isinstance(key, str)
                or key in self._entries
                or run not in self._runs
                or type(round_number) is not int
            ):
                raise ValueError(f"malformed record {key!r}")
            self._add(key, Release.from_record(record), run, round_number)

    def _add(self, key: str, release: Release, run_id: str, round_number: int) -> None:
        self._entries[key] = release
        self._charges.setdefault((run_id, round_number), []).append(key)
        self._last_round[run_id] = max(self._last_round.get(run_id, 0), round_number)

    def _cancel(self, run_id: str, round_number: int) -> None:
        for key in self._charges.pop((run_id, round_number)):
            del self._entries[key]
        self._voided.add((run_id, round_number))


def view_index(view: str) -> int:
    """The place of ``view`` in ``VIEWS``, from the server's outwards; ``ValueError`` for a view that is not one."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; choose from {', '.join(VIEWS)}")
    return VIEWS.index(view)


def _unreadable(path: Path, reason: str) -> LedgerError:
    return LedgerError(
        f"privacy ledger {path} is unreadable ({reason}); refusing to continue, as it is the only "
        "record of the privacy already spent"
    )
