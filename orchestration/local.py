"""``run_local_federation``: a whole federation on this machine, one OS process per party.

Set up as a real federation is (``protocol.identity.roster.local_federation``: each party's keys made in its
own folder, the roster assembled from their public files), then the server, the hospitals and, for
voting, the talliers are started as separate processes (``consilium-server``, ``consilium-hospital``,
``consilium-tallier``) that talk over CurveZMQ on localhost, each started with the roster's
fingerprint. The server's lines are relayed as they come; at the end its report is merged with the
hospitals' metrics (``orchestration.report``). A baseline runs in this process instead, on the same
data, partition and model (``training.methods.baselines``).

Writes into the spec's ``out`` (default ``runs/<date-time>``): ``report.json``, ``report.png``,
``federation/`` (each party's folder and the roster), ``server/`` and ``logs/``.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

import numpy as np

from consilium.orchestration.planning import check_first_round, planned_run
from consilium.orchestration.report import (
    baseline_summary,
    build_report,
    plot_report,
    plot_vote_report,
    training_summary,
    vote_summary,
    vote_warning,
)
from consilium.orchestration.run_flags import model_spec, run_argv, shown
from consilium.orchestration.spec import RunSpec, resolve
from consilium.protocol.run.rules import ConfigError
from consilium.protocol.wire.messages import ProtocolError
from consilium.protocol.identity.party_keys import SERVER
from consilium.protocol.identity.roster import Roster, local_federation
from consilium.training.methods.baselines import BASELINES, DP_BASELINES, BaselineSettings, run_baseline
from consilium.training.models.compute_device import use_device
from consilium.training.data.datasets import Dataset
from consilium.training.models.evaluation import Selection
from consilium.training.models.own_code import is_reference
from consilium.training.data.partition import partition

__all__ = ["free_port", "run_local_federation"]

_STARTUP_ALLOWANCE_S = 120.0
_SHUTDOWN_GRACE_S = 30.0
_LOG_TAIL_LINES = 5


def _echo(line: str) -> None:
    print(line, flush=True)


def run_local_federation(spec: RunSpec, *, echo: Callable[[str], None] = _echo) -> dict:
    """Run ``spec`` to the end and return its report; ``echo`` gets each line of progress.

    ``ConfigError`` for a spec that cannot run (said before any process starts), ``ProtocolError``
    for a run that failed or did not finish in time (every process it started is stopped).
    """
    given_batch_size = spec.expected_batch_size
    spec, data = resolve(spec)
    out = spec.out or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    if (out / "federation").exists() or (out / "report.json").exists():
        raise ProtocolError(f"{out} already holds a run; choose another --out")
    parts = partition(  # each hospital partitions alike; a partition that cannot be made fails here, before any process starts
        data.train.y,
        spec.hospitals,
        spec.partition,
        seed=spec.seed,
        classes_per_part=spec.classes_per_part,
        alpha=spec.alpha,
    )
    if spec.method in BASELINES:
        return _run_baseline(spec, data, parts, out, echo)
    plan = ""
    if not spec.voting:
        spec, plan = planned_run(spec, data)
        check_first_round(spec, data, [len(part) for part in parts])
    (out / "logs").mkdir(parents=True, exist_ok=True)
    address = f"tcp://127.0.0.1:{free_port()}"
    mpc_addresses = tuple(f"127.0.0.1:{free_port()}" for _ in range(spec.talliers)) if spec.voting else ()
    roster = local_federation(
        out / "federation", hospitals=spec.hospitals, address=address, mpc_addresses=mpc_addresses
    )
    echo(
        f"federation: server + {spec.hospitals} hospitals on {address}, {data.name} ({spec.partition}, "
        f"{len(data.train)} training records), outputs in {out}"
    )
    if spec.insecure_plaintext_benchmark:
        echo("WARNING: secure aggregation is OFF (--insecure-plaintext-benchmark): the epsilons below do not hold")
    if given_batch_size is None and spec.expected_batch_size is not None:
        echo(
            f"B = {spec.expected_batch_size:g}, proposed as q x {len(data.train)} (the data set's public training size) / "
            f"{spec.hospitals} hospitals; a consortium states its own with --expected-batch-size"
        )
    if plan:
        echo(plan)
    started = time.monotonic()
    server, hospitals, talliers = _start_parties(spec, roster, out)
    _await_parties(
        server,
        {**hospitals, **talliers},
        out / "logs",
        deadline=started + _STARTUP_ALLOWANCE_S + 3 * spec.rounds * spec.round_timeout,
        echo=echo,
    )
    wall_seconds = time.monotonic() - started
    if spec.voting:
        return _finish_vote(out, wall_seconds, echo)
    return _finish_training(out, list(hospitals), wall_seconds, echo)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a local federation's parties."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start_parties(
    spec: RunSpec, roster: Roster, out: Path
) -> tuple[subprocess.Popen, dict[str, subprocess.Popen], dict[str, subprocess.Popen]]:
    """The server (its stdout piped, to be relayed), then the talliers and the hospital processes, by name,
    each logging to ``out/logs``."""
    logs, federation = out / "logs", out / "federation"
    # Every party confirms the roster as in a real federation; here one operator compared the fingerprint with itself.
    confirmed = ["--federation", str(federation), "--roster-fingerprint", roster.fingerprint]
    common = [*confirmed, "--data", spec.data, "--data-seed", str(spec.seed)]
    common += ["--image-size", shown(spec.image_size)] if spec.image_size else []
    common += ["--image-channels", str(spec.image_channels)] if spec.image_channels else []
    common += ["--device", spec.device] if spec.device else []
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    server = _launch(
        "consilium.scripts.server",
        [*common, *_server_argv(spec, out)],
        logs / "server.log",
        environment,
        stdout=subprocess.PIPE,
    )
    talliers, hospitals = {}, {}
    for name in roster.talliers:
        argv = [*confirmed, "--name", name, "--timeout", str(3 * spec.round_timeout)]
        argv += ["--transcript", str(out / name / "transcript.msgpack")]
        argv += ["--allow-histogram"] if spec.flags.get("reveal") == "histogram" else []
        talliers[name] = _launch("consilium.scripts.tallier", argv, logs / f"{name}.log", environment)
    names = list(roster.hospitals)
    for first in range(0, len(names), spec.hospitals_per_process):
        group = names[first : first + spec.hospitals_per_process]
        process = group[0] if len(group) == 1 else f"{group[0]}..{group[-1]}"
        argv = [*common, *_hospital_argv(spec, group, first)]
        hospitals[process] = _launch("consilium.scripts.hospital", argv, logs / f"{process}.log", environment)
    return server, hospitals, talliers


def _server_argv(spec: RunSpec, out: Path) -> list[str]:
    argv = [*run_argv(spec.values()), "--out", str(out / SERVER)]
    argv += ["--transcript", str(out / SERVER / "transcript.msgpack"), "--round-timeout", str(spec.round_timeout)]
    argv += ["--transcript-payloads"] if spec.transcript_payloads else []
    if not spec.voting:
        argv += ["--model-seed", str(spec.seed)]  # the initial model, as the baselines' (training.models.build)
        argv += ["--rejoin-window", "0"]  # its hospitals are this machine's processes: one that dies stays gone
        argv += ["--select-every", str(spec.select_every), "--select-on", spec.select_on]
    if not spec.voting and spec.expected_batch_size is not None:
        argv += ["--expected-batch-size", repr(spec.expected_batch_size)]
    return argv + (["--insecure-plaintext-benchmark"] if spec.insecure_plaintext_benchmark else [])


def _hospital_argv(spec: RunSpec, group: list[str], first: int) -> list[str]:
    """The flags of the hospital process that plays ``group``, the hospitals ``first + 1`` onwards of the partition."""
    argv = [flag for name in group for flag in ("--name", name)]
    argv += ["--method", spec.method, *(["--allow-histogram"] if spec.flags.get("reveal") == "histogram" else [])]
    argv += ["--parts", str(spec.hospitals)]
    argv += [flag for index in range(first + 1, first + len(group) + 1) for flag in ("--part", str(index))]
    argv += ["--partition", spec.partition, "--partition-seed", str(spec.seed), "--alpha", str(spec.alpha)]
    argv += [
        "--epsilon-budget",
        str(spec.epsilon_budget),
        "--budget-view",
        spec.budget_view,
        "--delta",
        str(spec.delta),
    ]
    argv += ["--timeout", str(3 * spec.round_timeout), "--send-offset", str(spec.send_offset)]
    argv += ["--insecure-plaintext-benchmark"] if spec.insecure_plaintext_benchmark else []
    argv += ["--model", spec.model] if is_reference(spec.model) else []  # each party loads its own copy
    return argv + (["--classes-per-part", str(spec.classes_per_part)] if spec.classes_per_part else [])


def _await_parties(
    server: subprocess.Popen,
    others: dict[str, subprocess.Popen],
    logs: Path,
    *,
    deadline: float,
    echo: Callable[[str], None],
) -> None:
    """Relay the server's lines until it exits, then give the others their grace; whatever still runs is stopped."""
    try:
        _relay_progress(server, deadline, echo)
        server_status = server.wait(timeout=max(1.0, deadline - time.monotonic()))
        if server_status != 0:
            raise ProtocolError(f"the server failed (exit {server_status}): {_tail(logs / 'server.log')}")
        statuses = {name: _wait(process) for name, process in others.items()}
    finally:
        for process in [server, *others.values()]:
            if process.poll() is None:
                process.kill()
    for name, status in statuses.items():
        if status != 0:
            print(f"warning: {name} exited with status {status}: {_tail(logs / f'{name}.log')}", file=sys.stderr)


