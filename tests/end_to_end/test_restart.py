"""Restarts, as they happen: a server killed mid-run resumes, a hospital killed mid-run rejoins, and
every hospital killed at once comes back and the run goes on (no key outlives its round).

Real server and hospital processes; SIGKILL, so nothing gets to clean up. Each step waits for
something a process printed, never for a guess at timing.
"""

import json
import os
import signal

import pytest

from scripted import HospitalProcess, ServerProcess
from consilium.training.privacy.accounting import VIEWS

pytestmark = pytest.mark.slow
ROUNDS = 8


def _federation(tmp_path, *, quorum: int, send_offset: str) -> tuple[ServerProcess, list[HospitalProcess]]:
    server = ServerProcess(tmp_path, 3, "--rounds", str(ROUNDS), "--quorum", str(quorum), "--round-timeout", "60")
    hospitals = [
        HospitalProcess(
            server.federation,
            f"hospital-{i}",
            i,
            3,
            tmp_path / f"hospital-{i}.log",
            "--epsilon-budget",
            "100",
            "--send-offset",
            send_offset,
        )
        for i in (1, 2, 3)
    ]
    return server, hospitals


def _round_line(number: int) -> str:
    return f"round {number:>4}/{ROUNDS}"


def _charged_rounds(hospital: HospitalProcess) -> list[int]:
    """The rounds a hospital's ledger charged, in the order it charged them."""
    lines = [json.loads(line) for line in (hospital.state / "privacy_ledger.jsonl").read_text().splitlines()]
    return [line["round"] for line in lines if "key" in line]


def _finish(server: ServerProcess, hospitals: list[HospitalProcess]) -> dict:
    report = server.finish()
    for hospital in hospitals:
        assert hospital.process.wait(timeout=60) == 0, hospital.log.read_text()
        assert "Traceback" not in hospital.log.read_text()
    assert "Traceback" not in server.log.read_text()
    return report


