"""A real server process against scripted hospitals: bad input is rejected and changes nothing."""

import dataclasses
import json
import signal

import msgpack
import numpy as np
import pytest
import zmq

from consilium.protocol.wire.messages import (
    PROTOCOL_VERSION,
    Aggregate,
    Endorsement,
    Endorsements,
    Finish,
    Hello,
    Proofs,
    Refused,
    RoundAbort,
    RoundStart,
    Releases,
    Update,
    Withdraw,
)

from consilium.protocol.wire.codec import encode
from consilium.protocol.identity.party_keys import CurveKeyPair
from consilium.protocol.wire.transport import ClientTransport
from scripted import ScriptedHospital, ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture
def server(request, tmp_path):
    hospitals, *args = request.param
    process = ServerProcess(tmp_path, hospitals, *args)
    yield process
    process.close()


def _join(hospitals) -> None:
    for hospital in hospitals:
        hospital.send(Hello())
    for hospital in hospitals:
        hospital.welcome()


def _uploads(hospitals, round_number: int) -> dict:
    """Each hospital's honest update for the round the server starts (not sent), and its values."""
    updates, values = {}, {}
    for seed, hospital in enumerate(hospitals, start=1):
        start = hospital.expect(RoundStart)
        assert start.round == round_number
        values[hospital.name] = hospital.random_update(seed)
        updates[hospital.name] = hospital.upload(start, values[hospital.name])
    return updates, values


def _proofs_relayed(hospitals) -> dict:
    """After the uploads: endorse and prove, each hospital honestly; returns the Proofs each was relayed."""
    aggregates = {h.name: h.expect(Aggregate) for h in hospitals}
    for hospital in hospitals:
        hospital.send(hospital.endorse(aggregates[hospital.name]))
    endorsements = {h.name: h.expect(Endorsements) for h in hospitals}
    for hospital in hospitals:
        hospital.send(hospital.prove(endorsements[hospital.name]))
    return {h.name: h.expect(Proofs) for h in hospitals}


def _rest_of_round(hospitals) -> dict:
    """After the uploads: endorse, prove, release and open, each hospital honestly; returns the sums opened."""
    proofs = _proofs_relayed(hospitals)
    for hospital in hospitals:
        hospital.send(hospital.release(proofs[hospital.name]))
    releases = {h.name: h.expect(Releases) for h in hospitals}
    for hospital in hospitals:
        hospital.send(hospital.confirm(releases[hospital.name]))
    return {h.name: h.opened[releases[h.name].round] for h in hospitals}