def _finish_training(out: Path, hospitals: list[str], wall_seconds: float, echo: Callable[[str], None]) -> dict:
    metrics = {name: _hospital_metrics(out / "federation" / name) for name in hospitals}
    report = build_report(
        json.loads((out / SERVER / "server_report.json").read_text()), metrics, wall_seconds=wall_seconds
    )
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plot_report(report, out / "report.png")
    echo(training_summary(report))
    echo(f"report: {out / 'report.json'}, plot: {out / 'report.png'}")
    return report


def _finish_vote(out: Path, wall_seconds: float, echo: Callable[[str], None]) -> dict:
    report = {**json.loads((out / SERVER / "server_report.json").read_text()), "wall_seconds": wall_seconds}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plot_vote_report(report, out / "report.png")
    warning = vote_warning(report)
    if warning:
        echo(warning)
    echo(vote_summary(report))
    echo(f"report: {out / 'report.json'}, plot: {out / 'report.png'}")
    return report


def _run_baseline(
    spec: RunSpec, data: Dataset, parts: list[np.ndarray], out: Path, echo: Callable[[str], None]
) -> dict:
    """A baseline, in this process, on the same data, partition and model as a federation (``training.methods.baselines``)."""
    if spec.method not in DP_BASELINES and spec.epsilon_budget is not None:
        raise ConfigError(
            f"--epsilon-budget is the target of the DP baselines ({', '.join(DP_BASELINES)}); {spec.method} spends none"
        )
    for flag in ("quorum", "expected_batch_size"):
        if getattr(spec, flag) is not None:
            raise ConfigError(
                f"--{flag.replace('_', '-')} is for the secure round; the baseline {spec.method} runs in one process"
            )
    values = spec.values()
    fields = {
        "rounds": spec.rounds,
        "learning_rate": values.lr if spec.method in DP_BASELINES else values.local_lr,
        "batch_size": values.local_batch_size,
        "local_epochs": values.local_epochs,
        "epsilon": spec.epsilon_budget,
        "delta": spec.delta,
        "max_grad_norm": values.max_grad_norm,
        "sample_rate": values.sample_rate,
        "momentum": values.momentum,
        "accountant": values.accountant,
    }
    try:
        model = model_spec(values, data, data.validation)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    echo(
        f"{spec.method}: {spec.hospitals} hospitals' records of {data.name} ({spec.partition}) in this process, outputs in {out}"
    )
    settings = BaselineSettings(**{name: value for name, value in fields.items() if value is not None})
    use_device(spec.device or "cpu")
    try:
        result = run_baseline(
            spec.method,
            data,
            parts,
            model,
            settings,
            model_seed=spec.seed,
            selection=Selection(spec.select_every, spec.select_on),
        )
    except ValueError as error:  # e.g. Opacus: a budget no noise multiplier can meet
        raise ConfigError(f"{spec.method}: {error}") from None
    config = {"dataset": data.name, "hospitals": spec.hospitals, "partition": spec.partition, "seed": spec.seed}
    report = {"config": {**config, "model": model.to_dict()}, **result}
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    echo(baseline_summary(report))
    echo(f"report: {out / 'report.json'}")
    return report


def _launch(module: str, argv: list[str], log: Path, environment: dict, stdout=None) -> subprocess.Popen:
    handle = log.open("w")
    return subprocess.Popen(
        [sys.executable, "-P", "-m", module, *argv],  # -P: nothing imported from the folder it was started in
        stdout=stdout if stdout is not None else handle,
        stderr=handle,
        text=True,
        env=environment,
    )


def _relay_progress(server: subprocess.Popen, deadline: float, echo: Callable[[str], None]) -> None:
    """Echo the server's lines as they come; give up at ``deadline``."""
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
        echo(line.rstrip("\n"))


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
