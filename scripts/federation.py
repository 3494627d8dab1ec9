"""consilium-federation: a whole federation on this machine, one OS process per party (``orchestration.local``).

Makes each party's keys in its own folder and the roster from their public files (as a real
federation is set up), launches the server and each hospital as separate processes
talking over CurveZMQ on localhost, prints a line per round, and writes into ``--out``:

- ``report.json``: configuration, BFV parameters, per-round metrics, final epsilon for each view and level
  (``training.privacy.accounting``) and delta, wire bytes per hospital per round (and their ratio to the float32 update), time per phase;
- ``report.png``: validation accuracy and epsilon per round;
- ``federation/`` (identities, each hospital's privacy ledger and metrics), ``server/`` (the server's
  report, ledger, audit transcript and final model) and ``logs/``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from consilium.orchestration.local import run_local_federation
from consilium.orchestration.spec import RunSpec
from consilium.scripts._cli import run
from consilium.scripts._run_arguments import add_image_arguments, add_run_arguments
from consilium.training.privacy.accounting import VIEWS
from consilium.training.methods.flags import non_negative_float, non_negative_int, positive_float, positive_int
from consilium.training.models.evaluation import SELECTION_METRICS
from consilium.training.data.partition import PARTITION_SCHEMES

_DEFAULT = RunSpec()  # a flag not given takes the spec's default


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-federation",
        description=(
            "Run a local federation: a server and K hospitals as separate processes, Dopamine DP-SGD with "
            "BFV secure aggregation. With no arguments: 3 hospitals on the built-in breast cancer data. "
            "With --method ae-dpfl or knn-dpfl: private voting on the built-in digits, with 3 tallier processes. "
            "With a baseline (central, central-dp, fedavg, fedavg-local-dp): the same data, partition and model, in this process."
        ),
    )
    parser.add_argument("--out", type=Path, help="output directory (default: runs/<date-time>)")
    parser.add_argument("--hospitals", type=positive_int, help=f"number of hospitals (default: {_DEFAULT.hospitals})")
    parser.add_argument(
        "--data",
        help="breast_cancer, digits, an .npz path, an image folder (train/<class>/*.png, optional val/ and test/), or "
        "module:function of your own code (default: breast_cancer; digits for voting)",
    )
    add_image_arguments(parser)
    parser.add_argument("--device", help="where each party's models compute: cpu or cuda (default: cpu)")
    parser.add_argument(
        "--hospitals-per-process",
        type=positive_int,
        help="voting: simulate this many hospitals in each hospital process, each in its own thread with its own keys, "
        "ledger, noise and connection (default: 1, a process each)",
    )
    parser.add_argument(
        "--talliers", type=positive_int, help=f"voting: number of talliers, at least 3 (default: {_DEFAULT.talliers})"
    )
    _add_data_arguments(parser)
    _add_budget_arguments(parser)
    _add_server_arguments(parser)
    add_run_arguments(parser)
    return parser


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data and its partition")
    group.add_argument(
        "--seed",
        type=non_negative_int,
        help=f"seed of the data split, partition and initial model (never of the noise, sampling or rounding; default: {_DEFAULT.seed})",
    )
    group.add_argument(
        "--partition", choices=PARTITION_SCHEMES, help=f"how hospitals split the data (default: {_DEFAULT.partition})"
    )
    group.add_argument("--classes-per-part", type=positive_int, help="label_skew: classes each hospital sees")
    group.add_argument("--alpha", type=positive_float, help=f"dirichlet concentration (default: {_DEFAULT.alpha})")


def _add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("privacy budget")
    group.add_argument(
        "--epsilon-budget",
        type=positive_float,
        help="each hospital's budget (default: 3; dp-fedavg 10, AE-DPFL 2000, kNN-DPFL 10); for central-dp and fedavg-local-dp, "
        "the epsilon per record they spend (default: 3)",
    )
    group.add_argument(
        "--target-epsilon",
        type=positive_float,
        help="dopamine, dp-fedavg: calibrate the noise multiplier so that the run, every round released, spends at "
        "most this epsilon against --budget-view and each view before it, as Opacus's make_private_with_epsilon "
        "does (the plan is printed before round 1; --epsilon-budget defaults to it)",
    )
    group.add_argument(
        "--budget-view",
        choices=VIEWS,
        help="whose view each hospital's budget binds on, and every view before it "
        f"(training.privacy.accounting; default: {_DEFAULT.budget_view}, the server with tau - 1 hospitals)",
    )


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the server: rounds, selection, audit")
    group.add_argument(
        "--round-timeout",
        type=positive_float,
        help=f"seconds a round waits for updates (default: {_DEFAULT.round_timeout:g})",
    )
    group.add_argument(
        "--expected-batch-size",
        type=positive_float,
        help="B, the consortium's public figure (default: proposed as q times the data set's public training size "
        "over the number of hospitals, never from a hospital's own count)",
    )
    group.add_argument(
        "--select-every",
        type=positive_int,
        help="the server selects its model among every n-th round and the last (default: 1, every round); a comparison "
        "gives every method the same number of candidates",
    )
    group.add_argument(
        "--select-on",
        choices=SELECTION_METRICS,
        help="the validation score that selects the model kept: accuracy (default) or auc, where classes are imbalanced",
    )
    group.add_argument(
        "--send-offset",
        type=non_negative_float,
        help=f"each hospital's --send-offset (default: {_DEFAULT.send_offset:g})",
    )
    group.add_argument(
        "--transcript-payloads", action="store_true", help="the server's transcript keeps whole messages, not digests"
    )
    group.add_argument(
        "--insecure-plaintext-benchmark",
        action="store_true",
        help="Dopamine and dp-fedavg: NO secure aggregation, updates travel and are summed in the clear and no privacy claim holds. "
        "Only for consilium-bench-round's comparison",
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(run(lambda: run_local_federation(RunSpec.from_values(vars(args)))))


if __name__ == "__main__":
    main()
