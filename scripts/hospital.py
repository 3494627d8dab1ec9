"""consilium-hospital: take part in a federation with this hospital's data."""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from consilium.protocol.run.rules import ConfigError
from consilium.protocol.run.site_policy import SitePolicy
from consilium.protocol.run.hospital import Hospital
from consilium.training.methods.step_timing import DEFAULT_SEND_OFFSET_S
from consilium.training.privacy.accounting import DEFAULT_BUDGET_VIEW, VIEWS
from consilium.training.privacy.budget import PrivacyBudget
from consilium.protocol.wire.messages import ProtocolError
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.identity.roster_confirmation import join_federation
from consilium.protocol.voting.voting_hospital import VotingHospital
from consilium.orchestration.hospital_service import HospitalService, site_status
from consilium.orchestration.site_service import stop_on_signals
from consilium.orchestration.run_flags import METHODS, chosen_aggregation
from consilium.scripts._cli import USER_ERRORS, add_logging_arguments, add_roster_fingerprint, configure_logging, run
from consilium.scripts._run_arguments import add_hardware_arguments, add_image_arguments
from consilium.training.methods.flags import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
)
from consilium.training.data.datasets import Split, load_dataset
from consilium.training.models.compute_device import use_device
from consilium.training.models.build import use_model_code
from consilium.training.data.partition import PARTITION_SCHEMES, PartitionError, partition
from consilium.training.voting.vote_privacy import VOTING_METHODS


_BUDGET = PrivacyBudget(epsilon=3.0, delta=1e-5, view=DEFAULT_BUDGET_VIEW)  # a hospital's, unless it says otherwise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-hospital",
        description="Run a hospital: train or vote on local data, send only encrypted updates or sealed vote shares, "
        "enforce the privacy budget.",
    )
    parser.add_argument(
        "--federation",
        type=Path,
        required=True,
        help="federation directory: roster.toml, and this hospital's keys in NAME/",
    )
    add_roster_fingerprint(parser)
    parser.add_argument(
        "--name",
        required=True,
        action="append",
        help="this hospital's name in the roster, e.g. hospital-1. A simulation of a voting run may repeat it: each "
        "hospital then runs in a thread of this process, with its own keys, ledger, noise and connection",
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        help="the kind of run this hospital takes part in (default: dopamine; a service's policy lists its own)",
    )
    parser.add_argument(
        "--data",
        default="breast_cancer",
        help="training data: breast_cancer, digits, an .npz path, an image folder, or module:function of your own code",
    )
    add_image_arguments(parser)
    add_hardware_arguments(parser)
    parser.add_argument(
        "--model",
        metavar="REFERENCE",
        help="this hospital's own copy of the run's model function, package.module:function or path/to/file.py:function, "
        "where the run trains a model of the operators' own code (the run's digest must match what it builds)",
    )
    parser.add_argument(
        "--data-seed", type=non_negative_int, default=0, help="train/validation split of built-in data (default: 0)"
    )
    _add_budget_arguments(parser)
    _add_round_arguments(parser)
    voting = parser.add_argument_group("voting (AE-DPFL, kNN-DPFL)")
    voting.add_argument(
        "--min-quorum", type=positive_int, default=2, help="join no run whose quorum is smaller (default: 2)"
    )
    voting.add_argument(
        "--allow-histogram", action="store_true", help="join runs that open the noisy vote totals (--reveal histogram)"
    )
    add_logging_arguments(parser)
    _add_service_arguments(parser)
    _add_simulation_arguments(parser)
    return parser


def _add_service_arguments(parser: argparse.ArgumentParser) -> None:
    service = parser.add_argument_group("a long-lived service (docs/explanation/site-services.md)")
    service.add_argument(
        "--policy",
        type=Path,
        help="run as a service: take run after run, each within this policy file (its methods, rounds and epsilon "
        "caps, which replace --method, --epsilon-budget, --budget-view and --delta); stop it with SIGTERM",
    )
    service.add_argument(
        "--status",
        action="store_true",
        help="print this hospital's state (its service's, its lifetime epsilon, what its --policy leaves) and exit",
    )


