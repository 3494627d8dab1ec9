"""The rules every run's configuration follows, training or voting: a run's id, its hospitals, quorum,
rounds and delta (``check_run``), the largest message any party accepts, and the fingerprint that names
what a party took part in. Nothing here knows a training method, so a voting party loads no torch."""

from __future__ import annotations

import hashlib
import json
import re

from consilium.errors import ConsiliumError

__all__ = ["MAX_HOSPITALS", "MAX_MESSAGE_BYTES", "MAX_ROUNDS", "ConfigError", "check_run", "run_fingerprint"]

_RUN_ID = re.compile(r"^[0-9a-f]{8,64}$")
MAX_HOSPITALS = 10_000
MAX_ROUNDS = 1_000_000  # round numbers travel through the voting MPC's field too
# What a hospital accepts before it knows the run, and so ever. A Welcome carries four float32 vectors
# of the model's size: 179 MB for a ResNet-18 of 11.2M parameters, which this is sized for.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class ConfigError(ConsiliumError, ValueError):
    """A run configuration that is malformed or cannot be run."""


def is_run_id(value: object) -> bool:
    """Whether ``value`` can be a run's id (8-64 lowercase hex characters), before anything else is read."""
    return isinstance(value, str) and _RUN_ID.fullmatch(value) is not None


def check_run(run_id: str, hospitals: tuple[str, ...], *, quorum: int, rounds: int, delta: float) -> None:
    """What every run's configuration must satisfy, whatever the method; ``ConfigError`` if not."""
    if not is_run_id(run_id):
        raise ConfigError(f"run_id must be 8-64 lowercase hex characters, got {run_id!r}")
    if not 0 < len(hospitals) <= MAX_HOSPITALS or len(set(hospitals)) != len(hospitals):
        raise ConfigError(f"a run needs 1 to {MAX_HOSPITALS} distinct hospitals")
    if quorum > len(hospitals):
        raise ConfigError(f"the quorum {quorum} exceeds the {len(hospitals)} hospitals")
    if not 1 <= rounds <= MAX_ROUNDS:
        raise ConfigError(f"rounds must be between 1 and {MAX_ROUNDS}, got {rounds}")
    if not 0 < delta < 1:
        raise ConfigError(f"delta must be in (0, 1), got {delta}")


def run_fingerprint(label: bytes, settings: dict, payload: bytes) -> str:
    """``run_id:digest`` of every setting and a payload (the initial model, a feature map): what a party took part in."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()
    return f"{settings['run_id']}:{hashlib.sha256(label + b'|%d|' % len(text) + text + payload).hexdigest()}"