@pytest.mark.parametrize(
    "server", [(3, "--rounds", "2", "--round-timeout", "30", "--log-level", "info")], indirect=True
)
def test_bad_messages_are_rejected_and_the_sum_stays_exact(server):
    h1, h2, h3 = (ScriptedHospital(server, f"hospital-{i}") for i in (1, 2, 3))
    h1.send_raw(b"\xc1 not msgpack")  # rejected 1
    h2.send(Hello())
    h2.send(Hello())  # said again, as on a reconnection: not a rejection, and no warning
    # Only then may the others join: the join phase must still be open when the repeat arrives.
    server.wait_for_log("hospital-2 said Hello again while the run gathers its hospitals")
    for hospital in (h1, h3):
        hospital.send(Hello())
    config = h1.welcome()
    h2.welcome()
    h3.welcome()
    assert config.hospitals == ("hospital-1", "hospital-2", "hospital-3") and config.key_threshold == 2

    updates, values = _uploads((h1, h2, h3), 1)
    good = updates["hospital-1"]
    h1.send(Update(round=2, chunks=good.chunks, boxes=good.boxes, next_box_key=good.next_box_key))  # rejected 3
    h1.send(
        Update(round=1, chunks=good.chunks + good.chunks, boxes=good.boxes, next_box_key=b"")
    )  # 4: shares for others
    h1.send(Update(round=1, chunks=good.chunks, boxes={"hospital-1": b"box"}, next_box_key=b""))  # 5: shares missing
    forged = dict(good.boxes, **{"hospital-2": good.boxes["hospital-3"]})  # a share sealed to another hospital
    h1.send(Update(round=1, chunks=good.chunks, boxes=forged, next_box_key=good.next_box_key))  # 5b: does not verify
    h1.send_raw(b"\x00" * (config.message_limit() + 1))  # rejected 6: oversized
    h1.send_raw(
        msgpack.packb({"v": PROTOCOL_VERSION, "type": "update", "round": 1, "chunks": list(good.chunks), "sender": "x"})
    )  # 7
    intruder = ClientTransport(
        server.roster.server_address, server.roster.server.curve_public, CurveKeyPair(*zmq.curve_keypair()), 1 << 24
    )
    intruder.send(encode(good))  # refused at the handshake: never counted
    h1.send(good)
    h1.send(good)  # rejected 8: a replay
    h2.send(updates["hospital-2"])
    h3.send(updates["hospital-3"])

    aggregates = {h.name: h.expect(Aggregate) for h in (h1, h2, h3)}
    assert aggregates["hospital-1"].contributors == ("hospital-1", "hospital-2", "hospital-3")
    h1.send(h1.endorse(aggregates["hospital-1"]))
    h1.send(Endorsement(round=1, hashes=(1,), commitment=b"c" * 32, signature=b"\x00" * 64))  # 9: a second
    server.wait_for_log("expected nothing more from hospital-1")  # before the others can close the collection
    forged = h2.endorse(aggregates["hospital-2"])
    h2.send(Endorsement(round=1, hashes=forged.hashes, commitment=forged.commitment, signature=b"\x00" * 64))  # 10
    h2.send(forged)
    h3.send(h3.endorse(aggregates["hospital-3"]))
    endorsements = {h.name: h.expect(Endorsements) for h in (h1, h2, h3)}
    for hospital in (h1, h2, h3):
        hospital.send(hospital.prove(endorsements[hospital.name]))
    proofs = {h.name: h.expect(Proofs) for h in (h1, h2, h3)}
    for hospital in (h1, h2, h3):
        hospital.send(hospital.release(proofs[hospital.name]))
    releases = {h.name: h.expect(Releases) for h in (h1, h2, h3)}
    expected = sum(values.values())
    for hospital in (h1, h2, h3):
        hospital.send(hospital.confirm(releases[hospital.name]))
        assert np.array_equal(hospital.opened[1], expected)

    for hospital in (h1, h2, h3):
        assert hospital.expect(RoundStart).round == 2
        hospital.send(Withdraw(round=2, reason="test over"))
    report = server.finish()
    intruder.close()
    assert report["rejected_messages"] == 10
    assert [r["status"] for r in report["rounds"]] == ["released", "aborted"]
    assert "fewer than the quorum" in report["finish_reason"]
    log = server.log.read_text()
    for reason in (
        "not a msgpack",
        "exceeds the limit",
        "round 2 during round 1",
        "shares sealed to",
        "the share hospital-1 sealed to hospital-2 does not verify",
        "unenrolled CurveZMQ key",
        "expected fields",
        "expected nothing more from hospital-1",
        "hospital-2's endorsement is not its signature",
    ):
        assert reason in log, reason
    # The replay lands during the round (a second update) or after it closed (not an endorsement).
    assert "second update" in log or "expected its endorsement for round 1" in log
    assert "Traceback" not in log


@pytest.mark.parametrize(
    "server", [(5, "--rounds", "3", "--quorum", "4", "--round-timeout", "4", "--rejoin-window", "0")], indirect=True
)
def test_a_vanished_hospital_is_dropped_and_a_round_below_quorum_is_never_opened(server):
    hospitals = [ScriptedHospital(server, f"hospital-{i}") for i in range(1, 6)]
    present, vanished = hospitals[:4], hospitals[4]
    _join(hospitals)
    updates, values = _uploads(hospitals, 1)
    for hospital in present:
        hospital.send(updates[hospital.name])
    # hospital-5 says nothing: after the round deadline it is dropped and the others' sum goes ahead.
    assert "sent no update" in vanished.expect(Finish, timeout=30).reason
    totals = _rest_of_round(present)
    expected = sum(values[h.name] for h in present)
    assert all(np.array_equal(total, expected) for total in totals.values())

    starts = {hospital.name: hospital.expect(RoundStart) for hospital in present}
    present[1].send(Withdraw(round=2, reason="budget"))
    for seed, hospital in enumerate((present[0], present[2], present[3])):
        hospital.send(hospital.upload(starts[hospital.name], hospital.random_update(seed)))
    abort = present[0].expect(RoundAbort)  # three contributions, quorum four: the sum is never opened
    assert abort.round == 2 and "fewer than the quorum" in abort.reason
    report = server.finish()
    first, second = report["rounds"]
    assert first["status"] == "released" and first["contributors"] == [h.name for h in present]
    assert 0 < first["epsilon"]["server"] < first["epsilon"]["peer_hospital"]
    assert second["status"] == "aborted" and second["validation_accuracy"] is None
    for hospital in hospitals:
        hospital.close()