def _add_simulation_arguments(parser: argparse.ArgumentParser) -> None:
    simulation = parser.add_argument_group("simulation: take one part of a shared dataset")
    simulation.add_argument("--parts", type=positive_int, help="split the training data into this many parts")
    simulation.add_argument(
        "--part", type=positive_int, action="append", help="which part (1-based) is this hospital's; one per --name"
    )
    simulation.add_argument("--partition", default="iid", choices=PARTITION_SCHEMES, help="how to split (default: iid)")
    simulation.add_argument("--partition-seed", type=non_negative_int, default=0, help="seed of the split (default: 0)")
    simulation.add_argument("--classes-per-part", type=positive_int, help="label_skew: classes each part sees")
    simulation.add_argument("--alpha", type=positive_float, default=0.5, help="dirichlet: concentration (default: 0.5)")


def _add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the privacy budget (this hospital decides it, not the server)")
    group.add_argument(
        "--epsilon-budget",
        type=positive_float,
        help=f"refuse rounds beyond this epsilon, over every run of its ledger (default: {_BUDGET.epsilon:g})",
    )
    group.add_argument(
        "--budget-view",
        choices=VIEWS,
        help="whose view the budget binds on, and every view before it: server, peer_hospital, coalition (the server "
        f"with tau - 1 hospitals) or collusion (every other party) (default: {_BUDGET.view})",
    )
    group.add_argument("--delta", type=probability, help=f"delta of the budget (default: {_BUDGET.delta:g})")


def _add_round_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rounds: waits, the ledger, sending")
    group.add_argument(
        "--state", type=Path, help="where the privacy ledger and metrics live (default: FEDERATION/NAME)"
    )
    group.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        help="seconds to wait for the server's Welcome, and at least for each later message: a training server's "
        "Welcome raises it to what that server may take, 5 x its --round-timeout + 2 x its --join-timeout + its "
        "--rejoin-window + 60 (780 at its defaults; default: 600, so that a restarted hospital outwaits a default "
        "server's round, 480 s at most)",
    )
    group.add_argument(
        "--upgrade-ledger",
        action="store_true",
        help="read a privacy ledger written before ledgers were chained (version 2 or 3), once: it is chained from then on. "
        "Only for this hospital's own older ledger: an unchained file could also be a chained one replaced",
    )
    group.add_argument(
        "--send-offset",
        type=non_negative_float,
        default=DEFAULT_SEND_OFFSET_S,
        help="encrypt and send each update at least this many seconds after the round starts, and at least 1.5 x "
        "the step's time at the largest batch this hospital will plausibly draw (timed once before round 1), so "
        f"that its timing does not reveal the batch size (default: {DEFAULT_SEND_OFFSET_S:g}; a warning says when "
        "a step overruns it; 0 sends at once)",
    )
    group.add_argument(
        "--insecure-plaintext-benchmark",
        action="store_true",
        help="Dopamine and dp-fedavg: send updates UNENCRYPTED; the server sees each one and no privacy claim holds. Only for "
        "consilium-bench-round's comparison with secure aggregation",
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args)
    sys.exit(run(lambda: _status(args) if args.status else _serve(args) if args.policy else take_part(args)))


def take_part(args: argparse.Namespace) -> None:
    args.method = args.method or "dopamine"
    args.epsilon_budget = args.epsilon_budget or _BUDGET.epsilon
    args.budget_view = args.budget_view or _BUDGET.view
    args.delta = args.delta or _BUDGET.delta
    if len(args.name) > 1 and (args.method not in VOTING_METHODS or args.state):
        raise ConfigError("several --name in one process are for simulating voting runs, without --state")
    if len(set(args.name)) != len(args.name) or len(set(args.part or ())) != len(args.part or ()):
        raise ConfigError("each --name and each --part may be given once")
    if args.insecure_plaintext_benchmark and args.method in VOTING_METHODS:
        raise ConfigError(
            "--insecure-plaintext-benchmark is for the secure round (dopamine, dp-fedavg), not for voting"
        )
    use_device(args.device)
    own_model = use_model_code(args.model) if args.model is not None else None
    parties = {name: join_federation(args.federation, name, args.roster_fingerprint) for name in args.name}
    shares = _own_data(args)
    hospitals = {name: _hospital(args, *parties[name], share, own_model) for name, share in zip(args.name, shares)}
    if len(hospitals) == 1:
        ((name, hospital),) = hospitals.items()
        _report(name, hospital)
        return
    # Each hospital blocks on its own connection; the heavy parts (teachers, noise) release the GIL.
    with ThreadPoolExecutor(max_workers=len(hospitals)) as pool:
        done = {name: pool.submit(_report, name, hospital) for name, hospital in hospitals.items()}
    failed = []
    for name, future in done.items():
        if (error := future.exception()) is not None:
            if not isinstance(error, USER_ERRORS):
                raise error
            print(f"error: {name}: {error}", file=sys.stderr, flush=True)
            failed.append(name)
    if failed:
        raise ProtocolError(
            f"{len(failed)} of the {len(hospitals)} hospitals of this process failed: {', '.join(failed)}"
        )


