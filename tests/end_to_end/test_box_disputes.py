"""Box disputes between real processes (``protocol.voting.box_dispute``): a tallier that marks an honest hospital's box
BAD is named and the run stops; one that says it holds no box voids the round and gets no box revealed; a hospital
whose box one tallier cannot open is named once it reveals that box's secret, and the run goes on without it."""

import json

import pytest

from conftest import party_ledger
from test_voting_federation import (
    _DEVIATING,
    _DEVIATING_TALLIER,
    _Federation,
    _outside_the_field,
    _run_with_a_bad_voter,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def federation(tmp_path):
    federation = _Federation(tmp_path, hospitals=3)
    yield federation
    federation.close()


def _with_deviating_tallier_2(federation, where, *server_args):
    federation.server(*server_args)
    for index, name in enumerate(federation.roster.hospitals, start=1):
        federation.hospital(name, index)
    federation.tallier("tallier-1")
    code = _DEVIATING_TALLIER.format(script=str(_DEVIATING), where=where)
    federation.launch_python(code, "tallier-2", "--name", "tallier-2", "--timeout", "60")
    federation.tallier("tallier-3")


@pytest.mark.parametrize("where", ["mark-bad", "mark-bad-interrupted"])
def test_a_tallier_that_marks_an_honest_hospital_s_box_bad_is_named_by_its_revealed_secret_and_the_run_stops(
    federation, where
):
    """tallier-2 marks hospital-1's good box BAD (and then, or not, says its MPC did not finish, which would have the
    round relayed again): the round is void, hospital-1 reveals that one box's secret on the word of t + 1 talliers, the
    box opens to a share, and the server and both honest talliers name tallier-2."""
    _with_deviating_tallier_2(federation, where, "--rounds", "2")
    assert federation.exit_code("server") == 2, federation.log("server")
    report = json.loads((federation.tmp / "out" / "server_report.json").read_text())
    named = "tallier-2 marked hospital-1's box BAD, and it opens to a share with the secret hospital-1 revealed"
    assert named in report["finish_reason"] and report["final"]["queries_labelled"] == 0
    assert "hospital-1 reveals its box to tallier-2 of round 1" in federation.log("hospital-1")
    for name in ("tallier-1", "tallier-3"):
        assert named in federation.log(name)  # each judged the verdict itself, and keeps the deviation
    for name in ("hospital-2", "hospital-3"):
        assert "reveals" not in federation.log(name)
    for name in federation.roster.hospitals:  # void if every tallier signed it; disagreeing, the run stopped first
        assert party_ledger(federation.federation / name).steps == (where == "mark-bad-interrupted")


def test_a_tallier_that_says_it_holds_no_box_it_was_given_voids_the_round_and_the_server_names_it(federation):
    """tallier-2 marks hospital-1's box NONE: it cannot leave hospital-1 out of a count; the round is void, the server,
    which verified and relayed that box to it, names tallier-2 and stops the run, and no box is revealed."""
    _with_deviating_tallier_2(federation, "mark-none", "--rounds", "2")
    assert federation.exit_code("server") == 2, federation.log("server")
    report = json.loads((federation.tmp / "out" / "server_report.json").read_text())
    assert report["final"]["queries_labelled"] == 0 and len(report["rounds"]) <= 1
    named = "tallier-2 said it holds no box from hospital-1, which the server verified and relayed to it: it deviated"
    assert named in report["finish_reason"]
    assert all("reveals" not in federation.log(name) for name in federation.roster.hospitals)
    for name in federation.roster.hospitals:  # void: every tallier signed it, and no ledger keeps the charge
        assert party_ledger(federation.federation / name).steps == 0


def test_a_hospital_whose_box_one_tallier_cannot_open_is_named_once_it_reveals_it_and_the_run_goes_on(federation):
    """hospital-3's share to tallier-2 alone lies outside the field: one BAD mark cannot tell whom to blame, so the
    round is void; hospital-3 reveals that box's secret, the box opens to no share, and it is named and expelled; the
    second round counts the two others (a quorum of 2)."""
    report = _run_with_a_bad_voter(
        federation, lambda config: _outside_the_field(config, talliers=(1,)), "--quorum", "2", "--rounds", "2"
    )
    assert report["finish_reason"] == "completed all rounds" and report["final"]["queries_labelled"] == 20
    first, second = report["rounds"]
    assert first["status"] == "aborted" and len(first["void"]) == 3
    assert first["disputes"] == [
        "round 1: hospital-3's box to tallier-2 does not open to a share: a share value lies outside the field"
    ]
    assert report["departures"]["hospital-3"] == first["disputes"][0] and "hospital-3" in report["expelled"]
    assert second["status"] == "labelled" and second["voters"] == ["hospital-1", "hospital-2"]
    for name in federation.roster.talliers:
        assert "hospital-3's box to tallier-2 does not open to a share" in federation.log(name)


def test_a_hospital_that_does_not_reveal_its_disputed_box_is_expelled_as_silent_and_no_tallier_is_named(federation):
    """hospital-3's share to tallier-2 alone lies outside the field, and it does not answer the dispute: after the
    server's round timeout it is expelled (never readmitted), no tallier is named, and the run goes on without it."""
    report = _run_with_a_bad_voter(
        federation,
        lambda config: _outside_the_field(config, talliers=(1,)),
        *("--quorum", "2", "--rounds", "2", "--round-timeout", "30"),
        reveals=False,
    )
    assert report["finish_reason"] == "completed all rounds" and report["final"]["queries_labelled"] == 20
    first, second = report["rounds"]
    assert first["disputes"] == ["hospital-3 round 1: did not reveal its box to tallier-2 within 30 s"]
    assert "hospital-3" in report["expelled"] and second["voters"] == ["hospital-1", "hospital-2"]
    assert all("deviated" not in federation.log(name) for name in federation.roster.talliers)
