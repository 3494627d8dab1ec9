"""A real server process against scripted hospitals: bad input is rejected and changes nothing."""

import json
import signal

import msgpack
import numpy as np
import pytest
import zmq

from crypto.bfv import SecretContext
from crypto.bfv_parameters import select_bfv_parameters
from protocol.messages import (
    Aggregate,
    Endorsement,
    Endorsements,
    Finish,
    Hello,
    KeyReady,
    KeySetup,
    MeanRequest,
    Released,
    RoundAbort,
    RoundStart,
    Update,
    Withdraw,
    encode,
    release_digest,
)
from protocol.party_keys import CurveKeyPair
from protocol.transport import ClientTransport
from scripted import ScriptedHospital, ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture
def server(request, tmp_path):
    hospitals, *args = request.param
    process = ServerProcess(tmp_path, hospitals, *args)
    yield process
    process.close()


@pytest.mark.parametrize("server", [(2, "--rounds", "2", "--round-timeout", "30")], indirect=True)
def test_bad_messages_are_rejected_and_the_sum_stays_exact(server):
    h1, h2 = ScriptedHospital(server, "hospital-1"), ScriptedHospital(server, "hospital-2")
    h1.send_raw(b"\xc1 not msgpack")  # rejected 1
    h2.send(Hello())
    h2.send(Hello())  # rejected 2: joined already
    # Only then may hospital-1 join: the join phase must still be open when the repeat arrives.
    server.wait_for_log("already joined")
    h1.send(Hello())
    config = h1.welcome()
    h2.welcome()
    assert config.hospitals == ("hospital-1", "hospital-2") and config.key_holder == "hospital-1"
    h2.send_run_key()

    setup = h1.key_setup()
    h2.send(setup)  # rejected 3: not the key holder
    h1.send(KeySetup(sealed_keys={"hospital-9": b"box"}))  # rejected 4: not the run's recipients
    h1.send(setup)
    h2.receive_key()

    assert h1.expect(RoundStart).round == 1 and h2.expect(RoundStart).round == 1
    x1, x2 = h1.random_update(1), h2.random_update(2)
    good = h1.secret.encrypt_update(x1, round_number=1, hospital="hospital-1")
    other_params = select_bfv_parameters(max_contributors=50, vector_length=len(x1), sum_bound=50_000)
    foreign = SecretContext.generate(other_params, run_id=config.run_id).encrypt_update(
        np.zeros(len(x1), dtype=np.int64), round_number=1, hospital="hospital-1"
    )
    h1.send(Update(round=2, chunks=tuple(good)))  # rejected 5: out of sequence
    h1.send(Update(round=1, chunks=tuple(foreign)))  # rejected 6: other parameters
    h1.send(Update(round=1, chunks=tuple(good + good)))  # rejected 7: wrong number of ciphertexts
    h1.send_raw(b"\x00" * (config.message_limit() + 1))  # rejected 8: oversized
    h1.send_raw(msgpack.packb({"v": 1, "type": "update", "round": 1, "chunks": good, "sender": "hospital-2"}))  # 9
    intruder = ClientTransport(
        server.roster.server_address, server.roster.server.curve_public, CurveKeyPair(*zmq.curve_keypair()), 1 << 24
    )
    intruder.send(encode(Update(round=1, chunks=tuple(good))))  # refused at the handshake: never counted
    h1.send(Update(round=1, chunks=tuple(good)))
    h1.send(Update(round=1, chunks=tuple(good)))  # rejected 10: a replay
    h2.send(Update(round=1, chunks=tuple(h2.secret.encrypt_update(x2, round_number=1, hospital="hospital-2"))))

    aggregate = h1.expect(Aggregate)
    assert h2.expect(Aggregate) == aggregate
    assert aggregate.contributors == ("hospital-1", "hospital-2")
    total = h1.secret.decrypt_sum(aggregate.chunks, round_number=1, contributors=aggregate.contributors)
    assert np.array_equal(total, x1 + x2)
    h1.endorse(aggregate)
    h1.endorse(aggregate)  # rejected 11: a second endorsement
    server.wait_for_log("second endorsement")  # before hospital-2's endorsement can close the collection
    h2.send(Endorsement(round=1, signature=b"\x00" * 64))  # rejected 12: not hospital-2's signature
    h2.endorse(aggregate)
    assert set(h1.expect(Endorsements).signatures) == {"hospital-1", "hospital-2"}
    h2.expect(Endorsements)
    mean = (total / 2).astype("<f4").tobytes()
    poisoned = np.full(len(x1), np.nan, dtype="<f4").tobytes()
    h1.send(Released(round=1, digest=release_digest(1, poisoned), mean_gradient=poisoned))  # rejected 13: NaN
    h1.send(Released(round=1, digest=release_digest(1, mean), mean_gradient=mean))
    h1.send(Released(round=1, digest=release_digest(1, mean), mean_gradient=mean))  # rejected 14: repeated
    h2.send(Released(round=1, digest=release_digest(1, mean), mean_gradient=b""))

    assert h1.expect(RoundStart).round == 2 and h2.expect(RoundStart).round == 2
    h1.send(Withdraw(round=2, reason="test over"))
    h2.send(Withdraw(round=2, reason="test over"))
    report = server.finish()
    intruder.close()
    assert report["rejected_messages"] == 14
    assert [r["status"] for r in report["rounds"]] == ["released", "aborted"]
    assert "fewer than the quorum" in report["finish_reason"]
    log = server.log.read_text()
    for reason in (
        "not a msgpack",
        "already joined",
        "exceeds the limit",
        "round 2 during round 1",
        "upload ciphertext 0 must be",
        "sealed keys are for",
        "unenrolled CurveZMQ key",
        "expected fields",
        "second endorsement",
        "hospital-2's endorsement is not its signature",
    ):
        assert reason in log, reason
    # The replay lands during the round (a second update) or after it closed (not an endorsement).
    assert "second update" in log or "expected an endorsement of the aggregate of round 1" in log
    assert "not 134 finite float32 values" in log
    assert "Traceback" not in log