@pytest.mark.parametrize("server", [(5, "--rounds", "2", "--quorum", "4", "--round-timeout", "60")], indirect=True)
def test_a_hospital_that_refuses_a_round_start_is_left_out_at_once_and_leaves_with_no_box_key(server):
    """hospital-5 refuses round 1's RoundStart (as it would box keys that do not check): the server
    opens the others' sum without waiting for it, and at round 2, for which it holds no box key
    (it travels in the upload), hospital-5 leaves the run, told why."""
    hospitals = [ScriptedHospital(server, f"hospital-{i}") for i in range(1, 6)]
    present, refuser = hospitals[:4], hospitals[4]
    _join(hospitals)
    updates, values = _uploads(present, 1)
    assert refuser.expect(RoundStart).round == 1
    refuser.send(Refused(round=1, reason="a box key does not check", named=("server",), openings={}))
    for hospital in present:
        hospital.send(updates[hospital.name])
    totals = _rest_of_round(present)
    assert all(np.array_equal(total, sum(values[h.name] for h in present)) for total in totals.values())
    assert "holds no box key for round 2" in refuser.expect(Finish).reason
    updates, _ = _uploads(present, 2)
    for hospital in present:
        hospital.send(updates[hospital.name])
    _rest_of_round(present)
    report = server.finish()
    assert [r["status"] for r in report["rounds"]] == ["released", "released"]
    assert "refuses round 1 before its upload: a box key does not check" in server.log.read_text()
    for hospital in hospitals:
        hospital.close()


@pytest.mark.parametrize("server", [(5, "--rounds", "1", "--quorum", "4", "--round-timeout", "60")], indirect=True)
def test_a_hospital_that_joins_again_after_its_upload_leaves_the_sum_to_the_others(server):
    """hospital-5 uploads, then says Hello again: the four others still meet the quorum, so their
    sum is opened without its upload, and hospital-5 is welcomed again."""
    hospitals = [ScriptedHospital(server, f"hospital-{i}") for i in range(1, 6)]
    present, rejoining = hospitals[:4], hospitals[4]
    _join(hospitals)
    updates, values = _uploads(hospitals, 1)
    rejoining.send(updates[rejoining.name])
    rejoining.send(Hello())
    server.wait_for_log("hospital-5 connected again")
    for hospital in present:
        hospital.send(updates[hospital.name])
    totals = _rest_of_round(present)
    assert all(np.array_equal(total, sum(values[h.name] for h in present)) for total in totals.values())
    report = server.finish()
    [released] = report["rounds"]
    assert released["status"] == "released" and released["contributors"] == [h.name for h in present]
    for hospital in hospitals:
        hospital.close()


@pytest.mark.parametrize("server", [(3, "--rounds", "2", "--round-timeout", "30")], indirect=True)
def test_the_server_charges_a_round_before_it_relays_the_proofs(server):
    """Once the proofs are relayed members release, and any tau releases open the sum: the server's
    ledger has the round before that, even where a member then refuses (review 4, finding 12)."""
    hospitals = h1, h2, h3 = [ScriptedHospital(server, f"hospital-{i}") for i in (1, 2, 3)]
    _join(hospitals)
    updates, _ = _uploads(hospitals, 1)
    for hospital in hospitals:
        hospital.send(updates[hospital.name])
    proofs = _proofs_relayed(hospitals)
    h1.send(Refused(round=1, reason="I say so", named=(), openings={}))
    for hospital in (h2, h3):
        hospital.send(hospital.release(proofs[hospital.name]))
    for hospital in hospitals:
        assert hospital.expect(RoundAbort).round == 1
    for hospital in hospitals:  # round 2 begins; end the run here
        hospital.expect(RoundStart)
        hospital.send(Withdraw(round=2, reason="test over"))
    report = server.finish()
    assert [r["status"] for r in report["rounds"]] == ["aborted"] * len(report["rounds"])
    assert report["final"]["rounds_released"] == 0 and report["final"]["epsilon"]["server"] > 0
    for hospital in hospitals:
        hospital.close()


