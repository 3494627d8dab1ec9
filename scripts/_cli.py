"""What the launchers of a run share: logging, local ports, the run's flags, and the errors a user can fix (one line each)."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Callable

from crypto.bfv import BfvError
from crypto.bfv_parameters import ParameterError
from crypto.sealed_box import SealedBoxError
from crypto.secret_sharing import ShareError
from protocol.checkpoint import CheckpointError
from protocol.config import INSECURE_PLAINTEXT, SECURE_AGGREGATION, ConfigError
from protocol.messages import ProtocolError
from protocol.key_files import KeyFileError
from scripts._run import run_with
from protocol.transcript import TranscriptError
from protocol.transport import TransportError
from tallier.mpc import MpcError
from training.ledger import LedgerError
from training.datasets import DatasetError
from training.partition import PartitionError
from training.fedavg import FedAvgError
from training.baselines import BASELINE_DEFAULTS, BASELINE_FLAGS, BASELINES
from training.flags import Flag, positive_int, probability, widths
from training.methods import METHODS as TRAINING_METHODS
from training.models import takes_images
from training.vote_privacy import REVEAL_MODES, VOTING_DEFAULTS, VOTING_FLAGS, VOTING_METHODS

USER_ERRORS = (
    BfvError,
    CheckpointError,
    ConfigError,
    DatasetError,
    FedAvgError,
    LedgerError,
    MpcError,
    ParameterError,
    PartitionError,
    ProtocolError,
    KeyFileError,
    SealedBoxError,
    ShareError,
    TranscriptError,
    TransportError,
    OSError,
)


def run(main: Callable[[], None]) -> int:
    """Run a launcher's ``main`` (``scripts._run``), every user error above becoming one line."""
    return run_with(main, USER_ERRORS)


def add_roster_fingerprint(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--roster-fingerprint",
        metavar="DIGITS",
        help="the roster's fingerprint as the consortium compared it out of band (consilium-roster fingerprint); needed the "
        "first time, and for a roster that is neither the one confirmed before nor signed by its parties",
    )


def chosen_aggregation(args: argparse.Namespace) -> str:
    """The aggregation this process's operator chose: ``--insecure-plaintext-benchmark``, or secure by default."""
    return INSECURE_PLAINTEXT if args.insecure_plaintext_benchmark else SECURE_AGGREGATION


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a local federation's parties."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr, force=True
    )


METHODS = (*TRAINING_METHODS, *VOTING_METHODS)  # what a server can run
FEDERATION_METHODS = (*METHODS, *BASELINES)  # and what consilium-federation also runs, in one process

# The flags each method reads (``training.flags``), declared beside its settings; given for another
# method, a flag is refused, not ignored.
METHOD_FLAGS: dict[str, tuple[Flag, ...]] = {
    **{name: settings.FLAGS for name, settings in TRAINING_METHODS.items()},
    **VOTING_FLAGS,
    **BASELINE_FLAGS,
}
_FLAG_READERS: dict[str, list[str]] = {}  # a method flag's destination -> the methods that read it
for _method, _flags in METHOD_FLAGS.items():
    for _flag in _flags:
        _FLAG_READERS.setdefault(_flag.destination, []).append(_method)
