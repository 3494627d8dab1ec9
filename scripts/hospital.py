"""consilium-hospital: take part in a federation with this hospital's data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from protocol.hospital import DEFAULT_SEND_OFFSET_S, Hospital, PrivacyBudget
from protocol.roster import Credentials, Roster
from protocol.voting_hospital import VotingHospital
from scripts._cli import METHODS, configure_logging, non_negative_float, positive_float, positive_int, probability, run
from training.datasets import load_dataset
from training.partition import PARTITION_SCHEMES, PartitionError, partition


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-hospital",
        description="Run a hospital: train or vote on local data, send only encrypted updates or sealed vote shares, "
        "enforce the privacy budget.",
    )
    parser.add_argument("--federation", type=Path, required=True, help="federation directory (consilium-provision)")
    parser.add_argument("--name", required=True, help="this hospital's name in the roster, e.g. hospital-1")
    parser.add_argument(
        "--method", default="dopamine", choices=METHODS, help="the kind of run this hospital takes part in (default: dopamine)"
    )
    parser.add_argument("--data", default="breast_cancer", help="training data: breast_cancer, digits or an .npz path")
    parser.add_argument("--data-seed", type=int, default=0, help="train/validation split of built-in data (default: 0)")
    parser.add_argument("--epsilon-budget", type=positive_float, default=3.0, help="refuse rounds beyond this epsilon")
    parser.add_argument("--delta", type=probability, default=1e-5, help="delta of the budget (default: 1e-5)")
    parser.add_argument("--state", type=Path, help="where the privacy ledger and metrics live (default: FEDERATION/NAME)")
    parser.add_argument("--timeout", type=positive_float, default=180.0, help="seconds to wait for the server")
    parser.add_argument(
        "--send-offset",
        type=non_negative_float,
        default=DEFAULT_SEND_OFFSET_S,
        help="send each update this many seconds after the round starts, so its timing does not reveal the batch "
        f"size (default: {DEFAULT_SEND_OFFSET_S:g}; a warning says when a step overruns it)",
    )
    voting = parser.add_argument_group("voting (AE-DPFL, kNN-DPFL)")
    voting.add_argument(
        "--min-quorum", type=positive_int, default=2, help="join no run whose quorum is smaller (default: 2)"
    )
    voting.add_argument(
        "--allow-histogram", action="store_true", help="join runs that open the noisy vote totals (--reveal histogram)"
    )
    parser.add_argument("--log-level", default="warning", help="debug, info, warning or error (default: warning)")
    simulation = parser.add_argument_group("simulation: take one part of a shared dataset")
    simulation.add_argument("--parts", type=positive_int, help="split the training data into this many parts")
    simulation.add_argument("--part", type=positive_int, help="which part (1-based) is this hospital's")
    simulation.add_argument("--partition", default="iid", choices=PARTITION_SCHEMES, help="how to split (default: iid)")
    simulation.add_argument("--partition-seed", type=int, default=0, help="seed of the split (default: 0)")
    simulation.add_argument("--classes-per-part", type=positive_int, help="label_skew: classes each part sees")
    simulation.add_argument("--alpha", type=positive_float, default=0.5, help="dirichlet: concentration (default: 0.5)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    sys.exit(run(lambda: take_part(args)))


def take_part(args: argparse.Namespace) -> None:
    roster = Roster.load(args.federation)
    credentials = Credentials.load(args.federation, args.name)
    data = load_dataset(args.data, split_seed=args.data_seed).train
    if args.parts is not None:
        if args.part is None or args.part > args.parts:
            raise PartitionError(f"--part must be between 1 and --parts ({args.parts})")
        parts = partition(
            data.y, args.parts, args.partition, seed=args.partition_seed, classes_per_part=args.classes_per_part, alpha=args.alpha
        )
        data = data.subset(parts[args.part - 1])
    common = dict(
        roster=roster,
        credentials=credentials,
        data=data,
        budget=PrivacyBudget(epsilon=args.epsilon_budget, delta=args.delta),
        state_dir=args.state or args.federation / args.name,
        timeout_s=args.timeout,
    )
    if args.method == "dopamine":
        hospital = Hospital(**common, send_offset_s=args.send_offset)
    else:
        hospital = VotingHospital(**common, min_quorum=args.min_quorum, allow_histogram=args.allow_histogram)
    result = hospital.run()
    print(f"{args.name}: {len(result['rounds'])} rounds, finished: {result['finish_reason']}", flush=True)


if __name__ == "__main__":
    main()