@pytest.mark.parametrize("server", [(3, "--rounds", "2", "--round-timeout", "30")], indirect=True)
def test_a_member_that_applied_another_mean_leaves_the_run(server):
    """hospital-1 confirms a mean other than the sum's: its model has left the run's, so it is told to
    leave at once, and the two left are fewer than the quorum (review 4, finding 10)."""
    hospitals = h1, h2, h3 = [ScriptedHospital(server, f"hospital-{i}") for i in (1, 2, 3)]
    _join(hospitals)
    updates, _ = _uploads(hospitals, 1)
    for hospital in hospitals:
        hospital.send(updates[hospital.name])
    proofs = _proofs_relayed(hospitals)
    for hospital in hospitals:
        hospital.send(hospital.release(proofs[hospital.name]))
    releases = {h.name: h.expect(Releases) for h in hospitals}
    confirmation = h1.confirm(releases["hospital-1"])
    h1.send(dataclasses.replace(confirmation, digest=bytes(len(confirmation.digest))))
    for hospital in (h2, h3):
        hospital.send(hospital.confirm(releases[hospital.name]))
    assert "applied another mean than the sum's" in h1.expect(Finish).reason
    report = server.finish()
    assert [r["status"] for r in report["rounds"]] == ["released"]
    assert "applied another mean" in report["departures"]["hospital-1"]
    for hospital in hospitals:
        hospital.close()


@pytest.mark.parametrize("server", [(5, "--rounds", "2", "--quorum", "4", "--round-timeout", "30")], indirect=True)
def test_a_member_that_signs_a_wrong_release_leaves_the_run_and_the_others_go_on(server):
    """hospital-5 signs a release off its dealers' proofs: the server catches it as it arrives, names
    it and expels it (review 5, finding 3), so that connecting again does not bring it back; the round
    aborts, and the next opens without it."""
    hospitals = [ScriptedHospital(server, f"hospital-{i}") for i in range(1, 6)]
    present, cheat = hospitals[:4], hospitals[4]
    _join(hospitals)
    updates, _ = _uploads(hospitals, 1)
    for hospital in hospitals:
        hospital.send(updates[hospital.name])
    proofs = _proofs_relayed(hospitals)
    cheat.send(cheat.wrong_release(proofs[cheat.name]))
    assert "hospital-5 released wrong values, which it signed" in cheat.expect(Finish).reason
    cheat.send(Hello())  # saying Hello again does not bring it back (Participants.expel)
    assert "hospital-5 left this run" in cheat.expect(Finish).reason
    for hospital in present:
        hospital.send(hospital.release(proofs[hospital.name]))
    for hospital in present:
        assert hospital.expect(RoundAbort).round == 1
    updates, values = _uploads(present, 2)
    for hospital in present:
        hospital.send(updates[hospital.name])
    totals = _rest_of_round(present)
    assert all(np.array_equal(total, sum(values[h.name] for h in present)) for total in totals.values())
    report = server.finish()
    assert [r["status"] for r in report["rounds"]] == ["aborted", "released"]
    for hospital in hospitals:
        hospital.close()


