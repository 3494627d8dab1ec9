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
from training.fedavg import LOCAL_OPTIMIZERS, FedAvgError
from training.dp_fedavg import SERVER_OPTIMIZERS
from training.baselines import BASELINES, DP_BASELINES
from training.methods import METHODS as TRAINING_METHODS
from training.models import takes_images
from training.vote_privacy import REVEAL_MODES, VOTING_METHODS

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


METHODS = (*TRAINING_METHODS, *VOTING_METHODS)  # what a server can run
FEDERATION_METHODS = (*METHODS, *BASELINES)  # and what consilium-federation also runs, in one process

# The run's settings, shared by consilium-server and consilium-federation (which passes them on to
# the server it launches): (flag, type, default, help). A default of None depends on the method
# (``METHOD_DEFAULTS``).
RUN_FLAGS = (
    (
        "--method",
        str,
        "dopamine",
        f"how the hospitals learn together: {', '.join(METHODS)}; consilium-federation also runs the baselines {', '.join(BASELINES)} in one process",
    ),
    (
        "--rounds",
        positive_int,
        None,
        "rounds: DP-SGD steps for Dopamine (default 100), FedAvg rounds for dp-fedavg (default 10), query batches for voting (default 2), epochs or FedAvg rounds for a baseline (default 20)",
    ),
    ("--sample-rate", rate, 0.1, "Dopamine: q, probability that a record is in a round's batch (Poisson sampling)"),
    (
        "--noise-multiplier",
        non_negative_float,
        None,
        "sigma (Dopamine, default 2.3) or z (dp-fedavg, default 6): noise of a quorum's sum, in units of the sensitivity of one record or one sub-client",
    ),
    ("--max-grad-norm", positive_float, 1.0, "Dopamine: C, per-example gradient clipping norm"),
    ("--lr", positive_float, None, "Dopamine: learning rate (default: 0.5 for images, 0.05 for other data)"),
    ("--momentum", below_one, 0.9, "Dopamine: momentum, applied to the decrypted mean gradient"),
    (
        "--subclients",
        positive_int,
        2,
        "dp-fedavg: v, sub-clients (intermediaries) per hospital (the first round's, with --adaptive-subclients)",
    ),
    (
        "--adaptive-subclients",
        positive_int,
        None,
        "dp-fedavg: re-estimate v each round from the release (Jiang et al., Sec. 2.2), up to this many; without it v is fixed",
    ),
    (
        "--max-update-norm",
        positive_float,
        0.5,
        "dp-fedavg: C, clipping norm of each sub-client's update (the first round's, with --clip-quantile)",
    ),
    (
        "--clip-quantile",
        probability,
        None,
        "dp-fedavg: adapt C each round toward this quantile of the sub-client update norms (Andrew et al. 2021), from a count noised and released with the update; without it C is fixed",
    ),
    ("--clip-lr", positive_float, None, "dp-fedavg: eta_C, the geometric step of adaptive clipping (default 0.2)"),
    ("--local-epochs", positive_int, 1, "dp-fedavg: epochs each sub-client trains per round"),
    ("--local-batch-size", positive_int, 16, "dp-fedavg: sub-clients' batch size"),
    ("--local-lr", positive_float, 0.1, "dp-fedavg: sub-clients' learning rate"),
    ("--local-optimizer", str, "sgd", f"dp-fedavg: sub-clients' optimizer, {' or '.join(LOCAL_OPTIMIZERS)}"),
    (
        "--server-optimizer",
        str,
        "fedavg",
        f"dp-fedavg: how every party applies the mean update, {' or '.join(SERVER_OPTIMIZERS)}",
    ),
    ("--server-lr", positive_float, None, "dp-fedavg: server learning rate (default: 1 for fedavg, 0.03 for fedadam)"),
    ("--delta", probability, 1e-5, "delta at which epsilon is reported"),
    (
        "--accountant",
        str,
        "prv",
        "central-dp, fedavg-local-dp: Opacus's accountant that sets sigma for --epsilon-budget, prv or rdp (the secure round's is Skellam RDP)",
    ),
    ("--model", str, None, "model architecture: mlp or cnn (default: cnn for images, mlp for other data)"),
    ("--hidden", widths, (48,), "MLP hidden widths, comma-separated (empty for a linear model)"),
    ("--queries-per-round", positive_int, 90, "voting: public records the hospitals label per round"),
    (
        "--vote-noise",
        positive_float,
        None,
        "voting: sigma, noise on each summed count in votes (AE-DPFL 1, kNN-DPFL 15)",
    ),
    ("--neighbours", positive_int, None, "kNN-DPFL: k, the neighbours each hospital counts (default 30)"),
    ("--reveal", str, "labels", "voting: what the talliers open, labels or (trading privacy of the margins) histogram"),
    (
        "--label-threshold",
        non_negative_int,
        0,
        "voting: label a query only where its noisy top total reaches this many votes (0: all)",
    ),
    ("--teacher-epochs", positive_int, 30, "AE-DPFL: epochs of each hospital's teacher"),
    (
        "--teacher-confidence",
        below_one,
        0.0,
        "AE-DPFL: a teacher abstains below this top softmax probability (0: always votes)",
    ),
    ("--feature-dimensions", positive_int, 30, "kNN-DPFL: dimensions of the public PCA feature map"),
    ("--student-epochs", positive_int, 100, "voting: epochs of the server's student on the labelled queries"),
    ("--public-fraction", rate, 0.5, "voting: share of the held-out records that form the public pool (the rest test)"),
)
# Measured on the built-in digits with 3 hospitals: kNN-DPFL at sigma 15, k 30 labels about 88% of
# the public pool right, at epsilon 6.3 per record against the server (7.9 against a fellow
# hospital, which the budget binds on). AE-DPFL's data-independent guarantee needs many hospitals
# (the voting paper's 100): with 3, noise that leaves the labels useful (sigma 1: about 84% right)
# gives epsilon in the hundreds, so its default budget binds nothing, and the launchers say so.
METHOD_DEFAULTS = {
    "dopamine": {"rounds": 100, "noise_multiplier": 2.3, "epsilon_budget": 3.0},
    "dp-fedavg": {"rounds": 10, "noise_multiplier": 6.0, "epsilon_budget": 10.0},
    "ae-dpfl": {"rounds": 2, "vote_noise": 1.0, "neighbours": 1, "epsilon_budget": 2000.0},
    "knn-dpfl": {"rounds": 2, "vote_noise": 15.0, "neighbours": 30, "epsilon_budget": 10.0},
    **{
        baseline: {"rounds": 20, **({"epsilon_budget": 3.0} if baseline in DP_BASELINES else {})}
        for baseline in BASELINES
    },
}


