"""Privacy is enforced where the data lives: real server and hospital processes, run twice."""

import json
import subprocess
from dataclasses import replace

import pytest

from conftest import child_environment, free_port, launcher, party_ledger, run_launcher
from consilium.orchestration.planning import planned_epsilons
from consilium.orchestration.spec import RunSpec
from consilium.protocol.identity.roster import local_federation
from scripted import confirmed
from consilium.training.privacy.accounting import release_of
from consilium.training.models.build import build_model
from consilium.training.models.spec import ModelSpec
from consilium.training.privacy.skellam import SkellamMechanism

pytestmark = pytest.mark.slow
TRAINING = ("--sample-rate", "0.1", "--hidden", "4", "--expected-batch-size", "15")


def _run(federation, out, rounds, budgets, noise=("--noise-multiplier", "1.0")):
    """Hospitals' stdout by name, and the server's."""
    server = subprocess.Popen(
        launcher(
            "server",
            *confirmed(federation),
            "--out",
            out,
            "--rounds",
            rounds,
            "--round-timeout",
            "30",
            *TRAINING,
            *noise,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_environment(),
    )
    hospitals = {
        name: subprocess.Popen(
            launcher(
                "hospital",
                *confirmed(federation),
                "--name",
                name,
                "--parts",
                "3",
                "--part",
                index,
                "--epsilon-budget",
                budget,
                "--timeout",
                "60",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_environment(),
        )
        for index, (name, budget) in enumerate(budgets.items(), start=1)
    }
    outputs = {name: process.communicate(timeout=120) for name, process in hospitals.items()}
    server_output = server.communicate(timeout=120)
    assert server.returncode == 0, server_output[1]
    for name, process in hospitals.items():
        assert process.returncode == 0, outputs[name][1]
    return {name: stdout for name, (stdout, _) in outputs.items()}, server_output[0]


def test_a_restart_keeps_the_ledger_and_the_budget_binds_on_the_worst_view(tmp_path):
    federation = tmp_path / "federation"
    local_federation(federation, hospitals=3, address=f"tcp://127.0.0.1:{free_port()}")
    _, server_output = _run(
        federation, tmp_path / "run1", 2, {"hospital-1": "10", "hospital-2": "10", "hospital-3": "10"}
    )
    first = party_ledger(federation / "hospital-1")
    assert first.steps == 2
    spent = first.epsilon(1e-5)
    assert (
        f"plan: 2 rounds, each released at the quorum of 3, spend epsilon {spent:.3f} against the server"
        in server_output
    )

    # A new run: one more round would keep the server's view within hospital-1's budget, but not a
    # fellow hospital's (it knows its own noise share), so hospital-1 withdraws before sending.
    dimension = sum(p.numel() for p in build_model(ModelSpec("mlp", (30,), 2, (4,))).parameters())
    mechanism = SkellamMechanism.calibrate(dimension=dimension, max_grad_norm=1.0, noise_multiplier=1.0, quorum=3)
    third = release_of(mechanism, sample_rate=0.1, contributors=3, coalition=1)
    server_view, peer_view = (first.epsilon(1e-5, view=v, extra=third) for v in ("server", "peer_hospital"))
    budget = (server_view + peer_view) / 2
    outputs, _ = _run(
        federation, tmp_path / "run2", 5, {"hospital-1": f"{budget:.6f}", "hospital-2": "10", "hospital-3": "10"}
    )
    assert "epsilon against the peer hospital" in outputs["hospital-1"]
    after = party_ledger(federation / "hospital-1")
    assert after.steps == 2 and after.epsilon(1e-5) == pytest.approx(spent)
    # The others contributed to the aborted round: their charges stay (a crash or abort can only over-count).
    assert party_ledger(federation / "hospital-2").steps == party_ledger(federation / "hospital-3").steps == 3


def _federation(out, *flags):
    result = run_launcher("federation", "--out", out, "--hidden", "4", *flags)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    plan = next(index for index, line in enumerate(lines) if line.startswith("plan: "))
    assert plan < next(index for index, line in enumerate(lines) if line.startswith("round "))  # said before round 1
    return lines[plan], json.loads((out / "report.json").read_text())


def test_a_target_epsilon_is_spent_to_within_two_percent_on_the_view_it_binds_and_planned_before_round_1(tmp_path):
    plan, report = _federation(tmp_path / "run", "--rounds", "5", "--target-epsilon", "4")
    spent = report["final"]["epsilon"]
    assert 0.98 * 4 <= spent["coalition"] <= 4 and spent["peer_hospital"] <= 4  # the default view, and each before it
    assert f"{spent['coalition']:.3f} against the server with 1 hospital" in plan
    assert "calibrated to epsilon 4 against the server with 1 hospital" in plan
    assert report["final"]["rounds_released"] == 5


def test_a_run_whose_hospitals_budgets_are_spent_is_planned_to_stop_and_ends_saying_so(tmp_path):
    spec = RunSpec(rounds=2, hidden=(4,))
    two, three = (planned_epsilons(spec)["coalition"], planned_epsilons(replace(spec, rounds=3))["coalition"])
    plan, report = _federation(tmp_path / "run", "--rounds", "5", "--epsilon-budget", f"{(two + three) / 2:.6f}")
    assert "stops the run after round 2" in plan
    assert report["final"]["rounds_released"] == 2
    assert report["final"]["finish_reason"] == (
        "the privacy budget of hospital-1, hospital-2, hospital-3 is spent: only 0 hospitals remain, fewer than the "
        "quorum of 3"
    )


def test_a_server_calibrates_the_run_s_noise_to_a_target_epsilon(tmp_path):
    federation = tmp_path / "federation"
    local_federation(federation, hospitals=3, address=f"tcp://127.0.0.1:{free_port()}")
    budgets = dict.fromkeys(("hospital-1", "hospital-2", "hospital-3"), "10")
    _, server_output = _run(federation, tmp_path / "run", 3, budgets, noise=("--target-epsilon", "4"))
    spent = party_ledger(federation / "hospital-1").epsilons(1e-5)
    assert 0.98 * 4 <= spent["coalition"] <= 4  # the default view, as a hospital's budget binds
    assert f"{spent['coalition']:.3f} against the server with 1 hospital" in server_output