@pytest.mark.parametrize(
    ("server", "joined"),
    [
        ((3, "--rounds", "2", "--round-timeout", "30"), 3),
        ((6, "--rounds", "2", "--round-timeout", "30", "--quorum", "5", "--join-timeout", "5"), 5),
    ],
    indirect=["server"],
    ids=["3-of-3-join", "5-of-6-join"],
)
def test_a_dealer_that_tau_hospitals_name_with_its_boxes_keys_leaves_the_run(server, joined):
    """Boxes that are signed but do not decrypt cannot be proven either way; a dealer that tau hospitals
    name so in one round leaves the run, as one of them told the truth (review 5, finding 2). Tau is the
    joined hospitals' (3 of 5), not the roster's (4 of 6), when some never join."""
    hospitals = [ScriptedHospital(server, f"hospital-{i}") for i in range(1, joined + 1)]
    *others, dealer = hospitals
    tau = joined // 2 + 1
    _join(hospitals)
    updates, _ = _uploads(hospitals, 1)
    for hospital in hospitals:
        hospital.send(updates[hospital.name])
    aggregates = {h.name: h.expect(Aggregate) for h in hospitals}
    for accuser in others[:tau]:
        accuser.send(
            Refused(
                round=1,
                reason="signed a share that does not open",
                named=(dealer.name,),
                openings={dealer.name: bytes(32)},
            )
        )
    for hospital in [*others[tau:], dealer]:
        hospital.send(hospital.endorse(aggregates[hospital.name]))
    for hospital in hospitals:
        assert hospital.expect(RoundAbort).round == 1
    assert f"{tau} hospitals name it as a dealer" in dealer.expect(Finish).reason
    report = server.finish()
    assert f"named, unverified: {dealer.name}" in report["rounds"][0]["reason"]
    assert set(report["departures"]) == {dealer.name}
    for hospital in hospitals:
        hospital.close()


@pytest.mark.parametrize("server", [(3, "--rounds", "3", "--round-timeout", "30")], indirect=True)
def test_a_lone_accuser_and_its_dealer_leave_together_after_two_disputes(server):
    """One hospital names a dealer, showing a box's key that convicts nobody, two rounds running:
    neither side can be proven, so both leave (a liar costs the run itself and one other)."""
    hospitals = h1, h2, h3 = [ScriptedHospital(server, f"hospital-{i}") for i in (1, 2, 3)]
    _join(hospitals)
    for round_number in (1, 2):
        updates, _ = _uploads(hospitals, round_number)
        for hospital in hospitals:
            hospital.send(updates[hospital.name])
        aggregates = {h.name: h.expect(Aggregate) for h in hospitals}
        h1.send(Refused(round=round_number, reason="no", named=("hospital-3",), openings={"hospital-3": bytes(32)}))
        for hospital in (h2, h3):
            hospital.send(hospital.endorse(aggregates[hospital.name]))
        for hospital in hospitals:
            assert hospital.expect(RoundAbort).round == round_number
    for hospital in (h1, h3):
        assert "in dispute with" in hospital.expect(Finish).reason
    report = server.finish()
    assert set(report["departures"]) == {"hospital-1", "hospital-3"}
    for hospital in hospitals:
        hospital.close()


@pytest.mark.parametrize("server", [(3, "--rounds", "2")], indirect=True)
def test_a_run_stopped_by_an_unexpected_error_says_so(server):
    """Interrupted mid-join: the report and the Finish name the interruption, not a completed run."""
    h1 = ScriptedHospital(server, "hospital-1")
    try:
        h1.send(Hello())
        h1.send_raw(b"\xc1")  # logged as rejected once the hello before it has been taken: the join is under way
        server.wait_for_log("rejected a message from hospital-1")
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=60) == 130
        reason = json.loads((server.out / "server_report.json").read_text())["finish_reason"]
        assert reason.startswith("stopped by an unexpected KeyboardInterrupt")
        assert h1.expect(Finish).reason == reason
    finally:
        h1.close()


