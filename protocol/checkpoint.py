"""The server's checkpoint: what it needs to resume a run after a crash, replaced atomically.

The server writes it once hospitals hold the key, before each RoundStart and after each round.
Round numbers are never reused: the number of rounds started is on disk before a RoundStart leaves,
so a server resumed from any checkpoint starts a round no hospital has seen. A round that was under
way when the server stopped is recorded as interrupted; the hospitals' ledgers have charged it,
and the server's model goes on from the last round it saw through (its hospitals take that model
when they join again). The privacy ledger is not in the checkpoint: it is durable on its own.

The file is JSON (arrays as base64 of little-endian float32), written to a temporary file that is
fsynced and then renamed over the old one, readable by its owner only: it holds the model, which is
DP-protected but still the consortium's.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

__all__ = ["CHECKPOINT_FILE", "Checkpoint", "CheckpointError"]

CHECKPOINT_FILE = "checkpoint.json"
_FORMAT = {"format": "consilium-server-checkpoint", "version": 2}
_ARRAYS = ("initial_parameters", "parameters", "optimizer_state")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or cannot be written."""


@dataclass(frozen=True)
class Checkpoint:
    config: dict  # protocol.config.RunConfig.to_dict, with the hospitals that joined
    initial_parameters: bytes  # float32: with the config, the run's fingerprint
    parameters: bytes  # float32: the model after the last round the server saw through
    optimizer_state: bytes  # float32: its update rule's state (training.update_rules)
    rounds_started: int  # the next round is this plus one, whatever happened to this one
    active: list[str]  # hospitals taking part when the checkpoint was written
    rounds: list[dict]  # the report's round records
    departures: dict[str, str]
    joins: list[dict]

    def save(self, out_dir: Path) -> None:
        record = {**_FORMAT, **asdict(self)}
        for name in _ARRAYS:
            record[name] = base64.b64encode(record[name]).decode()
        path = out_dir / CHECKPOINT_FILE
        temporary = path.with_name(path.name + ".tmp")
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                json.dump(record, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
            directory = os.open(out_dir, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as error:
            raise CheckpointError(f"cannot write the checkpoint {path}: {error}") from None

    @classmethod
    def load(cls, out_dir: Path) -> "Checkpoint":
        path = out_dir / CHECKPOINT_FILE
        if not path.exists():
            raise CheckpointError(f"{out_dir} holds no checkpoint to resume from ({CHECKPOINT_FILE})")
        try:
            record = json.loads(path.read_text())
            if {key: record.pop(key, None) for key in _FORMAT} != _FORMAT:
                raise ValueError("not a server checkpoint of a known version")
            if set(record) != {f.name for f in fields(cls)}:
                raise ValueError(f"expected the fields {sorted(f.name for f in fields(cls))}")
            for name in _ARRAYS:
                record[name] = base64.b64decode(record[name], validate=True)
            checkpoint = cls(**record)
            if type(checkpoint.rounds_started) is not int or checkpoint.rounds_started < 0:
                raise ValueError("rounds_started must be a non-negative integer")
        except (OSError, ValueError, TypeError, AttributeError) as error:
            raise CheckpointError(f"the checkpoint {path} is unreadable: {error}") from None
        return checkpoint
