"""consilium-server: run the aggregator of a provisioned federation."""

from __future__ import annotations

import argparse
import re
import sys
import threading
from pathlib import Path
from typing import Callable


from consilium.protocol.run.rules import ConfigError
from consilium.protocol.identity.party_keys import SERVER
from consilium.protocol.identity.roster_confirmation import join_federation
from consilium.orchestration.coordinator import Coordinator
from consilium.orchestration.site_service import stop_on_signals
from consilium.protocol.wire.transport import ServerTransport
from consilium.scripts._cli import add_logging_arguments, add_roster_fingerprint, configure_logging, run
from consilium.scripts._server_run import ServerRun, check_run_flags, prepared_run
from consilium.scripts._server_network import add_network_arguments, listening_on
from consilium.scripts._run_arguments import add_hardware_arguments, add_image_arguments, add_run_arguments
from consilium.training.privacy.accounting import DEFAULT_BUDGET_VIEW, VIEWS
from consilium.training.methods.flags import non_negative_int, positive_float, positive_int
from consilium.training.models.compute_device import use_device
from consilium.training.models.evaluation import SELECTION_METRICS
from consilium.training.models.own_code import is_reference
from consilium.training.data.datasets import BUILTIN_DATASETS


DEFAULT_MAX_MESSAGE_MIB = 256


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-server",
        description="Run the server: it sums the hospitals' encrypted updates and evaluates the released model "
        "(Dopamine, DP-FedAvg), or has the hospitals label its public records by private vote and trains a student on them.",
    )
    parser.add_argument(
        "--federation",
        type=Path,
        required=True,
        help="federation directory: roster.toml, and the server's keys in server/",
    )
    add_roster_fingerprint(parser)
    parser.add_argument("--out", type=Path, required=True, help="directory for the report, ledger and final model")
    parser.add_argument(
        "--data",
        default="breast_cancer",
        help="validation data: breast_cancer, digits, an .npz path, an image folder, or module:function of your own code",
    )
    add_image_arguments(parser)
    add_hardware_arguments(parser)
    parser.add_argument(
        "--data-seed", type=non_negative_int, default=0, help="train/validation split of built-in data (default: 0)"
    )
    _add_model_arguments(parser)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="go on with the run checkpointed in --out, after the server stopped (its settings are the checkpoint's; "
        "the hospitals join again by themselves)",
    )
    parser.add_argument(
        "--expected-batch-size",
        type=positive_float,
        help="B: the federation-wide divisor of each hospital's share, a public figure the consortium agrees "
        "(q times a typical hospital's record count, coarsely)",
    )
    add_run_arguments(parser)
    _add_target_arguments(parser)
    _add_audit_arguments(parser)
    add_network_arguments(parser)
    parser.add_argument(
        "--insecure-plaintext-benchmark",
        action="store_true",
        help="Dopamine and dp-fedavg: sum UNENCRYPTED updates; no privacy claim holds. Only for consilium-bench-round's comparison "
        "with secure aggregation (the hospitals must say the same)",
    )
    _add_coordinator_arguments(parser)
    add_logging_arguments(parser)
    return parser


def _add_coordinator_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("a long-lived coordinator (docs/how-to/deploy-across-hosts.md)")
    group.add_argument(
        "--coordinate",
        action="store_true",
        help="stay up and run, one after another, the runs the roster's admins submit (consilium-admin), each "
        "in --out/run-N; this command's run flags are then ignored, a Submit's count",
    )
    group.add_argument(
        "--data-root",
        type=Path,
        help="with --coordinate: the folder a submitted run's --data may name files in (default: built-in data only)",
    )
    group.add_argument(
        "--max-message-mib",
        type=positive_int,
        default=DEFAULT_MAX_MESSAGE_MIB,
        help="with --coordinate: the largest message its socket takes, which bounds the models a run may train "
        f"(default: {DEFAULT_MAX_MESSAGE_MIB})",
    )


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the model and its selection")
    group.add_argument(
        "--model-seed",
        type=non_negative_int,
        help="draw the initial model's weights from this seed (public: no noise, sampling or rounding uses it; "
        "default: a fresh draw)",
    )
    group.add_argument(
        "--select-every",
        type=positive_int,
        help="select the model kept among every n-th round and the last (default: 1, every round; a resumed run keeps "
        "its own): a comparison gives every method the same number of candidates",
    )
    group.add_argument(
        "--select-on",
        choices=SELECTION_METRICS,
        help="the validation score that selects the model kept (default: accuracy; a resumed run keeps its own): AUC "
        "where the classes are imbalanced",
    )


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("privacy plan")
    group.add_argument(
        "--target-epsilon",
        type=positive_float,
        help="dopamine, dp-fedavg: calibrate the noise multiplier so that the run, every round released at the "
        "quorum, spends at most this epsilon against --target-view and each view before it (as Opacus's "
        "make_private_with_epsilon does); the plan is printed before round 1 in any case",
    )
    group.add_argument(
        "--target-view",
        choices=VIEWS,
        default=DEFAULT_BUDGET_VIEW,
        help=f"the view --target-epsilon binds on (default: {DEFAULT_BUDGET_VIEW}, as a hospital's budget)",
    )


