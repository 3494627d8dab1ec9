"""consilium-reproduce-voting: the voting paper's MNIST settings, run as real federations, over seeds.

Each run is ``consilium-federation``: a server, 3 tallier processes and the hospitals, talking over
CurveZMQ, the talliers over MPyC with mutual TLS. 100 hospitals do not fit 2 cores as 100
processes, so AE-DPFL runs 50 hospitals in each of 2 processes, one thread each: every hospital
still has its own identity, connection, ledger, teacher and ChaCha20 noise generator, and seals its
own shares to the talliers, who count it as one voter.

Writes ``results.md`` (the table the README quotes) and ``results.json`` (every run's report) into
``--out``, and each run's federation, logs and report under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from consilium.orchestration.local import run_local_federation
from consilium.orchestration.spec import RunSpec
from consilium.scripts._cli import run

# The paper's settings (Sec. 4.1, Table 1 for AE-DPFL; 3 agents and delta 1e-4 as in its Table 2 for
# kNN-DPFL), and the noise and query counts chosen here for each method's epsilon target.
SETTINGS = {
    "ae-dpfl": {
        "level": "hospital",
        "target": (0.90, 4.3),  # (student accuracy, epsilon): the paper reports 86.1% (DP-FedAvg 84.2%) at 4.3
        "spec": RunSpec(
            method="ae-dpfl",
            hospitals=100,
            quorum=100,  # every agent votes, as in the paper (the default for 100 would be 99)
            hospitals_per_process=50,
            partition="label_skew",
            classes_per_part=6,
            delta=1e-3,
            model="cnn",
            rounds=1,
            epsilon_budget=20.0,
            round_timeout=1200.0,
            flags={
                "public_fraction": 0.3,
                "teacher_epochs": 20,
                "teacher_confidence": 0.5,
                "queries_per_round": 500,
                "vote_noise": 20.0,
                "student_epochs": 60,
            },
        ),
    },
    "knn-dpfl": {
        "level": "record",
        "target": (0.95, 2.0),
        "spec": RunSpec(
            method="knn-dpfl",
            hospitals=3,
            partition="iid",
            delta=1e-4,
            model="cnn",
            rounds=6,
            epsilon_budget=4.0,
            round_timeout=600.0,
            flags={
                "public_fraction": 0.3,
                "neighbours": 400,
                "feature_dimensions": 30,
                "queries_per_round": 500,
                "vote_noise": 148.0,
                "label_threshold": 840,
                "student_epochs": 30,
            },
        ),
    },
}
# results.md's closing section: how the runs are made, which the table itself does not say.
_HOW_IT_RUNS = (
    "- Every run is real processes on one 2-core machine: the server, 3 `consilium-tallier` processes (MPyC over mutual TLS), "
    "and the hospitals. AE-DPFL's 100 hospitals run as 2 processes of 50 threads; each thread is one hospital with "
    "its own identity, CurveZMQ connection, ledger, teacher and noise generator, and seals its own shares.",
    "- Public pool: 30% of the MNIST test set (3,000 records); the other 7,000 are the test set. The student is the "
    "same CNN as the teachers, trained on the labelled queries and then on its own confident guesses on the "
    "rest of the pool, every batch randomly shifted, turned and scaled a little (`training.voting.votes.train_student`).",
    "- A query's label is released only where its largest noisy total reaches `--label-threshold` votes, decided "
    "inside the MPC; the other queries stay unlabelled records of the pool. It is a function of the same noisy "
    "totals, so epsilon charges every query asked, released or not.",
    "- AE-DPFL: each hospital holds 6 of the 10 digits (`--partition label_skew`: each digit held by 60 hospitals, "
    "in 75 to 83 distinct sets for seeds 0 to 2), about 600 records, and its teacher abstains on queries where its "
    "top probability is below 0.5.",
    "- kNN-DPFL: the hospitals split the MNIST training set evenly (20,000 records each) and vote the labels of "
    "their 400 nearest records in a 30-dimensional PCA fit on the public pool; the 6 rounds ask about the whole pool.",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-reproduce-voting",
        description="Reproduce the voting paper's MNIST experiments (AE-DPFL with 100 hospitals, kNN-DPFL with 3) "
        "as real federations over several seeds, and write a results table.",
    )
    parser.add_argument("--data", default="../shared/data/mnist.npz", help="MNIST in the Keras .npz layout")
    parser.add_argument("--methods", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), help="which to run")
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of the data split (default: 0 1 2)"
    )
    parser.add_argument("--out", type=Path, default=Path("results/voting_mnist"), help="where the table goes")
    parser.add_argument("--work", type=Path, default=Path("runs/voting_mnist"), help="where each run's files go")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(run(lambda: reproduce(args)))


def reproduce(args: argparse.Namespace) -> None:
    runs: dict[str, list[dict]] = {}
    for method in args.methods:
        for seed in args.seeds:
            out = args.work / f"{method}-seed{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
            print(f"== {method}, seed {seed}: {out}", flush=True)
            spec = replace(SETTINGS[method]["spec"], data=args.data, seed=seed, out=out)
            report = run_local_federation(spec)
            runs.setdefault(method, []).append({"seed": seed, "argv": spec.argv(), "report": report})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(runs, indent=1))
    (args.out / "results.md").write_text(results_table(runs, data=args.data))
    print(f"results: {args.out / 'results.md'}", flush=True)


def results_table(runs: dict[str, list[dict]], *, data: str) -> str:
    lines = [*_table_head(data), *(_method_row(method, results) for method, results in runs.items())]
    lines += ["", "## Settings", ""]
    for method in runs:
        lines.append(
            f"- **{method}**: `consilium-federation --data {data} {' '.join(SETTINGS[method]['spec'].argv())}`"
        )
    lines += ["", "## How it runs", "", *_HOW_IT_RUNS]
    return "\n".join(lines) + "\n"


def _table_head(data: str) -> list[str]:
    """The title, what the figures are, and the table's header rows."""
    return [
        f"# Private voting on MNIST ({Path(data).name}): the voting paper's settings",
        "",
        "Command: `consilium-reproduce-voting` (one run per seed; each run is a `consilium-federation` with the "
        "settings below). Mean and standard deviation over the seeds; epsilon is against the server, which sees "
        "the labels; MPC time is per query asked, its label released or not.",
        "",
        "| method | seeds | student test accuracy | label accuracy | labels released (of queries) | epsilon (level, delta) "
        "| epsilon, other level | MPC ms per query | wall time per run (s) | target: met? |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]


def _method_row(method: str, results: list[dict]) -> str:
    """The table's row for one method: its figures over the seeds' runs."""
    level = SETTINGS[method]["level"]
    other = "record" if level == "hospital" else "hospital"
    finals = [r["report"]["final"] for r in results]
    cells = [
        method,
        ", ".join(str(r["seed"]) for r in results),
        _spread([f["student_test_accuracy"] for f in finals], percent=True),
        _spread([f["label_accuracy"] for f in finals], percent=True),
        f"{_spread([f['queries_labelled'] for f in finals], digits=0)} "
        f"(of {statistics.fmean(f['queries_labelled'] + f.get('queries_withheld', 0) for f in finals):.0f})",
        f"{_spread([f['epsilon'][level]['server'] for f in finals])} ({level}, {finals[0]['delta']:g})",
        f"{_spread([f['epsilon'][other]['server'] for f in finals])} ({other})",
        _spread([None if f["mpc_seconds_per_query"] is None else 1000 * f["mpc_seconds_per_query"] for f in finals]),
        _spread([r["report"]["wall_seconds"] for r in results], digits=0),
        _verdict(finals, *SETTINGS[method]["target"], level=level),
    ]
    return "| " + " | ".join(cells) + " |"


def _verdict(finals: list[dict], accuracy: float, epsilon: float, *, level: str) -> str:
    """Whether the mean student accuracy reaches ``accuracy`` with every run within ``epsilon``."""
    reached = statistics.fmean(f["student_test_accuracy"] or 0.0 for f in finals) >= accuracy  # None: no student
    within = all(f["epsilon"][level]["server"] <= epsilon for f in finals)
    return f"{100 * accuracy:.0f}% at epsilon <= {epsilon:g}: {'yes' if reached and within else 'no'}"


def _spread(values: list[float | None], *, percent: bool = False, digits: int = 2) -> str:
    """Mean ± standard deviation of the values a run had (a run with no label has no label accuracy)."""
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    missing = f" ({len(known)} of {len(values)} runs)" if len(known) < len(values) else ""
    scale = 100 if percent else 1
    mean = statistics.fmean(known) * scale
    spread = statistics.stdev(known) * scale if len(known) > 1 else 0.0
    places = 1 if percent else digits
    return f"{mean:.{places}f} ± {spread:.{places}f}" + ("%" if percent else "") + missing


if __name__ == "__main__":
    main()
