"""What every launcher shares: logging, and turning the errors a user can fix into one line."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from crypto.bfv import BfvError
from crypto.bfv_parameters import ParameterError
from crypto.sealed_box import SealedBoxError
from protocol.checkpoint import CheckpointError
from protocol.config import ConfigError
from protocol.messages import ProtocolError
from protocol.roster import RosterError
from protocol.transcript import TranscriptError
from protocol.transport import TransportError
from training.accounting import LedgerError
from training.datasets import DatasetError
from training.partition import PartitionError

USER_ERRORS = (
    BfvError,
    CheckpointError,
    ConfigError,
    DatasetError,
    LedgerError,
    ParameterError,
    PartitionError,
    ProtocolError,
    RosterError,
    SealedBoxError,
    TranscriptError,
    TransportError,
    OSError,
)


def run(main: Callable[[], None]) -> int:
    """Run ``main``; a user error becomes ``error: <reason>`` on stderr and exit status 2."""
    try:
        main()
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr, force=True
    )


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
    """A number in (0, 1): delta."""
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


def momentum(text: str) -> float:
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


# The run's training settings, shared by consilium-server and consilium-federation (which passes
# them on to the server it launches): (flag, type, default, help).
RUN_FLAGS = (
    ("--rounds", positive_int, 100, "rounds of Dopamine (one DP-SGD step each)"),
    ("--sample-rate", rate, 0.1, "q: probability that a record is in a round's batch (Poisson sampling)"),
    ("--noise-multiplier", non_negative_float, 2.3, "sigma: noise of a quorum's sum, in units of its sensitivity"),
    ("--max-grad-norm", positive_float, 1.0, "C: per-example gradient clipping norm"),
    ("--lr", positive_float, 0.05, "learning rate"),
    ("--momentum", momentum, 0.9, "momentum, applied to the decrypted mean gradient"),
    ("--delta", probability, 1e-5, "delta at which epsilon is reported"),
    ("--model", str, "mlp", "model architecture: mlp or cnn (for images)"),
    ("--hidden", widths, (48,), "MLP hidden widths, comma-separated (empty for a linear model)"),
)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training (the server announces these to the hospitals)")
    for flag, kind, default, help_text in RUN_FLAGS:
        group.add_argument(flag, type=kind, default=default, help=f"{help_text} (default: {_show(default)})")
    group.add_argument("--quorum", type=positive_int, help="K_min: contributions a round needs (default: all hospitals)")


def run_argv(args: argparse.Namespace) -> list[str]:
    """The flags of ``add_run_arguments`` as parsed, to pass on to consilium-server."""
    argv = []
    for flag, _, _, _ in RUN_FLAGS:
        argv += [flag, _show(getattr(args, flag[2:].replace("-", "_")))]
    if args.quorum is not None:
        argv += ["--quorum", str(args.quorum)]
    return argv


def _show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _number(text: str, kind: type):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text}") from None
    if kind is float and value != value:
        raise argparse.ArgumentTypeError("not a number: nan")
    return value