def test_a_server_killed_mid_run_resumes_and_no_hospitals_epsilon_goes_down(tmp_path):
    server, hospitals = _federation(tmp_path, quorum=3, send_offset="0.2")
    try:
        server.wait_for_log(_round_line(2))
        server.restart()  # SIGKILL, then --resume on the same --out
        spent_at_kill = {h.name: h.ledger().epsilons(1e-5) for h in hospitals}
        server.wait_for_log("resuming run")
        report = _finish(server, hospitals)
    finally:
        for process in (server, *hospitals):
            process.kill()

    rounds = report["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))  # no round number used twice
    interrupted = [r for r in rounds if r["status"] != "released"]
    assert len(interrupted) <= 1 and all(r["reason"].startswith("interrupted") for r in interrupted)
    assert rounds[-1]["status"] == "released" and report["resumed"]
    # Joining the resumed server broke nothing of the hospitals' doing: no join counts towards the cap.
    assert {j["hospital"] for j in report["joins"]} == {h.name for h in hospitals}
    assert not any(join["broke_round"] for join in report["joins"])
    assert report["final"]["rounds_released"] == ROUNDS - len(interrupted)
    released = {r["round"] for r in rounds if r["status"] == "released"}
    for hospital in hospitals:
        charged = _charged_rounds(hospital)
        assert charged == sorted(set(charged)) and released <= set(charged)  # each round charged once, none skipped
        after = hospital.ledger().epsilons(1e-5)
        assert all(after[view] >= spent_at_kill[hospital.name][view] for view in VIEWS)
        assert "joining again" in hospital.log.read_text()


def test_a_hospital_killed_mid_run_rejoins_with_its_ledger_continuous(tmp_path):
    """hospital-1 is killed and started again: it makes a box key for the next round, and that is all it needs."""
    server, hospitals = _federation(tmp_path, quorum=3, send_offset="0")
    first, *others = hospitals
    try:
        server.wait_for_log(_round_line(2))
        for hospital in others:  # hold the run in the round under way until hospital-1 is back
            os.kill(hospital.process.pid, signal.SIGSTOP)
        first.kill()  # SIGKILL; its ledger is read only once it can no longer change
        steps_before, spent_before = first.ledger().steps, first.ledger().epsilons(1e-5)
        charged_before = _charged_rounds(first)
        first.start_again()
        server.wait_for_log("hospital-1 connected again")
        for hospital in others:
            os.kill(hospital.process.pid, signal.SIGCONT)
        report = _finish(server, hospitals)
    finally:
        for process in (server, *hospitals):
            process.kill()

    [join] = report["joins"]
    assert join["hospital"] == "hospital-1" and join["before_round"] <= ROUNDS
    after_join = [r for r in report["rounds"] if r["round"] >= join["before_round"]]
    assert after_join and all(r["status"] == "released" and "hospital-1" in r["contributors"] for r in after_join)
    charged = _charged_rounds(first)
    assert charged[: len(charged_before)] == charged_before and charged == sorted(set(charged))
    assert set(charged[len(charged_before) :]) == {r["round"] for r in after_join}
    ledger = first.ledger()
    assert ledger.steps == steps_before + len(after_join)
    assert all(ledger.epsilons(1e-5)[view] > spent_before[view] for view in VIEWS)
    assert (first.state / "privacy_ledger.jsonl").read_text().count('"fingerprint"') == 1  # the run was begun once
    run_id = report["config"]["run_id"]
    metrics = json.loads((first.state / f"metrics-{run_id}.json").read_text())
    recorded = [r["round"] for r in metrics["rounds"]]
    assert metrics["joins"] == 1 and recorded == [r["round"] for r in after_join]  # the killed process wrote none


def test_every_hospital_killed_at_once_comes_back_and_the_run_reaches_its_last_round(tmp_path):
    """No key lives longer than its round, so nothing is lost when every hospital restarts: the round
    in flight is aborted, each rejoins with a box key for the next, and every later round is released."""
    server, hospitals = _federation(tmp_path, quorum=3, send_offset="0")
    try:
        server.wait_for_log(_round_line(2))
        for hospital in hospitals:
            hospital.kill()  # SIGKILL, all three
        charged_before = {hospital.name: _charged_rounds(hospital) for hospital in hospitals}
        for hospital in hospitals:
            hospital.start_again()
        report = _finish(server, hospitals)
    finally:
        for process in (server, *hospitals):
            process.kill()

    rounds = report["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    assert {join["hospital"] for join in report["joins"]} == {h.name for h in hospitals}
    back = max(join["before_round"] for join in report["joins"])
    after = [r for r in rounds if r["round"] >= back]
    assert after and all(r["status"] == "released" and len(r["contributors"]) == 3 for r in after)
    assert rounds[-1]["status"] == "released"
    for hospital in hospitals:
        charged = _charged_rounds(hospital)
        before = charged_before[hospital.name]
        assert charged[: len(before)] == before and charged == sorted(set(charged))  # no round charged twice
        assert (hospital.state / "privacy_ledger.jsonl").read_text().count('"fingerprint"') == 1


def test_a_hospital_away_past_its_round_comes_back_within_the_rejoin_window_and_the_run_completes(tmp_path):
    """Every hospital is needed for a round (the default quorum). hospital-1 is killed and stays away past
    its round's deadline: that round is lost, the run waits between rounds for hospital-1 to come back
    (--rejoin-window), and once it is started again every later round is released with it."""
    server = ServerProcess(
        tmp_path, 3, "--rounds", "4", "--quorum", "3", "--round-timeout", "5", "--rejoin-window", "120"
    )
    hospitals = [
        HospitalProcess(
            server.federation, f"hospital-{i}", i, 3, tmp_path / f"hospital-{i}.log", "--epsilon-budget", "100"
        )
        for i in (1, 2, 3)
    ]
    first = hospitals[0]
    try:
        server.wait_for_log("round    1/4")
        first.kill()
        server.wait_for_log("waiting up to 120 s for hospital-1 to come back")
        first.start_again()
        report = _finish(server, hospitals)
    finally:
        for process in (server, *hospitals):
            process.kill()

    assert report["finish_reason"] == "completed all rounds"
    lost = [r for r in report["rounds"] if r["status"] != "released"]
    assert len(lost) == 1 and lost[0]["round"] >= 2, report["rounds"]
    later = [r for r in report["rounds"] if r["round"] > lost[0]["round"]]
    assert later and all(r["status"] == "released" and "hospital-1" in r["contributors"] for r in later)
    assert [j["hospital"] for j in report["joins"]] == ["hospital-1"]
