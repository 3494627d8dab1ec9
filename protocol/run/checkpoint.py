"""A server's checkpoint: what it needs to resume a run after a crash, replaced atomically; and its report.

Both servers write one. The training server (``Checkpoint``) writes it once hospitals hold the key,
before each RoundStart and after each round; the voting server (``VotingCheckpoint``) once every
party joined, before each VoteRequest, once a round's ballots are in, and after each round.
Round numbers are never reused: the number of rounds started is on disk before a round's first
message leaves, so a server resumed from any checkpoint starts a round no hospital has seen. A
training round that was under way when the server stopped is recorded as interrupted; the
hospitals' ledgers have charged it, and the server's model goes on from the last round it saw
through (its hospitals take that model when they join again). A voting round whose ballots were in
is tallied again from them (they are sealed to the talliers: the server holds nothing it can
open); one stopped before is recorded as interrupted. The privacy ledgers are not in the checkpoint:
they are durable on their own.

The file is JSON (bytes as base64: arrays of little-endian float32, sealed boxes), written to a
temporary file that is fsynced and then renamed over the old one, readable by its owner only: it
holds the model, which is DP-protected but still the consortium's. The report is written the same
way. Where the system refuses a write (a full disk, no descriptor left), ``write_retrying`` tries
again before it gives up with a one-line ``CheckpointError``.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, ClassVar

from consilium.errors import ConsiliumError
from consilium.protocol.run.rules import ConfigError
from consilium.protocol.wire.messages import ProtocolError
from consilium.training.privacy.durable import replace_file

__all__ = [
    "CHECKPOINT_FILE",
    "REPORT_FILE",
    "Checkpoint",
    "CheckpointError",
    "VotingCheckpoint",
    "join_record",
    "save_checkpoint",
    "write_at_the_end",
    "write_report",
    "write_retrying",
]

CHECKPOINT_FILE = "checkpoint.json"
REPORT_FILE = "server_report.json"
_WRITE_ATTEMPTS = 3
_WRITE_RETRY_S = 1.0

log = logging.getLogger("consilium.checkpoint")


class CheckpointError(ConsiliumError, RuntimeError):
    """A checkpoint that is missing, unreadable or cannot be written."""


class _CheckpointFile:
    """Saving and loading, shared by both checkpoints: ``_FORMAT`` names the kind and version, the fields
    in ``_BYTES`` hold bytes, or dictionaries of them (nested), kept as base64, and ``_ADDED`` the fields
    the version before lacked, read from it with their defaults."""

    _FORMAT: ClassVar[dict]
    _BYTES: ClassVar[tuple[str, ...]]
    _ADDED: ClassVar[dict] = {}

    def save(self, out_dir: Path) -> None:
        record = {**self._FORMAT, **asdict(self)}
        for name in self._BYTES:
            record[name] = _to_text(record[name])
        path = out_dir / CHECKPOINT_FILE
        try:
            replace_file(path, json.dumps(record).encode())
        except OSError as error:
            raise CheckpointError(f"cannot write the checkpoint {path}: {error}") from None

    @classmethod
    def load(cls, out_dir: Path):
        path = out_dir / CHECKPOINT_FILE
        if not path.exists():
            raise CheckpointError(f"{out_dir} holds no checkpoint to resume from ({CHECKPOINT_FILE})")
        try:
            record = json.loads(path.read_text())
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            found = {key: record.pop(key, None) for key in cls._FORMAT}
            if found == {**cls._FORMAT, "version": cls._FORMAT["version"] - 1} and cls._ADDED:
                record = {**cls._ADDED, **record}  # written by the version before, which lacked these
            elif found != cls._FORMAT:
                raise ValueError(f"not a {cls._FORMAT['format']} of version {cls._FORMAT['version']}")
            if set(record) != {f.name for f in fields(cls)}:
                raise ValueError(f"expected the fields {sorted(f.name for f in fields(cls))}")
            for name in cls._BYTES:
                record[name] = _from_text(record[name])
            checkpoint = cls(**record)
            if type(checkpoint.rounds_started) is not int or checkpoint.rounds_started < 0:
                raise ValueError("rounds_started must be a non-negative integer")
        except (OSError, ValueError, TypeError, AttributeError) as error:
            raise CheckpointError(f"the checkpoint {path} is unreadable: {error}") from None
        return checkpoint

    def run_config(self, config_class, out_dir: Path):
        """The run's configuration, as ``config_class`` (``RunConfig``, ``VotingConfig``) reads it."""
        try:
            return config_class.from_dict(self.config)
        except ConfigError as error:
            raise CheckpointError(f"the checkpoint in {out_dir} holds an unusable configuration: {error}") from None

    def membership(self, out_dir: Path) -> tuple[dict[str, str], list[dict], list[str]]:
        """Who left the run and why, the joins after its start, and who may not come back
        (``protocol.run.participants``)."""
        try:
            departures = {str(name): str(reason) for name, reason in dict(self.departures).items()}
            expelled = [str(name) for name in self.expelled]
            return departures, [join_record(join) for join in self.joins], expelled
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            raise CheckpointError(f"the checkpoint in {out_dir} is unusable: {error}") from None