@pytest.mark.parametrize("server", [(3, "--rounds", "3", "--quorum", "2", "--round-timeout", "4")], indirect=True)
def test_a_vanished_hospital_is_dropped_and_a_round_below_quorum_is_never_decrypted(server):
    hospitals = [ScriptedHospital(server, f"hospital-{i}") for i in (1, 2, 3)]
    h1, h2, h3 = hospitals
    for hospital in hospitals:
        hospital.send(Hello())
    for hospital in hospitals:
        hospital.welcome()
    h2.send_run_key()
    h3.send_run_key()
    h1.send(h1.key_setup())
    h2.receive_key()
    h3.receive_key()
    for hospital in hospitals:
        assert hospital.expect(RoundStart).round == 1
    x1, x2 = h1.random_update(1), h2.random_update(2)
    h1.send(Update(round=1, chunks=tuple(h1.secret.encrypt_update(x1, round_number=1, hospital="hospital-1"))))
    h2.send(Update(round=1, chunks=tuple(h2.secret.encrypt_update(x2, round_number=1, hospital="hospital-2"))))
    # hospital-3 says nothing: after the round deadline it is dropped and the others' sum goes ahead.
    assert "sent no update" in h3.expect(Finish, timeout=30).reason
    aggregate = h1.expect(Aggregate, timeout=30)
    assert aggregate.contributors == ("hospital-1", "hospital-2")
    total = h1.secret.decrypt_sum(aggregate.chunks, round_number=1, contributors=aggregate.contributors)
    h1.endorse(aggregate)
    h2.endorse(h2.expect(Aggregate))
    h1.expect(Endorsements)
    h2.expect(Endorsements)
    mean = (total / 2).astype("<f4").tobytes()
    h1.send(Released(round=1, digest=release_digest(1, mean), mean_gradient=mean))
    h2.send(Released(round=1, digest=release_digest(1, mean), mean_gradient=b""))

    assert h1.expect(RoundStart).round == 2 and h2.expect(RoundStart).round == 2
    h2.send(Withdraw(round=2, reason="budget"))
    h1.send(Update(round=2, chunks=tuple(h1.secret.encrypt_update(x1, round_number=2, hospital="hospital-1"))))
    abort = h1.expect(RoundAbort)  # one contribution, quorum two: no aggregate is ever sent
    assert abort.round == 2 and "fewer than the quorum" in abort.reason
    assert "fewer than the quorum" in h1.expect(Finish).reason
    report = server.finish()
    first, second = report["rounds"]
    assert first["status"] == "released" and first["contributors"] == ["hospital-1", "hospital-2"]
    assert 0 < first["epsilon"]["server"] < first["epsilon"]["peer_hospital"]
    assert second["status"] == "aborted" and second["validation_accuracy"] is None
    for hospital in hospitals:
        hospital.close()


@pytest.mark.parametrize("server", [(2, "--rounds", "2")], indirect=True)
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


