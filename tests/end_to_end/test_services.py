"""Hospital services as an IT department runs them: each started once, as a real process, then run after
run from the coordinator with no command typed at any site, the site's status read locally, and a stop
(SIGTERM) that withdraws from the run in flight and loses nothing."""

import json
import signal
import subprocess
import time

import pytest

from conftest import child_environment, free_port, launcher, run_launcher
from consilium.protocol.identity.roster import local_federation
from scripted import HospitalProcess, confirmed, wait_for_text

pytestmark = pytest.mark.slow
POLICY = """methods = ["dopamine"]
max_rounds = 100
view = "coalition"
delta = 1e-5
max_epsilon_per_run = 40.0
max_epsilon_lifetime = 100.0
"""
TRAINING = ("--expected-batch-size", "5", "--hidden", "4")


def _server(federation, out, *args):
    """A server of one run, as the coordinator's operator starts it: its output in ``out.log``."""
    return _start(launcher("server", *confirmed(federation), "--out", out, *args), out.parent / f"{out.name}.log")


def _start(command, log):
    with log.open("w") as handle:
        return subprocess.Popen(command, stdout=handle, stderr=handle, text=True, env=child_environment())


class _Site:
    def __init__(self, process, log):
        self.process, self.log = process, log


def _tallier_service(federation, name, tmp_path, *args):
    log = tmp_path / f"{name}.log"
    command = launcher("tallier", *confirmed(federation), "--name", name, "--serve", "--timeout", "60", *args)
    return _Site(_start(command, log), log)


def _status(federation, name, policy):
    result = run_launcher("hospital", "--federation", federation, "--name", name, "--policy", policy, "--status")
    assert result.returncode == 0, result.stderr
    return result.stdout


def _wait_for_state(state_dir, state, process, timeout=60):
    path, deadline = state_dir / "service_status.json", time.monotonic() + timeout
    while not (path.exists() and json.loads(path.read_text())["state"] == state):
        assert process.poll() is None and time.monotonic() < deadline, f"{state_dir.name} never said {state}"
        time.sleep(0.05)


def test_services_take_runs_one_after_another_and_a_stop_withdraws_from_the_run_in_flight(tmp_path):
    federation = tmp_path / "federation"
    local_federation(federation, hospitals=3, address=f"tcp://127.0.0.1:{free_port()}")
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    log_file = tmp_path / "service-1.log"  # hospital-1 logs as a service does, to a file of its own
    services = [
        HospitalProcess(
            federation,
            f"hospital-{i}",
            i,
            3,
            tmp_path / f"hospital-{i}.log",
            "--policy",
            policy,
            *(("--log-file", log_file) if i == 1 else ()),
        )
        for i in (1, 2, 3)
    ]
    try:
        for number, rounds in ((1, "2"), (2, "3")):  # nothing typed at any site between the runs
            server = _server(federation, tmp_path / f"run-{number}", *TRAINING, "--rounds", rounds)
            assert server.wait(timeout=120) == 0, (tmp_path / f"run-{number}.log").read_text()
            assert "finished (completed all rounds)" in (tmp_path / f"run-{number}.log").read_text()
        assert all(service.ledger().steps == 5 for service in services)
        _wait_for_state(services[0].state, "waiting", services[0].process)
        status = _status(federation, "hospital-1", policy)
        assert status.startswith("hospital-1: waiting since") and "last run: training, 3 rounds" in status
        spent = services[0].ledger().epsilon(1e-5, view="coalition")
        assert f"under its policy: {spent:.3f} of 100 spent against the" in status

        # A long run; hospital-1's operator stops its service once the run is under way.
        long_run = _server(federation, tmp_path / "run-3", *TRAINING, "--rounds", "50", "--rejoin-window", "0")
        wait_for_text(tmp_path / "run-3.log", "round    1/50", long_run, timeout=120)
        services[0].process.send_signal(signal.SIGTERM)
        assert services[0].process.wait(timeout=15) == 0, services[0].log.read_text()
        assert long_run.wait(timeout=120) == 0
        report = json.loads((tmp_path / "run-3" / "server_report.json").read_text())
        assert report["departures"]["hospital-1"] == "withdrew: its operator stopped its service"
        assert report["finish_reason"].startswith("only 2 hospitals remain")
        assert services[0].ledger().steps > 5  # whole, and read back (a torn ledger would not be)
        assert _status(federation, "hospital-1", policy).startswith("hospital-1: stopped since")
        logged = log_file.read_text()
        assert "hospital-1 serves: dopamine" in logged and "its operator stopped its service" in logged

        for service in services[1:]:  # the others, stopped while they wait for a run
            _wait_for_state(service.state, "waiting", service.process)
            service.process.send_signal(signal.SIGTERM)
            assert service.process.wait(timeout=15) == 0
            assert "its operator stopped its service" in service.log.read_text()
    finally:
        for service in services:
            service.kill()


def _admin(federation, name, *args):
    return run_launcher("admin", *confirmed(federation), "--name", name, *args)


