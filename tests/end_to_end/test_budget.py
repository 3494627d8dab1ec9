"""Privacy is enforced where the data lives: real server and hospital processes, run twice."""

import subprocess

import pytest

from conftest import child_environment, free_port, launcher, party_ledger
from consilium.protocol.identity.roster import local_federation
from scripted import confirmed
from consilium.training.privacy.accounting import release_of
from consilium.training.models.build import build_model
from consilium.training.models.spec import ModelSpec
from consilium.training.privacy.skellam import SkellamMechanism

pytestmark = pytest.mark.slow
TRAINING = ("--sample-rate", "0.1", "--noise-multiplier", "1.0", "--hidden", "4", "--expected-batch-size", "15")


def _run(federation, out, rounds, budgets):
    server = subprocess.Popen(
        launcher(
            "server", *confirmed(federation), "--out", out, "--rounds", rounds, "--round-timeout", "30", *TRAINING
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
    return {name: stdout for name, (stdout, _) in outputs.items()}


def test_a_restart_keeps_the_ledger_and_the_budget_binds_on_the_worst_view(tmp_path):
    federation = tmp_path / "federation"
    local_federation(federation, hospitals=3, address=f"tcp://127.0.0.1:{free_port()}")
    _run(federation, tmp_path / "run1", 2, {"hospital-1": "10", "hospital-2": "10", "hospital-3": "10"})
    first = party_ledger(federation / "hospital-1")
    assert first.steps == 2
    spent = first.epsilon(1e-5)

    # A new run: one more round would keep the server's view within hospital-1's budget, but not a
    # fellow hospital's (it knows its own noise share), so hospital-1 withdraws before sending.
    dimension = sum(p.numel() for p in build_model(ModelSpec("mlp", (30,), 2, (4,))).parameters())
    mechanism = SkellamMechanism.calibrate(dimension=dimension, max_grad_norm=1.0, noise_multiplier=1.0, quorum=3)
    third = release_of(mechanism, sample_rate=0.1, contributors=3, coalition=1)
    server_view, peer_view = (first.epsilon(1e-5, view=v, extra=third) for v in ("server", "peer_hospital"))
    budget = (server_view + peer_view) / 2
    outputs = _run(
        federation, tmp_path / "run2", 5, {"hospital-1": f"{budget:.6f}", "hospital-2": "10", "hospital-3": "10"}
    )
    assert "epsilon against the peer hospital" in outputs["hospital-1"]
    after = party_ledger(federation / "hospital-1")
    assert after.steps == 2 and after.epsilon(1e-5) == pytest.approx(spent)
    # The others contributed to the aborted round: their charges stay (a crash or abort can only over-count).
    assert party_ledger(federation / "hospital-2").steps == party_ledger(federation / "hospital-3").steps == 3