# Flags that only some methods read: given for another, they are refused, not ignored. The
# baselines (``training.baselines``) read what their private counterparts do: DP-SGD's flags for
# central-dp and fedavg-local-dp, the sub-clients' local training for central and fedavg.
_DP_SGD_FLAGS = ("sample_rate", "max_grad_norm", "lr", "momentum")
METHOD_FLAGS = {
    "dopamine": ("noise_multiplier", *_DP_SGD_FLAGS),
    "dp-fedavg": (
        "noise_multiplier",
        "subclients",
        "adaptive_subclients",
        "max_update_norm",
        "clip_quantile",
        "clip_lr",
        "local_epochs",
        "local_batch_size",
        "local_lr",
        "local_optimizer",
        "server_optimizer",
        "server_lr",
    ),
    "central": ("local_batch_size", "local_lr"),
    "central-dp": (*_DP_SGD_FLAGS, "accountant"),
    "fedavg": ("local_epochs", "local_batch_size", "local_lr"),
    "fedavg-local-dp": ("local_epochs", *_DP_SGD_FLAGS, "accountant"),
}
_FLAG_READERS: dict[str, list[str]] = {}  # flag -> the methods that read it
for _method, _names in METHOD_FLAGS.items():
    for _name in _names:
        _FLAG_READERS.setdefault(_name, []).append(_method)
_SERVER_LEARNING_RATES = {"fedavg": 1.0, "fedadam": 0.03}


def _destination(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training (the server announces these to the hospitals)")
    method_specific = {name for names in METHOD_FLAGS.values() for name in names}
    for flag, kind, default, help_text in RUN_FLAGS:
        shown = "" if default is None else f" (default: {_show(default)})"
        parser_default = (
            None if _destination(flag) in method_specific else default
        )  # filled in once the method is known
        group.add_argument(flag, type=kind, default=parser_default, help=help_text + shown)
    group.add_argument(
        "--quorum", type=positive_int, help="K_min: contributions a round needs (default: all hospitals)"
    )


def resolve_run_arguments(args: argparse.Namespace, methods: tuple[str, ...] = METHODS) -> None:
    """Check ``--method`` (one of ``methods``) and ``--reveal``, and fill in the defaults that depend on the method."""
    if args.method not in methods:
        raise ConfigError(f"unknown method {args.method!r}; choose from {', '.join(methods)}")
    if args.reveal not in REVEAL_MODES:
        raise ConfigError(f"unknown reveal mode {args.reveal!r}; choose from {', '.join(REVEAL_MODES)}")
    for name, methods_reading in _FLAG_READERS.items():
        if args.method not in methods_reading and getattr(args, name, None) is not None:
            raise ConfigError(f"--{name.replace('_', '-')} is for {', '.join(methods_reading)} runs, not {args.method}")
    defaults = {_destination(flag): default for flag, _, default, _ in RUN_FLAGS if default is not None}
    for name in METHOD_FLAGS.get(args.method, ()):
        if getattr(args, name, None) is None and name in defaults:
            setattr(args, name, defaults[name])
    if args.method == "dp-fedavg" and args.server_lr is None:
        args.server_lr = _SERVER_LEARNING_RATES.get(args.server_optimizer, 1.0)  # an unknown optimizer is refused later
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
    if args.lr is None and "lr" in METHOD_FLAGS.get(args.method, ()):
        args.lr = 0.5 if images else 0.05


def run_argv(args: argparse.Namespace) -> list[str]:
    """The flags of ``add_run_arguments`` as parsed, to pass on to consilium-server."""
    argv = []
    for flag, _, _, _ in RUN_FLAGS:
        value = getattr(args, _destination(flag))
        if value is not None:
            argv += [flag, _show(value)]
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