@pytest.mark.parametrize("server", [(5, "--rounds", "1", "--quorum", "4", "--join-timeout", "5")], indirect=True)
def test_a_flood_is_dropped_over_the_rate_and_logged_boundedly(server):
    """6,000 junk messages from hospital-5: most dropped unread, a few log lines, and the others' round is exact."""
    hospitals = [ScriptedHospital(server, f"hospital-{i}") for i in (1, 2, 3, 4, 5)]
    flooder = hospitals[4]
    # The others join first: on a loaded machine the flood can outlast the 5 s join, and a join
    # with nobody in it ends the run. The flooder waits as long as the server takes to drain it.
    for hospital in hospitals[:4]:
        hospital.send(Hello())
    flooder.transport._socket.setsockopt(zmq.SNDTIMEO, 120_000)
    for _ in range(5000):
        flooder.send_raw(b"\xc1")
    for _ in range(1000):
        flooder.transport._socket.send_multipart([b"two", b"frames"])  # never a message: dropped, not logged each
    server.wait_for_log("dropping messages from hospital-5")
    for hospital in hospitals[:4]:
        assert hospital.welcome().hospitals == (
            "hospital-1",
            "hospital-2",
            "hospital-3",
            "hospital-4",
        )  # once the join times out
    updates, values = _uploads(hospitals[:4], 1)
    for hospital in hospitals[:4]:
        hospital.send(updates[hospital.name])
    totals = _rest_of_round(hospitals[:4])
    assert all(np.array_equal(total, sum(values.values())) for total in totals.values())
    report = server.finish()
    dropped = report["dropped_messages_over_rate"]["hospital-5"]
    assert dropped > 3000 and report["rejected_messages"] + dropped == 6000
    lines = [line for line in server.log.read_text().splitlines() if "hospital-5" in line]
    assert len(lines) < 40, len(lines)
    for hospital in hospitals:
        hospital.close()


@pytest.mark.parametrize("server", [(3, "--rounds", "2", "--quorum", "3", "--round-timeout", "30")], indirect=True)
def test_a_hospital_that_joins_again_mid_round_costs_that_round_only(server):
    """hospital-1 says Hello again after the endorsements: the round aborts, it is welcomed again with a
    box key for round 2, and round 2 is released with all three."""
    hospitals = h1, h2, h3 = [ScriptedHospital(server, f"hospital-{i}") for i in (1, 2, 3)]
    _join(hospitals)
    updates, _ = _uploads(hospitals, 1)
    for hospital in hospitals:
        hospital.send(updates[hospital.name])
    aggregates = {h.name: h.expect(Aggregate) for h in hospitals}
    for hospital in hospitals:
        hospital.send(hospital.endorse(aggregates[hospital.name]))
    endorsements = {h.name: h.expect(Endorsements) for h in hospitals}
    h1.send(Hello())  # restarted before it proved anything
    for hospital in (h2, h3):  # as honest hospitals do, not knowing: the step still weighs what they send
        hospital.send(hospital.prove(endorsements[hospital.name]))
    h1.welcome()
    for hospital in (h2, h3):
        assert hospital.expect(RoundAbort).round == 1
    updates, values = _uploads(hospitals, 2)
    for hospital in hospitals:
        hospital.send(updates[hospital.name])
    _rest_of_round(hospitals)
    report = server.finish()
    assert [r["status"] for r in report["rounds"]] == ["aborted", "released"]
    assert report["joins"] == [{"hospital": "hospital-1", "before_round": 2, "broke_round": True}]
    assert "Traceback" not in server.log.read_text()
    for hospital in hospitals:
        hospital.close()


@pytest.mark.parametrize("server", [(3, "--rounds", "4", "--round-timeout", "30")], indirect=True)
def test_a_hospital_that_refuses_rounds_without_evidence_leaves_the_run(server):
    """The server checked everything it relayed, so a refusal it cannot verify is its refuser's word alone:
    after two such, the refuser leaves the run (one hospital cannot abort every round)."""
    hospitals = h1, h2, h3 = [ScriptedHospital(server, f"hospital-{i}") for i in (1, 2, 3)]
    _join(hospitals)
    for round_number in (1, 2):
        updates, _ = _uploads(hospitals, round_number)
        for hospital in hospitals:
            hospital.send(updates[hospital.name])
        aggregates = {h.name: h.expect(Aggregate) for h in hospitals}
        h1.send(Refused(round=round_number, reason="I say so", named=("hospital-2",), openings={}))
        for hospital in (h2, h3):
            hospital.send(hospital.endorse(aggregates[hospital.name]))
        for hospital in hospitals:
            assert hospital.expect(RoundAbort).round == round_number
    assert "refused 2 rounds without evidence" in h1.expect(Finish).reason
    report = server.finish()
    assert [r["status"] for r in report["rounds"]] == ["aborted", "aborted"]
    assert "without evidence" in report["departures"]["hospital-1"]
    for hospital in hospitals:
        hospital.close()