def test_runs_an_admin_submits_complete_with_every_site_a_service_started_once_and_a_stop_ends_one(tmp_path):
    federation = tmp_path / "federation"
    mpc = tuple(f"127.0.0.1:{free_port()}" for _ in range(3))
    local_federation(
        federation, hospitals=3, address=f"tcp://127.0.0.1:{free_port()}", mpc_addresses=mpc, admins=("admin",)
    )
    policies = {"both": tmp_path / "both.toml", "dopamine": tmp_path / "dopamine.toml"}
    policies["both"].write_text(POLICY.replace('["dopamine"]', '["dopamine", "knn-dpfl"]'))
    policies["dopamine"].write_text(POLICY)
    data = ("--data", "digits")
    log = tmp_path / "coordinator.log"
    coordinator = _start(launcher("server", *confirmed(federation), "--out", tmp_path / "runs", "--coordinate"), log)
    sites = []
    try:
        wait_for_text(log, "coordinator on", coordinator, timeout=60)
        refused = _admin(federation, "hospital-1", "status")  # before hospital-1's service connects with that key
        assert refused.returncode == 2 and "hospital-1 is not an admin" in refused.stderr
        own_flag = _admin(federation, "admin", "submit", "--", "--method", "dopamine", "--out", tmp_path)
        assert own_flag.returncode == 2 and "--out is the coordinator's to set" in own_flag.stderr

        sites += [  # hospital-3's operator allows Dopamine only
            HospitalProcess(
                federation,
                f"hospital-{i}",
                i,
                3,
                tmp_path / f"hospital-{i}.log",
                "--policy",
                policies["dopamine" if i == 3 else "both"],
                *data,
            )
            for i in (1, 2, 3)
        ]
        tallier_policy = tmp_path / "tallier-3.toml"  # tallier-3's operator: kNN-DPFL, labels, at least 2 voters
        tallier_policy.write_text(
            'methods = ["knn-dpfl"]\nreveal = "labels"\nmax_queries_per_run = 100\nmin_quorum = 2\nmin_noise_std = 1\n'
        )
        sites += [_tallier_service(federation, f"tallier-{i}", tmp_path) for i in (1, 2)]
        sites.append(_tallier_service(federation, "tallier-3", tmp_path, "--policy", tallier_policy))
        runs = (
            ("dopamine", "--rounds", "2", *TRAINING),
            ("knn-dpfl", "--rounds", "1", "--queries-per-round", "20", "--feature-dimensions", "10", "--quorum", "2"),
            ("dopamine", "--rounds", "50", "--rejoin-window", "0", *TRAINING),
        )
        for number, (method, *args) in enumerate(runs, start=1):
            submitted = _admin(federation, "admin", "submit", "--", "--method", method, *data, *args)
            assert submitted.returncode == 0 and submitted.stdout.startswith(f"run-{number} queued"), submitted.stderr
        wait_for_text(log, "run-1: finished (completed all rounds)", coordinator, timeout=180)
        wait_for_text(log, "run-2: finished (completed all rounds)", coordinator, timeout=180)
        wait_for_text(log, "run-3: round    1/50", coordinator, timeout=180)
        stopped = _admin(federation, "admin", "stop", "run-3")
        assert stopped.returncode == 0 and "run-3 stops at its next wait" in stopped.stdout
        # Every round released before the answer is printed by then (an aborted round's line has no val_acc).
        printed = sum("run-3: round " in line and "val_acc" in line for line in log.read_text().splitlines())
        wait_for_text(log, "run-3: finished (stopped: the admin stopped the run)", coordinator, timeout=60)

        status = _admin(federation, "admin", "status").stdout
        assert "run-1 (--method dopamine" in status and "run-3 (--method dopamine" in status
        assert "hospital-3 withdrew: declined by its site's policy" in status  # run-2's departures
        assert "hospital-3 declines the run it was welcomed to: " in sites[2].log.read_text()  # and says why
        assert "round    2/2" in _admin(federation, "admin", "logs", "run-1").stdout
        report = json.loads((tmp_path / "runs" / "run-3" / "server_report.json").read_text())
        assert report["finish_reason"] == "stopped: the admin stopped the run"
        released = report["final"]["rounds_released"]
        assert released == printed  # none after the stop was answered
        for hospital in sites[:3]:  # two rounds of run-1, a vote of run-2 but for hospital-3, then run-3's
            _wait_for_state(hospital.state, "waiting", hospital.process)
            charged = hospital.ledger().steps - (2 if hospital.name == "hospital-3" else 3)
            assert released <= charged <= released + 1  # no round after the stop (one in flight at most)
        for site in sites:
            assert site.process.poll() is None  # every site still serving, nothing typed there since it started
    finally:
        coordinator.send_signal(signal.SIGTERM)
        for site in sites:
            site.process.send_signal(signal.SIGTERM)
        assert coordinator.wait(timeout=60) == 0, log.read_text()
        for site in sites:
            assert site.process.wait(timeout=150) == 0, site.log.read_text()