def _own_data(args: argparse.Namespace) -> list[Split]:
    """Each --name's training records: the whole --data, or its --part of --parts in a simulation."""
    data = load_dataset(
        args.data,
        split_seed=args.data_seed,
        hold_out=args.parts is not None,  # a simulation shares the server's data: its validation is not trained on
        image_size=args.image_size,
        image_channels=args.image_channels,
    ).train
    shares = [data] * len(args.name)
    if args.parts is not None:
        if not args.part or len(args.part) != len(args.name) or max(args.part) > args.parts:
            raise PartitionError(f"give one --part between 1 and --parts ({args.parts}) for each --name")
        parts = partition(
            data.y,
            args.parts,
            args.partition,
            seed=args.partition_seed,
            classes_per_part=args.classes_per_part,
            alpha=args.alpha,
        )
        shares = [data.subset(parts[part - 1]) for part in args.part]
    return shares


def _hospital(
    args: argparse.Namespace, roster: Roster, credentials: Credentials, data: Split, own_model: str | None
) -> Hospital | VotingHospital:
    name = credentials.name
    common = dict(
        roster=roster,
        credentials=credentials,
        data=data,
        budget=PrivacyBudget(epsilon=args.epsilon_budget, delta=args.delta, view=args.budget_view),
        state_dir=args.state or args.federation / name,
        timeout_s=args.timeout,
        upgrade_ledger=args.upgrade_ledger,
        own_model=own_model,
    )
    if args.method not in VOTING_METHODS:
        return Hospital(
            **common,
            send_offset_s=args.send_offset,
            method=args.method,
            aggregation=chosen_aggregation(args),
        )
    return VotingHospital(**common, min_quorum=args.min_quorum, allow_histogram=args.allow_histogram)


def _serve(args: argparse.Namespace) -> None:
    """One hospital as a service (``orchestration.hospital_service``) until SIGTERM or SIGINT."""
    given = [flag for flag in ("method", "epsilon_budget", "budget_view", "delta") if getattr(args, flag) is not None]
    if given:
        raise ConfigError(f"--{given[0].replace('_', '-')} is the policy's to say in a service (--policy)")
    if len(args.name) > 1:
        raise ConfigError("a service is one hospital: give one --name")
    if args.insecure_plaintext_benchmark:
        raise ConfigError("--insecure-plaintext-benchmark is not for a service")
    policy = SitePolicy.load(args.policy, METHODS)
    use_device(args.device)
    own_model = use_model_code(args.model) if args.model is not None else None
    (name,) = args.name
    roster, credentials = join_federation(args.federation, name, args.roster_fingerprint)
    service = HospitalService(
        roster=roster,
        credentials=credentials,
        data=_own_data(args)[0],
        policy=policy,
        state_dir=args.state or args.federation / name,
        idle_s=args.timeout,
        send_offset_s=args.send_offset,
        own_model=own_model,
        min_quorum=args.min_quorum,
        allow_histogram=args.allow_histogram,
    )
    stop_on_signals(service.stop)
    service.serve()


def _status(args: argparse.Namespace) -> None:
    if len(args.name) > 1:
        raise ConfigError("--status is for one hospital: give one --name")
    (name,) = args.name
    credentials = Credentials.load(args.federation / name)
    policy = SitePolicy.load(args.policy, METHODS) if args.policy else None
    print(site_status(args.state or args.federation / name, credentials, policy), flush=True)


def _report(name: str, hospital: Hospital | VotingHospital) -> None:
    result = hospital.run()
    print(f"{name}: {len(result['rounds'])} rounds, finished: {result['finish_reason']}", flush=True)


if __name__ == "__main__":
    main()
