"""The model a training server keeps: selected on validation among its candidate rounds, never none."""

import pytest

from consilium.protocol.run import server_report
from consilium.protocol.identity.roster import local_federation
from consilium.protocol.run.server_report import SELECTED_MODEL_FILE, RoundRecord, RunRecord
from consilium.training.models.evaluation import Selection
from scripted_peers import small_run_config
from consilium.training.privacy.ledger import PrivacyLedger
from consilium.training.models.build import build_model


@pytest.fixture
def record(tmp_path, monkeypatch):
    """A run of 200 rounds selecting among every 50th, whose round r scores ``accuracy[r]`` on validation
    (and the AUC 1 - accuracy[r])."""
    roster = local_federation(tmp_path / "federation", hospitals=3, address="tcp://127.0.0.1:5999")
    config = small_run_config(roster, quorum=3, rounds=200)
    accuracy = {r: 0.9 if r == 17 else 0.5 + 0.001 * r for r in range(1, 201)}  # round 17 the best of all
    scored = iter(range(1, 201))

    def evaluate(*_, **__):
        value = accuracy[next(scored)]
        return {"accuracy": value, "auc": 1 - value}

    monkeypatch.setattr(server_report, "evaluate", evaluate)

    def make(on="accuracy"):
        return RunRecord(
            config, config.mechanism(), PrivacyLedger(), tmp_path, None, coalition=1, selection=Selection(50, on)
        )

    return make, build_model(config.model)


def _release(run, model, rounds):
    for number in rounds:
        round_record = RoundRecord(round=number, status="aborted", contributors=["hospital-1", "hospital-2"])
        run.score(round_record, model, validation=None)
        run.account(round_record)
        run.rounds.append(round_record)


def test_only_every_n_th_round_and_the_last_are_candidates(record, tmp_path):
    make, model = record
    run = make()
    _release(run, model, range(1, 201))
    run.end_selection(model)
    final = run.final()
    assert final["selection"] == {"every": 50, "on": "accuracy", "candidates": 4}
    assert final["selected"]["round"] == 200  # round 17 was the best of all, but no candidate


def test_a_run_may_select_on_auc(record):
    make, model = record
    run = make("auc")
    _release(run, model, range(1, 201))
    selected = run.final()["selected"]
    assert selected["round"] == 50  # the AUC falls as the accuracy rises
    assert selected["validation_auc"] == pytest.approx(1 - 0.55)  # the score it was selected on, reported


def test_a_run_stopped_before_its_first_candidate_still_keeps_its_last_round(record, tmp_path):
    make, model = record
    run = make()
    _release(run, model, range(1, 31))
    assert run.final()["selected"] is None and not (tmp_path / SELECTED_MODEL_FILE).exists()
    run.end_selection(model)
    assert run.final()["selection"] == {"every": 50, "on": "accuracy", "candidates": 1}
    assert run.final()["selected"]["round"] == 30 and (tmp_path / SELECTED_MODEL_FILE).is_file()