@dataclass(frozen=True)
class Checkpoint(_CheckpointFile):
    """A training run's (``protocol.run.server``)."""

    _FORMAT = {"format": "consilium-server-checkpoint", "version": 4}
    _BYTES = ("initial_parameters", "parameters", "optimizer_state")
    _ADDED = {"expelled": []}

    config: dict  # protocol.run.config.RunConfig.to_dict, with the hospitals that joined
    initial_parameters: bytes  # float32: with the config, the run's fingerprint
    parameters: bytes  # float32: the model after the last round the server saw through
    optimizer_state: bytes  # float32: its update rule's state (training.methods.update_rules)
    rounds_started: int  # the next round is this plus one, whatever happened to this one
    active: list[str]  # hospitals taking part when the checkpoint was written
    rounds: list[dict]  # the report's round records
    departures: dict[str, str]
    joins: list[dict]
    selection: dict = field(
        default_factory=dict
    )  # training.models.evaluation.Selection's fields: how the model is selected
    expelled: list[str] = field(default_factory=list)  # hospitals never welcomed again (protocol.run.participants)


@dataclass(frozen=True)
class VotingCheckpoint(_CheckpointFile):
    """A voting run's (``protocol.voting.voting_server``)."""

    _FORMAT = {"format": "consilium-voting-checkpoint", "version": 2}
    _BYTES = ("feature_map", "tallier_keys", "pending_ballots")
    _ADDED = {"expelled": []}

    config: dict  # protocol.voting.voting_config.VotingConfig.to_dict, with the hospitals that joined
    feature_map: bytes  # with the config, the run's fingerprint
    data_digest: str  # of the public pool and test split: a resumed server must hold the same
    order: list[int]  # the public pool's order: round r asks records order[(r - 1) Q : r Q]
    tallier_keys: dict[str, bytes]  # each tallier's certified box key for the run
    rounds_started: int  # the next round is this plus one, whatever happened to this one
    rounds: list[dict]  # the report's round records
    labelled: list[list[list[int]]]  # per labelled round: the pool indices and their labels
    active: list[str]
    departures: dict[str, str]
    joins: list[dict]  # hospitals that joined again, and before which round (protocol.run.participants)
    pending_round: int  # the round whose ballots are in but whose labels are not yet (0: none)
    pending_ballots: dict[str, dict[str, bytes]]  # its ballots: voter -> tallier -> sealed box
    expelled: list[str] = field(default_factory=list)  # hospitals never welcomed again (protocol.run.participants)


def join_record(join: dict) -> dict:
    """A join as a checkpoint holds it. One written before joins were told apart counts as one that broke a
    round, as every join did then."""
    return {
        "hospital": str(join["hospital"]),
        "before_round": int(join["before_round"]),
        "broke_round": bool(join.get("broke_round", True)),
    }


def _to_text(value: bytes | dict) -> str | dict:
    if isinstance(value, dict):
        return {key: _to_text(item) for key, item in value.items()}
    return base64.b64encode(value).decode()


def _from_text(value: str | dict) -> bytes | dict:
    if isinstance(value, dict):
        return {str(key): _from_text(item) for key, item in value.items()}
    if not isinstance(value, str):
        raise ValueError("a bytes field must be base64 text")
    return base64.b64decode(value, validate=True)


def write_report(out_dir: Path, report: dict) -> None:
    """A server's ``server_report.json``, replaced whole (never half written)."""
    replace_file(out_dir / REPORT_FILE, json.dumps(report, indent=1).encode())


def write_retrying(write: Callable[[], None], what: str) -> None:
    """Run ``write``; when the system refuses (a full disk, no descriptor left), try again a second
    later, up to ``_WRITE_ATTEMPTS`` times, then raise ``CheckpointError`` naming ``what``."""
    for attempt in range(1, _WRITE_ATTEMPTS + 1):
        try:
            write()
            return
        except (OSError, CheckpointError) as error:
            if attempt == _WRITE_ATTEMPTS:
                raise CheckpointError(f"cannot write {what}: {error}") from None
            log.warning("cannot write %s (%s); trying again", what, error)
            time.sleep(_WRITE_RETRY_S)


def save_checkpoint(checkpoint: Checkpoint | VotingCheckpoint, out_dir: Path, *, required: bool) -> str:
    """Write a server's checkpoint. Where the system refuses (a full disk, no descriptor left) the one before
    stands: returns "" once written, else why not; ``ProtocolError`` where ``required`` (no round starts
    before its number is on disk)."""
    try:
        write_retrying(lambda: checkpoint.save(out_dir), "the checkpoint")
    except CheckpointError as error:
        if required:
            raise ProtocolError(f"{error}; no round starts before its number is on disk") from None
        log.warning("%s; the one before stands", error)
        return str(error)
    return ""


def write_at_the_end(write: Callable[[], None], *, run_failed: bool) -> None:
    """Write a run's outputs as it ends. When the run failed already, a write the system refuses
    (``CheckpointError``) is logged, so that the run's own failure is the one its operator reads."""
    try:
        write()
    except CheckpointError as error:
        if not run_failed:
            raise
        log.error("%s", error)