@pytest.mark.parametrize("server", [(2, "--rounds", "1", "--quorum", "1", "--join-timeout", "5")], indirect=True)
def test_a_flood_is_dropped_over_the_rate_and_logged_boundedly(server):
    """6,000 junk messages from hospital-2: most dropped unread, a few log lines, and hospital-1's round is exact."""
    h1, h2 = ScriptedHospital(server, "hospital-1"), ScriptedHospital(server, "hospital-2")
    # hospital-1 joins first: on a loaded machine the flood can outlast the 5 s join, and a join
    # with nobody in it ends the run. The flooder waits as long as the server takes to drain it.
    h1.send(Hello())
    h2.transport._socket.setsockopt(zmq.SNDTIMEO, 120_000)
    for _ in range(5000):
        h2.send_raw(b"\xc1")
    for _ in range(1000):
        h2.transport._socket.send_multipart([b"two", b"frames"])  # never a message: dropped, not logged each
    server.wait_for_log("dropping messages from hospital-2")
    config = h1.welcome()  # once the join times out without hospital-2
    assert config.hospitals == ("hospital-1",)  # it holds the key it created: nobody needs it sealed
    assert h1.expect(RoundStart).round == 1
    x1 = h1.random_update(1)
    h1.send(Update(round=1, chunks=tuple(h1.secret.encrypt_update(x1, round_number=1, hospital="hospital-1"))))
    aggregate = h1.expect(Aggregate)
    assert np.array_equal(h1.secret.decrypt_sum(aggregate.chunks, round_number=1, contributors=["hospital-1"]), x1)
    h1.endorse(aggregate)
    h1.expect(Endorsements)
    mean = x1.astype("<f4").tobytes()
    h1.send(Released(round=1, digest=release_digest(1, mean), mean_gradient=mean))
    report = server.finish()
    dropped = report["dropped_messages_over_rate"]["hospital-2"]
    assert dropped > 3000 and report["rejected_messages"] + dropped == 6000
    lines = [line for line in server.log.read_text().splitlines() if "hospital-2" in line]
    assert len(lines) < 40, len(lines)
    for hospital in (h1, h2):
        hospital.close()


@pytest.mark.parametrize("server", [(2, "--rounds", "2", "--quorum", "2", "--round-timeout", "30")], indirect=True)
def test_a_releaser_that_joins_again_is_replaced_and_the_run_goes_on(server):
    """hospital-1, which sends the mean, says Hello again instead: hospital-2 is asked for it, then hospital-1 rejoins."""
    h1, h2 = ScriptedHospital(server, "hospital-1"), ScriptedHospital(server, "hospital-2")
    h1.send(Hello())
    h2.send(Hello())
    h1.welcome()
    h2.welcome()
    h2.send_run_key()
    h1.send(h1.key_setup())
    h2.receive_key()
    for hospital in (h1, h2):
        assert hospital.expect(RoundStart).round == 1
    updates = [h.random_update(seed) for h, seed in ((h1, 1), (h2, 2))]
    for hospital, update in zip((h1, h2), updates):
        hospital.send(
            Update(
                round=1, chunks=tuple(hospital.secret.encrypt_update(update, round_number=1, hospital=hospital.name))
            )
        )
    aggregates = [hospital.expect(Aggregate) for hospital in (h1, h2)]
    for hospital, aggregate in zip((h1, h2), aggregates):
        hospital.endorse(aggregate)
    for hospital in (h1, h2):
        hospital.expect(Endorsements)
    mean = (updates[0] + updates[1]).astype("<f4").tobytes()  # any agreed float32 vector of the right length
    h1.send(Hello())  # restarted before it released
    h2.send(Released(round=1, digest=release_digest(1, mean), mean_gradient=b""))
    assert h2.expect(MeanRequest).round == 1
    h2.send(Released(round=1, digest=release_digest(1, mean), mean_gradient=mean))
    h1.welcome()  # welcomed again before round 2, holding the key
    h1.send(KeyReady())
    assert h1.expect(RoundStart).round == 2 and h2.expect(RoundStart).round == 2
    for hospital in (h1, h2):
        hospital.send(Withdraw(round=2, reason="done"))
    report = server.finish()
    assert [r["status"] for r in report["rounds"]] == ["released", "aborted"]
    assert report["joins"] == [{"hospital": "hospital-1", "before_round": 2}]
    assert "Traceback" not in server.log.read_text()
    for hospital in (h1, h2):
        hospital.close()