METHOD_DEFAULTS: dict[str, dict] = {
    **{name: settings.DEFAULTS for name, settings in TRAINING_METHODS.items()},
    **VOTING_DEFAULTS,
    **BASELINE_DEFAULTS,
}
# The run's settings every method has, shared by consilium-server and consilium-federation (which
# passes them on to the server it launches). A default of None depends on the method.
COMMON_FLAGS = (
    Flag(
        "--method",
        str,
        "dopamine",
        f"how the hospitals learn together: {', '.join(METHODS)}; consilium-federation also runs the baselines "
        f"{', '.join(BASELINES)} in one process",
    ),
    Flag("--rounds", positive_int, None, "rounds: DP-SGD steps, FedAvg rounds, query batches or a baseline's epochs"),
    Flag("--delta", probability, 1e-5, "delta at which epsilon is reported"),
    Flag("--model", str, None, "model architecture: mlp or cnn (default: cnn for images, mlp for other data)"),
    Flag("--hidden", widths, (48,), "MLP hidden widths, comma-separated (empty for a linear model)"),
    Flag("--quorum", positive_int, None, "K_min: contributions a round needs (default: all hospitals)"),
)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The common run flags, then a group per method of the flags it reads first (``METHOD_FLAGS``)."""
    group = parser.add_argument_group("the run (the server announces these to the hospitals)")
    for flag in COMMON_FLAGS:
        group.add_argument(flag.name, type=flag.kind, default=flag.default, help=flag.help + _default_shown(flag))
    added: set[str] = set()
    for method, flags in METHOD_FLAGS.items():
        new = [flag for flag in flags if flag.name not in added]
        if not new:
            continue
        group = parser.add_argument_group(_group_title(method, new))
        for flag in new:
            group.add_argument(flag.name, type=flag.kind, default=None, help=_help(flag.name))
            added.add(flag.name)


def resolve_run_arguments(args: argparse.Namespace, methods: tuple[str, ...] = METHODS) -> None:
    """Check ``--method`` (one of ``methods``) and ``--reveal``, refuse the flags it does not read, and
    fill in the defaults that depend on the method."""
    if args.method not in methods:
        raise ConfigError(f"unknown method {args.method!r}; choose from {', '.join(methods)}")
    if args.reveal is not None and args.reveal not in REVEAL_MODES:
        raise ConfigError(f"unknown reveal mode {args.reveal!r}; choose from {', '.join(REVEAL_MODES)}")
    for name, methods_reading in _FLAG_READERS.items():
        if args.method not in methods_reading and getattr(args, name, None) is not None:
            raise ConfigError(f"--{name.replace('_', '-')} is for {', '.join(methods_reading)} runs, not {args.method}")
    for flag in METHOD_FLAGS[args.method]:
        if getattr(args, flag.destination, None) is None and flag.default is not None:
            setattr(args, flag.destination, flag.default)
    for name, value in METHOD_DEFAULTS[args.method].items():
        if hasattr(args, name) and getattr(args, name) is None:
            setattr(args, name, value)


def resolve_data_defaults(args: argparse.Namespace, input_shape: tuple[int, ...]) -> None:
    """Fill in the defaults that depend on the data: for images, the CNN and a larger DP-SGD step.

    Both were chosen on PneumoniaMNIST (README, "Baselines and the comparison"): at epsilon 4, with
    the MLP and 0.05 Dopamine stayed at the majority class until round 94, with the CNN and 0.05 for
    all 200 rounds, and with the CNN and 0.5 until round 35.
    """
    images = takes_images(input_shape)
    if args.model is None:
        args.model = "cnn" if images else "mlp"
    if args.lr is None and "lr" in {flag.destination for flag in METHOD_FLAGS[args.method]}:
        args.lr = 0.5 if images else 0.05


def run_argv(args: argparse.Namespace) -> list[str]:
    """The run flags as parsed, to pass on to consilium-server."""
    argv = []
    for flag in [*COMMON_FLAGS, *_all_method_flags()]:
        value = getattr(args, flag.destination)
        if value is not None:
            argv += [flag.name, _show(value)]
    return argv


def _all_method_flags() -> list[Flag]:
    """Every method's flags, each name once."""
    return list({flag.name: flag for flags in METHOD_FLAGS.values() for flag in flags}.values())


def _help(name: str) -> str:
    """A flag's help: what it means to each method that reads it, and its default there."""
    parts: dict[tuple[str, object], list[str]] = {}
    for method, flags in METHOD_FLAGS.items():
        for flag in flags:
            if flag.name == name:
                parts.setdefault((flag.help, flag.default), []).append(method)
    return "; ".join(
        f"{', '.join(methods)}: {text}" + ("" if default is None else f" (default: {_show(default)})")
        for (text, default), methods in parts.items()
    )


def _group_title(method: str, flags: list[Flag]) -> str:
    readers = {tuple(_FLAG_READERS[flag.destination]) for flag in flags}
    if len(readers) == 1:
        return ", ".join(next(iter(readers)))
    return f"{method} (each flag names the methods that read it)"


def _default_shown(flag: Flag) -> str:
    if flag.name == "--rounds":  # every method has its own
        values: dict[object, list[str]] = {}
        for method, defaults in METHOD_DEFAULTS.items():
            values.setdefault(defaults.get("rounds"), []).append(method)
        return " (default: " + "; ".join(f"{value} for {', '.join(methods)}" for value, methods in values.items()) + ")"
    return "" if flag.default is None else f" (default: {_show(flag.default)})"


def _show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
