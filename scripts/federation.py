"""consilium-federation: a whole federation on this machine, one OS process per party.

Makes each party's keys in its own folder and the roster from their public files (as a real
federation is set up), launches the server and each hospital as separate processes
talking over CurveZMQ on localhost, prints a line per round, and writes into ``--out``:

- ``report.json``: configuration, BFV parameters, per-round metrics, final epsilon for each view and level
  (``training.accounting``) and delta, wire bytes per hospital per round (and their ratio to the float32 update), time per phase;
- ``report.png``: validation accuracy and epsilon per round;
- ``federation/`` (identities, each hospital's privacy ledger and metrics), ``server/`` (the server's
  report, ledger, audit transcript and final model) and ``logs/``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from protocol.config import INSECURE_PLAINTEXT, SECURE_AGGREGATION, ConfigError, RunConfig
from protocol.messages import ProtocolError
from protocol.party_keys import SERVER
from protocol.roster import local_federation
from protocol.hospital import DEFAULT_SEND_OFFSET_S
from scripts._cli import (
    FEDERATION_METHODS,
    add_run_arguments,
    free_port,
    resolve_data_defaults,
    resolve_run_arguments,
    run,
    run_argv,
)
from training.flags import non_negative_float, positive_float, positive_int
from scripts.server import build_run_config, model_spec
from training.baselines import BASELINES, DP_BASELINES, BaselineSettings, run_baseline
from training.ledger import PrivacyBudget, PrivacyLedger
from training.datasets import Dataset, load_dataset
from training.dp_fedavg import DpFedAvgSettings
from training.methods import METHODS as TRAINING_METHODS, ledger_release
from training.partition import PARTITION_SCHEMES, partition
from training.vote_privacy import VOTING_METHODS

_STARTUP_ALLOWANCE_S = 120.0
_SHUTDOWN_GRACE_S = 30.0
_LOG_TAIL_LINES = 5
_MEANINGFUL_EPSILON = 10.0


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
    parser.add_argument("--hospitals", type=positive_int, default=3, help="number of hospitals (default: 3)")
    parser.add_argument(
        "--data", help="breast_cancer, digits or an .npz path (default: breast_cancer; digits for voting)"
    )
    parser.add_argument(
        "--hospitals-per-process",
        type=positive_int,
        default=1,
        help="voting: simulate this many hospitals in each hospital process, each in its own thread with its own keys, "
        "ledger, noise and connection (default: 1, a process each)",
    )
    parser.add_argument(
        "--talliers", type=positive_int, default=3, help="voting: number of talliers, at least 3 (default: 3)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the data split and partition (default: 0)")
    parser.add_argument("--partition", default="iid", choices=PARTITION_SCHEMES, help="how hospitals split the data")
    parser.add_argument("--classes-per-part", type=positive_int, help="label_skew: classes each hospital sees")
    parser.add_argument("--alpha", type=positive_float, default=0.5, help="dirichlet concentration (default: 0.5)")
    parser.add_argument(
        "--epsilon-budget",
        type=positive_float,
        help="each hospital's budget (default: 3; dp-fedavg 10, AE-DPFL 2000, kNN-DPFL 10); for central-dp and fedavg-local-dp, "
        "the epsilon per record they spend (default: 3)",
    )
    parser.add_argument("--round-timeout", type=positive_float, default=60.0, help="seconds a round waits for updates")
    parser.add_argument(
        "--expected-batch-size",
        type=positive_float,
        help="B, the consortium's public figure (default: proposed as q times the data set's public training size "
        "over the number of hospitals, never from a hospital's own count)",
    )
    parser.add_argument(
        "--send-offset", type=non_negative_float, default=DEFAULT_SEND_OFFSET_S, help="each hospital's --send-offset"
    )
    parser.add_argument(
        "--transcript-payloads", action="store_true", help="the server's transcript keeps whole messages, not digests"
    )
    parser.add_argument(
        "--insecure-plaintext-benchmark",
        action="store_true",
        help="Dopamine and dp-fedavg: NO secure aggregation, updates travel and are summed in the clear and no privacy claim holds. "
        "Only for consilium-bench-round's comparison",
    )
    add_run_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(run(lambda: run_federation(args)))


def run_federation(args: argparse.Namespace) -> dict:
    resolve_run_arguments(args, FEDERATION_METHODS)
    voting = args.method in VOTING_METHODS
    if args.hospitals_per_process > 1 and not voting:
        raise ConfigError(
            "--hospitals-per-process is for voting runs; a hospital of the secure round needs its own process"
        )
    if args.insecure_plaintext_benchmark and args.method not in TRAINING_METHODS:
        raise ConfigError(
            f"--insecure-plaintext-benchmark is for the secure round (dopamine, dp-fedavg), not for {args.method}"
        )
    if args.data is None:  # votes need classes to vote on and a public pool to label: the ten digits
        args.data = "digits" if voting else "breast_cancer"
    out = args.out or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    federation, logs = out / "federation", out / "logs"
    if federation.exists() or (out / "report.json").exists():
        raise ProtocolError(f"{out} already holds a run; choose another --out")
    data = load_dataset(args.data, split_seed=args.seed)
    resolve_data_defaults(args, data.input_shape)
    parts = partition(  # each hospital partitions alike; a partition that cannot be made fails here, before any process starts
        data.train.y,
        args.hospitals,
        args.partition,
        seed=args.seed,
        classes_per_part=args.classes_per_part,
        alpha=args.alpha,
    )
    if args.method in BASELINES:
        return _run_baseline(args, data, parts, out)
    proposed_batch_size = _propose_batch_size(args, data)
    if not voting:
        _check_training(args, data, [len(part) for part in parts])
    logs.mkdir(parents=True, exist_ok=True)
    address = f"tcp://127.0.0.1:{free_port()}"
    mpc_addresses = tuple(f"127.0.0.1:{free_port()}" for _ in range(args.talliers)) if voting else ()
    roster = local_federation(federation, hospitals=args.hospitals, address=address, mpc_addresses=mpc_addresses)

    print(
        f"federation: server + {args.hospitals} hospitals on {address}, {data.name} ({args.partition}, "
        f"{len(data.train)} training records), outputs in {out}",
        flush=True,
    )
    if args.insecure_plaintext_benchmark:
        print(
            "WARNING: secure aggregation is OFF (--insecure-plaintext-benchmark): the epsilons below do not hold",
            flush=True,
        )
    if proposed_batch_size:
        print(
            f"B = {args.expected_batch_size:g}, proposed as q x {len(data.train)} (the data set's public training size) / "
            f"{args.hospitals} hospitals; a consortium states its own with --expected-batch-size",
            flush=True,
        )

    # Every party confirms the roster as in a real federation; here one operator compared the fingerprint with itself.
    confirmed = ["--federation", str(federation), "--roster-fingerprint", roster.fingerprint]
    common = [*confirmed, "--data", args.data, "--data-seed", str(args.seed)]
    server_argv = [
        *common,
        *run_argv(args),
        "--out",
        str(out / SERVER),
        "--transcript",
        str(out / SERVER / "transcript.msgpack"),
        "--round-timeout",
        str(args.round_timeout),
        *(["--transcript-payloads"] if args.transcript_payloads else []),
        *(
            ["--expected-batch-size", repr(args.expected_batch_size)]
            if not voting and args.expected_batch_size is not None
            else []
        ),
        *(["--insecure-plaintext-benchmark"] if args.insecure_plaintext_benchmark else []),
    ]
    started = time.monotonic()
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    server = _launch("scripts.server", server_argv, logs / "server.log", environment, stdout=subprocess.PIPE)
    talliers = {
        name: _launch(
            "scripts.tallier",
            [
                *confirmed,
                "--name",
                name,
                "--timeout",
                str(3 * args.round_timeout),
                "--transcript",
                str(out / name / "transcript.msgpack"),
                *(["--allow-histogram"] if args.reveal == "histogram" else []),
            ],
            logs / f"{name}.log",
            environment,
        )
        for name in roster.talliers
    }
    hospitals = {}
    names = list(roster.hospitals)
    for first in range(0, len(names), args.hospitals_per_process):
        group = names[first : first + args.hospitals_per_process]
        hospital_argv = [
            *common,
            *[flag for name in group for flag in ("--name", name)],
            "--method",
            args.method,
            *(["--allow-histogram"] if args.reveal == "histogram" else []),
            "--parts",
            str(args.hospitals),
            *[flag for index in range(first + 1, first + len(group) + 1) for flag in ("--part", str(index))],
            "--partition",
            args.partition,
            "--partition-seed",
            str(args.seed),
            "--alpha",
            str(args.alpha),
            "--epsilon-budget",
            str(args.epsilon_budget),
            "--delta",
            str(args.delta),
            "--timeout",
            str(3 * args.round_timeout),
            "--send-offset",
            str(args.send_offset),
            *(["--insecure-plaintext-benchmark"] if args.insecure_plaintext_benchmark else []),
        ]
        if args.classes_per_part:
            hospital_argv += ["--classes-per-part", str(args.classes_per_part)]
        process = group[0] if len(group) == 1 else f"{group[0]}..{group[-1]}"
        hospitals[process] = _launch("scripts.hospital", hospital_argv, logs / f"{process}.log", environment)

    deadline = started + _STARTUP_ALLOWANCE_S + 3 * args.rounds * args.round_timeout
    try:
        _relay_progress(server, deadline)
        server_status = server.wait(timeout=max(1.0, deadline - time.monotonic()))
        if server_status != 0:
            raise ProtocolError(f"the server failed (exit {server_status}): {_tail(logs / 'server.log')}")
        statuses = {name: _wait(process) for name, process in {**hospitals, **talliers}.items()}
    finally:
        for process in [server, *hospitals.values(), *talliers.values()]:
            if process.poll() is None:
                process.kill()
    for name, status in statuses.items():
        if status != 0:
            print(f"warning: {name} exited with status {status}: {_tail(logs / f'{name}.log')}", file=sys.stderr)

    if voting:
        return _vote_report(out, wall_seconds=time.monotonic() - started)
    report = build_report(
        json.loads((out / SERVER / "server_report.json").read_text()),
        {name: _hospital_metrics(federation / name) for name in hospitals},
        wall_seconds=time.monotonic() - started,
    )
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plot_report(report, out / "report.png")
    final, wire = report["final"], report["wire"]
    epsilon = final["epsilon"]
    if report["config"]["aggregation"] == SECURE_AGGREGATION:
        (level, _), *others = final["epsilon_levels"].items()
        privacy = (
            f"epsilon per {level} at delta {final['delta']:g}: {epsilon['server']:.3f} against the server, "
            f"{epsilon['peer_hospital']:.3f} against a fellow hospital, {epsilon['collusion']:.3f} if all the others "
            f"collude; "
            + "".join(
                f"per {name}: {e['server']:.3f}, {e['peer_hospital']:.3f}, {e['collusion']:.3f}; " for name, e in others
            )
            + "encrypted update"
        )
    else:
        privacy = "NO privacy guarantee (--insecure-plaintext-benchmark); plaintext update"
    print(
        f"done in {report['wall_seconds']:.0f} s: {_scores(final)}; {privacy} "
        f"{wire['update_bytes_per_round']:.0f} bytes = {wire['update_ratio_to_float32']:.2f}x float32",
        flush=True,
    )
    print(f"report: {out / 'report.json'}, plot: {out / 'report.png'}", flush=True)
    return report


def planned_epsilons(argv: list[str]) -> dict[str, float]:
    """Epsilon by view, at the method's first level, that a hospital's ledger will hold once every round
    of the secure-round run of ``argv`` is released: each charged at the quorum, as hospitals charge
    it (the server charges at the contributors, never fewer); computed before the run."""
    args = build_parser().parse_args(argv)
    resolve_run_arguments(args)
    if args.method not in TRAINING_METHODS:
        raise ConfigError(f"{args.method} does not run over the secure round: it has no ledger to plan")
    data = load_dataset(args.data, split_seed=args.seed)
    resolve_data_defaults(args, data.input_shape)
    _propose_batch_size(args, data)
    config = _local_run_config(args, data)
    ledger = PrivacyLedger()
    ledger.begin_run(config.run_id, "planned")
    release = ledger_release(config.training, config.mechanism(), config.training.quorum)
    for number in range(1, args.rounds + 1):
        ledger.record(release, run_id=config.run_id, round_number=number)
    return ledger.epsilons(args.delta)


def _propose_batch_size(args: argparse.Namespace, data: Dataset) -> bool:
    """Dopamine's B where the consortium states none: q times the data set's public size over K. Whether it did."""
    if args.method != "dopamine" or args.expected_batch_size is not None:
        return False
    args.expected_batch_size = round(args.sample_rate * len(data.train) / args.hospitals, 1)
    return True


def _run_baseline(args: argparse.Namespace, data: Dataset, parts: list[np.ndarray], out: Path) -> dict:
    """A baseline, in this process, on the same data, partition and model as a federation (``training.baselines``)."""
    if args.method not in DP_BASELINES and args.epsilon_budget is not None:
        raise ConfigError(
            f"--epsilon-budget is the target of the DP baselines ({', '.join(DP_BASELINES)}); {args.method} spends none"
        )
    for flag in ("quorum", "expected_batch_size"):
        if getattr(args, flag) is not None:
            raise ConfigError(
                f"--{flag.replace('_', '-')} is for the secure round; the baseline {args.method} runs in one process"
            )
    fields = {
        "rounds": args.rounds,
        "learning_rate": args.lr if args.method in DP_BASELINES else args.local_lr,
        "batch_size": args.local_batch_size,
        "local_epochs": args.local_epochs,
        "epsilon": args.epsilon_budget,
        "delta": args.delta,
        "max_grad_norm": args.max_grad_norm,
        "sample_rate": args.sample_rate,
        "momentum": args.momentum,
        "accountant": args.accountant,
    }
    try:
        spec = model_spec(args, data, data.validation)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    print(
        f"{args.method}: {args.hospitals} hospitals' records of {data.name} ({args.partition}) in this process, outputs in {out}",
        flush=True,
    )
    try:
        result = run_baseline(
            args.method, data, parts, spec, BaselineSettings(**{k: v for k, v in fields.items() if v is not None})
        )
    except ValueError as error:  # e.g. Opacus: a budget no noise multiplier can meet
        raise ConfigError(f"{args.method}: {error}") from None
    report = {
        "config": {
            "dataset": data.name,
            "hospitals": args.hospitals,
            "partition": args.partition,
            "seed": args.seed,
            "model": spec.to_dict(),
        },
        **result,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    final = report["final"]
    privacy = (
        "no privacy"
        if final["epsilon"] is None
        else f"epsilon per record {final['epsilon']:.3f} at delta {final['delta']:g}"
    )
    print(f"done in {report['wall_seconds']:.0f} s: {_scores(final)}; {privacy}", flush=True)
    print(f"report: {out / 'report.json'}", flush=True)
    return report


def _scores(final: dict) -> str:
    """The round selected on validation accuracy and, where the data have a test split, its test scores."""
    selected = final["selected"]
    if selected is None:
        return "no round released"
    shown = f"validation accuracy {_fraction(selected['validation_accuracy'])} (round {selected['round']}, the best)"
    if selected["test"] is not None:
        shown += f", its test accuracy {_fraction(selected['test']['accuracy'])} and AUC {_fraction(selected['test']['auc'])}"
    return shown


def _local_run_config(args: argparse.Namespace, data: Dataset) -> RunConfig:
    """The configuration the server of this local federation will announce (its run id aside)."""
    return build_run_config(args, tuple(f"hospital-{k}" for k in range(1, args.hospitals + 1)), data)


def _check_training(args: argparse.Namespace, data: Dataset, part_sizes: list[int]) -> None:
    """What would stop the run at its first round, said before any process starts (``ConfigError``)."""
    config = _local_run_config(args, data)
    if isinstance(config.training, DpFedAvgSettings) and config.training.max_subclients > min(part_sizes):
        raise ConfigError(
            f"{'up to ' if config.training.subclient_rule == 'adaptive' else ''}v = {config.training.max_subclients} "
            f"sub-clients per hospital, but the smallest hospital has "
            f"{min(part_sizes)} records: more sub-clients than records"
        )
    budget = PrivacyBudget(epsilon=args.epsilon_budget, delta=args.delta)
    refusal = budget.refusal(
        PrivacyLedger(), ledger_release(config.training, config.mechanism(), config.training.quorum), 1
    )
    if refusal:
        raise ConfigError(f"{refusal}: the first round alone exceeds --epsilon-budget (raise the noise or the budget)")


def _vote_report(out: Path, *, wall_seconds: float) -> dict:
    report = {**json.loads((out / SERVER / "server_report.json").read_text()), "wall_seconds": wall_seconds}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plot_vote_report(report, out / "report.png")
    final = report["final"]
    epsilon = final["epsilon"]
    if epsilon["record"]["server"] > _MEANINGFUL_EPSILON:
        print(
            f"warning: epsilon {epsilon['record']['server']:.0f} per record protects no record meaningfully; "
            "the data-independent guarantee of voting needs many hospitals (the voting paper's AE-DPFL uses 100) or more noise",
            flush=True,
        )
    print(
        f"done in {wall_seconds:.0f} s ({report['finish_reason']}): {final['queries_labelled']} queries labelled"
        + (f" ({final['queries_withheld']} withheld under the label threshold)" if final["queries_withheld"] else "")
        + ", "
        f"label accuracy {_fraction(final['label_accuracy'])}, student test accuracy {_fraction(final['student_test_accuracy'])}; "
        f"epsilon at delta {final['delta']:g} against the server: {epsilon['record']['server']:.3f} per record, "
        f"{epsilon['hospital']['server']:.3f} per hospital; MPC {1000 * (final['mpc_seconds_per_query'] or 0):.1f} ms per query"
        + (f"; {report['reveal_warning']}" if report["reveal_warning"] else ""),
        flush=True,
    )
    print(f"report: {out / 'report.json'}, plot: {out / 'report.png'}", flush=True)
    return report


def _fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def plot_vote_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labelled = [r for r in report["rounds"] if r["status"] == "labelled"]
    rounds = [r["round"] for r in labelled]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(rounds, [r["label_accuracy"] for r in labelled], marker="o", color="tab:blue")
    top.set_ylabel("label accuracy")
    top.grid(alpha=0.3)
    for level, label in (("record", "per record"), ("hospital", "per hospital")):
        bottom.plot(
            rounds, [r["epsilon"][level]["server"] for r in labelled], marker="o", label=f"{label}, against the server"
        )
    bottom.set_ylabel(f"epsilon (delta {report['final']['delta']:g})")
    bottom.set_xlabel("round")
    bottom.legend()
    bottom.grid(alpha=0.3)
    config = report["config"]
    figure.suptitle(
        f"{report['method']} on {config['dataset']}: {len(config['hospitals'])} hospitals, {len(config['talliers'])} talliers, "
        f"student test accuracy {_fraction(report['final']['student_test_accuracy'])}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def build_report(server: dict, hospitals: dict[str, dict], *, wall_seconds: float) -> dict:
    """Merge the server's report with each hospital's own metrics, round by round."""
    by_round = {name: {r["round"]: r for r in metrics.get("rounds", [])} for name, metrics in hospitals.items()}
    rounds = []
    for record in server["rounds"]:
        record = dict(record)
        record["hospitals"] = {
            name: rounds_of[record["round"]] for name, rounds_of in by_round.items() if record["round"] in rounds_of
        }
        rounds.append(record)
    hospital_rounds = [r for rounds_of in by_round.values() for r in rounds_of.values()]
    float32_bytes = 4 * server["parameter_count"]

    def mean_of(key: str) -> float:
        return float(np.mean([r[key] for r in hospital_rounds])) if hospital_rounds else 0.0

    def mean_seconds(records: list[dict], phase: str) -> float:
        values = [r["seconds"][phase] for r in records if phase in r["seconds"]]
        return float(np.mean(values)) if values else 0.0

    return {
        "config": server["config"],
        "run_fingerprint": server["run_fingerprint"],
        "bfv": server["bfv"],
        "mechanism": server["mechanism"],
        "final": {**server["final"], "finish_reason": server["finish_reason"]},
        "wire": {
            "float32_update_bytes": float32_bytes,
            "update_bytes_per_round": mean_of("update_bytes"),
            "update_ratio_to_float32": mean_of("update_bytes") / float32_bytes,
            "aggregate_bytes_per_round": mean_of("received_bytes"),
            "aggregate_ratio_to_float32": mean_of("received_bytes") / float32_bytes,
            "sent_bytes_per_round": mean_of("sent_bytes"),
            "note": "per hospital per round; update = the encrypted upload, aggregate = the encrypted sum downloaded, "
            "sent = upload plus the release message (the first contributor's includes the float32 mean)",
        },
        "phase_seconds": {
            "server": {
                **server["phase_seconds"],
                **{
                    f"{phase}_per_round": mean_seconds(server["rounds"], phase)
                    for phase in ("collect", "aggregate", "release", "evaluate")
                },
            },
            "hospital_per_round": {
                phase: mean_seconds(hospital_rounds, phase) for phase in ("train", "encrypt", "decrypt")
            },
        },
        "send_offset_overruns": sum(r["overran_send_offset"] for r in hospital_rounds),
        "rejected_messages": server["rejected_messages"],
        "wall_seconds": wall_seconds,
        "rounds": rounds,
    }


def plot_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    released = [r for r in report["rounds"] if r["status"] == "released"]
    rounds = [r["round"] for r in released]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(rounds, [r["validation_accuracy"] for r in released], color="tab:blue")
    top.set_ylabel("validation accuracy")
    top.grid(alpha=0.3)
    views = (
        ("server", "against the server", "-"),
        ("peer_hospital", "against a fellow hospital", "--"),
        ("collusion", "if all the others collude", ":"),
    )
    for view, label, style in views:
        bottom.plot(rounds, [r["epsilon"][view] for r in released], label=label, linestyle=style)
    level = next(iter(report["final"]["epsilon_levels"]))
    bottom.set_ylabel(f"epsilon per {level} (delta {report['final']['delta']:g})")
    bottom.set_xlabel("round")
    bottom.legend()
    bottom.grid(alpha=0.3)
    config = report["config"]
    aggregation = (
        "secure aggregation OFF: the epsilons do NOT hold"
        if config["aggregation"] == INSECURE_PLAINTEXT
        else "BFV secure aggregation"
    )
    figure.suptitle(
        f"{config['training']['method']} on {config['dataset']}: {len(config['hospitals'])} hospitals, {aggregation}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _launch(module: str, argv: list[str], log: Path, environment: dict, stdout=None) -> subprocess.Popen:
    handle = log.open("w")
    return subprocess.Popen(
        [sys.executable, "-m", module, *argv],
        stdout=stdout if stdout is not None else handle,
        stderr=handle,
        text=True,
        env=environment,
    )


def _relay_progress(server: subprocess.Popen, deadline: float) -> None:
    """Print the server's lines as they come; give up at ``deadline``."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in server.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProtocolError("the federation did not finish in time")
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            continue
        if line is None:
            return
        print(line, end="", flush=True)


def _wait(process: subprocess.Popen) -> int:
    try:
        return process.wait(timeout=_SHUTDOWN_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _hospital_metrics(state_dir: Path) -> dict:
    files = sorted(state_dir.glob("metrics-*.json"))
    return json.loads(files[-1].read_text()) if files else {}


def _tail(log: Path) -> str:
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    return " | ".join(lines[-_LOG_TAIL_LINES:]) or "(no output)"


if __name__ == "__main__":
    main()