def _add_audit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("audit")
    group.add_argument("--transcript", type=Path, help="append the digest of every received message to this audit file")
    group.add_argument(
        "--transcript-payloads",
        action="store_true",
        help="keep whole messages in the transcript, not digests (with any hospital's key, it opens every update)",
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args)
    sys.exit(run(lambda: serve(args)))


def serve(args: argparse.Namespace) -> None:
    use_device(args.device)
    if args.coordinate:
        _coordinate(args)
        return
    prepared = prepared_run(args, _print)
    roster, credentials = join_federation(args.federation, SERVER, args.roster_fingerprint)
    prepared(roster, credentials, None).run()


def _print(line: str) -> None:
    print(line, flush=True)


# Flags of the coordinator's own, which a submitted run may not set: where it listens and writes, whom it trusts,
# what it logs and computes on, and runs with no privacy.
_COORDINATOR_FLAGS = frozenset(
    {
        "--federation",
        "--roster-fingerprint",
        "--out",
        "--listen",
        "--max-messages-per-second",
        "--transcript",
        "--transcript-payloads",
        "--log-level",
        "--log-file",
        "--device",
        "--coordinate",
        "--data-root",
        "--max-message-mib",
        "--resume",
        "--insecure-plaintext-benchmark",
        "--help",
        "-h",
    }
)


def _coordinate(args: argparse.Namespace) -> None:
    if args.resume or args.transcript or args.transcript_payloads:
        raise ConfigError(
            "--coordinate runs the runs submitted to it, without --resume or --transcript: resume a stopped run, or "
            "keep a transcript, with consilium-server for that run alone"
        )
    roster, credentials = join_federation(args.federation, SERVER, args.roster_fingerprint)
    if not roster.admins:
        raise ConfigError(
            "the roster names no admin, so no run could be submitted: make one with consilium-keygen --role admin, "
            "add its public file to a new roster version (consilium-provision --previous), and have every party "
            "compare the new fingerprint"
        )
    parties = (*roster.hospitals, *roster.talliers, *roster.admins)
    transport = ServerTransport(
        args.listen or roster.server_address,
        credentials.curve,
        {roster.party(name).curve_public: name for name in parties},
        args.max_message_mib << 20,
        args.max_messages_per_second,
    )
    stop = threading.Event()
    stop_on_signals(stop)

    def make_run(flags: tuple[str, ...], folder: Path, socket, say: Callable[[str], None]) -> ServerRun:
        return prepared_run(_submitted(args, flags, folder), say)(roster, credentials, socket)

    def check(flags: tuple[str, ...]) -> None:
        check_run_flags(_submitted(args, flags, args.out / "run-N"))

    print(
        f"coordinator on {listening_on(args, roster)}: runs in {args.out}/run-N, submitted by "
        f"{', '.join(roster.admins)} (consilium-admin)",
        flush=True,
    )
    try:
        Coordinator(transport, roster, args.out, make_run, check, stop).serve()
    finally:
        transport.close()


def _submitted(args: argparse.Namespace, flags: tuple[str, ...], folder: Path) -> argparse.Namespace:
    """A submitted run's flags as ``consilium-server`` parses its own, in the coordinator's federation, folder,
    socket and device (``ConfigError``)."""
    for flag in flags:
        name = flag.split("=", 1)[0]
        if name in _COORDINATOR_FLAGS or re.match(r"-[^-\d]", flag):  # -hx would be -h: help, then exit
            raise ConfigError(f"{name} is the coordinator's to set, not a submitted run's")
    parser = build_parser()
    parser.allow_abbrev = False  # "--fed" would otherwise be --federation

    def refuse(message: str = "", status: int = 2) -> None:
        raise ConfigError(message.strip() or "the run's flags cannot be parsed")

    parser.error = parser.exit = refuse  # argparse would print and exit
    submitted = parser.parse_args([*flags, "--federation", str(args.federation), "--out", str(folder)])
    if is_reference(submitted.model):
        raise ConfigError("a submitted run names built-in models only: the coordinator runs no code an admin names")
    if submitted.data not in BUILTIN_DATASETS:
        submitted.data = str(_inside_data_root(args.data_root, submitted.data))
    return submitted


def _inside_data_root(root: Path | None, data: str) -> Path:
    """Where a submitted run's ``--data`` is: an ``.npz`` file or an image folder inside ``root``, links followed."""
    refusal = (
        f"a submitted run's --data is built-in data ({', '.join(BUILTIN_DATASETS)}) or an .npz file or image "
        "folder inside the coordinator's --data-root"
    )
    if root is None or ":" in data:  # module:function would be code
        raise ConfigError(refusal + ("" if root is None else f" ({root}); no code"))
    try:
        inside, base = (root / data).resolve(strict=True), root.resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a loop of links
        raise ConfigError(f"{refusal}: {data} is not there") from None
    if ":" in str(inside) or not inside.is_relative_to(base) or not (inside.is_dir() or inside.suffix == ".npz"):
        raise ConfigError(f"{refusal} ({root}): {data} is not")
    return inside


if __name__ == "__main__":
    main()
