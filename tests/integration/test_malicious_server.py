"""A dishonest server, scripted message by message, against real hospital processes.

Whatever the server sends, a hospital releases its share of a sum's key only for the one sum every
contributor endorsed, whose hashes add up to the uploads it was made of, and its ledger never
counts less than it released (``docs/explanation/secure-round.md``).
"""

import dataclasses

import numpy as np
import pytest

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from consilium.crypto.one_time_keys import pack_ring, unpack_ring
from consilium.crypto.sealed_box import certify_key
from consilium.protocol.run.config import INSECURE_PLAINTEXT
from consilium.protocol.wire.codec import decode
from consilium.protocol.wire.messages import (
    TO_SERVER,
    BoxKey,
    Endorsement,
    Endorsements,
    Finish,
    Hello,
    Refused,
    RoundStart,
    Withdraw,
)
from consilium.protocol.secure_round.statement import box_key_context
from consilium.protocol.identity.party_keys import Credentials
from scripted import ScriptedServer
from consilium.training.methods.dp_fedavg import DpFedAvgSettings
from consilium.training.privacy.ledger import LEDGER_FILE

pytestmark = pytest.mark.slow

H1, H2, H3 = "hospital-1", "hospital-2", "hospital-3"
EVERYONE = (H1, H2, H3)


@pytest.fixture
def server(tmp_path):
    scripted = ScriptedServer(tmp_path, 3, quorum=3)
    yield scripted
    scripted.close()


def _refusal(server: ScriptedServer, name: str) -> str:
    stderr = server.wait_for_exit(name)
    assert "Traceback" not in stderr
    return stderr


def _drain(server: ScriptedServer) -> list:
    """What the hospitals sent after they stopped; each has exited, so it is all here."""
    received = []
    while (got := server.transport.receive(1.0)) is not None:
        received.append(got)
    return received


def _finish(server: ScriptedServer, names=EVERYONE) -> None:
    for name in names:
        server.send(name, Finish(reason="test over"))
    for name in names:
        assert server.hospitals[name].process.wait(timeout=60) == 0


def _honest_round(server: ScriptedServer, round_number: int) -> dict:
    """One round as an honest server runs it; returns what each hospital confirmed."""
    updates = server.start_round(round_number)
    for name, aggregate in server.aggregate(updates, round_number, EVERYONE).items():
        server.send(name, aggregate)
    return server.relay(round_number, EVERYONE)


def _send_all(server, message, names=EVERYONE) -> None:
    for name in names:
        server.send(name, message)


@pytest.mark.parametrize("change", ["shifted", "dropped", "doubled"])
def test_a_sum_the_server_changed_is_refused_before_any_release(server, change):
    """Plus Delta in one slot (it would open one higher there), an honest upload left out of a sum that
    lists it, or counted twice: every hospital endorses what it was sent, then finds the signed
    hashes do not add up to it, refuses naming the server, and releases nothing."""
    server.set_up()
    updates = server.start_round(1)
    params, q = server.public.params, server.public.params.ciphertext_modulus
    honest = unpack_ring(server.public, server.add(*updates.values()), "sum")
    h2 = unpack_ring(server.public, list(updates[H2].chunks), "upload")
    if change == "shifted":
        honest[0, 3] = (int(honest[0, 3]) + q // params.plain_modulus) % q
    elif change == "dropped":
        honest = ((honest.astype(object) - h2.astype(object)) % q).astype(np.uint64)
    else:
        honest = ((honest.astype(object) + h2.astype(object)) % q).astype(np.uint64)
    for name, aggregate in server.aggregate(updates, 1, EVERYONE, chunks=pack_ring(server.public, honest)).items():
        server.send(name, aggregate)
    endorsements = server.receive_from_each(Endorsement, EVERYONE)
    _send_all(server, Endorsements.of(1, endorsements))
    refusals = server.receive_from_each(Refused, EVERYONE)
    for refusal in refusals.values():
        assert "not the members' uploads" in refusal.reason and refusal.named == ("server",) and not refusal.openings
    _finish(server)
    assert _drain(server) == []  # no proof, no release
    for name in EVERYONE:
        assert server.ledger_epsilon(name) > 0  # the upload was charged before it left


def test_a_hospital_endorses_one_sum_a_round(server):
    """A second Aggregate of the round, after the first was endorsed, is refused: it is never signed."""
    server.set_up()
    updates = server.start_round(1)
    aggregates = server.aggregate(updates, 1, EVERYONE)
    for name, aggregate in aggregates.items():
        server.send(name, aggregate)
    server.receive_from_each(Endorsement, EVERYONE)
    server.send(H2, aggregates[H2])
    refusal = server.receive_from_each(Refused, (H2,))[H2]
    assert "out of order, or a second time" in refusal.reason
    _finish(server)
    assert _drain(server) == []


def test_a_round_start_with_a_box_key_not_its_owner_s_is_refused_before_any_charge(server):
    """The server lists hospital-3's certified key as hospital-2's: every hospital refuses the round
    naming the server, before it is charged or trains, and stays in the run (review 4, finding 8)."""
    server.set_up()
    forged = {**server.box_keys, H2: server.box_keys[H3]}
    _send_all(server, RoundStart(round=1, box_keys=forged))
    refusals = server.receive_from_each(Refused, EVERYONE)
    for name, refusal in refusals.items():
        assert refusal.named == ("server",) and "hospital-2's box key is not certified for this round" in refusal.reason
        assert server.ledger_epsilon(name) == 0
    _finish(server)  # each was still in the run: it exits cleanly when told the run is over
    assert _drain(server) == []


def test_a_box_key_certified_for_a_hospital_but_not_the_one_it_holds_is_refused(server):
    """A certificate in hospital-1's name for round 1 that is not the key hospital-1 holds (one it
    made before a restart, say; here one signed with its identity from disk): hospital-1 refuses
    the round before it is charged, rather than deal a share to a key nobody holds (review 4, finding 11)."""
    server.set_up()
    identity = Credentials.load(server.federation / H1).identity.signing
    stale = certify_key(
        X25519PrivateKey.generate().public_key(), signer=identity, context=box_key_context(server.run, H1, 1)
    )
    server.send(H1, RoundStart(round=1, box_keys={**server.box_keys, H1: stale}))
    refusal = server.receive_from_each(Refused, (H1,))[H1]
    assert refusal.named == ("server",) and "not the one it holds" in refusal.reason
    assert server.ledger_epsilon(H1) == 0
    _finish(server)


def test_a_replayed_round_and_a_reused_run_id_are_refused(tmp_path):
    server = ScriptedServer(tmp_path, 3, quorum=3)
    try:
        server.set_up()
        confirmed = _honest_round(server, 1)
        assert len({message.digest for message in confirmed.values()}) == 1  # every hospital applied the same mean
        for name in EVERYONE:
            server.send(name, RoundStart(round=1, box_keys=dict(server.round_box_keys)))
        for name in EVERYONE:
            assert "started round 1 again" in _refusal(server, name)
        assert _drain(server) == []  # no second upload for round 1: a key is never used for two uploads
        spent = {name: server.ledger_epsilon(name) for name in EVERYONE}
        assert all(epsilon > 0 for epsilon in spent.values())
        run_id = server.config.run_id
    finally:
        server.close()

    again = ScriptedServer(tmp_path, 3, quorum=3, run_id=run_id)
    try:
        again.join()
        for name in EVERYONE:
            assert f"run {run_id} is already in this privacy ledger" in _refusal(again, name)
        assert _drain(again) == []
        assert {name: again.ledger_epsilon(name) for name in EVERYONE} == spent
    finally:
        again.close()


def test_hospitals_given_different_settings_take_no_round(server):
    """Less noise for hospitals 2 and 3 than for hospital-1: their box keys are certified for another run,
    so hospital-1 seals them nothing, and refuses the round before it is charged."""
    config = server.config
    less_noise = dataclasses.replace(config, training=dataclasses.replace(config.training, noise_multiplier=0.3))
    server.receive_from_each(Hello, EVERYONE)
    server.send(H1, server.welcome(H1))
    for name in (H2, H3):
        server.send(name, server.welcome(name, less_noise))
    box_keys = {name: message.certified_key for name, message in server.receive_from_each(BoxKey, EVERYONE).items()}
    server.send(H1, RoundStart(round=1, box_keys=box_keys))
    assert "not certified for this round" in server.receive_from_each(Refused, (H1,))[H1].reason
    assert server.ledger_epsilon(H1) == 0
    _finish(server)
    assert _drain(server) == []


DP_FEDAVG = DpFedAvgSettings(
    noise_multiplier=1.0,
    max_update_norm=0.5,
    quorum=3,
    subclients=1,
    subclient_rule="fixed",
    max_subclients=1,
    local_epochs=1,
    local_batch_size=16,
    local_learning_rate=0.1,
    local_optimizer="sgd",
    server_optimizer="fedavg",
    server_learning_rate=1.0,
)


@pytest.mark.parametrize(
    "change, refusal",
    [
        (
            {"aggregation": INSECURE_PLAINTEXT},
            "uses 'insecure-plaintext-benchmark' aggregation; {name} was started for 'bfv'",
        ),
        ({"training": DP_FEDAVG}, "trains with 'dp-fedavg'; {name} was started for 'dopamine'"),
    ],
)
def test_a_server_cannot_switch_hospitals_to_plaintext_uploads_or_another_method(server, change, refusal):
    """A run announced in the benchmark's plaintext mode, or with another method than its operators chose
    (whose ledger entries would mean something else): hospitals leave before any round."""
    switched = dataclasses.replace(server.config, **change)
    server.receive_from_each(Hello, EVERYONE)
    for name in EVERYONE:
        server.send(name, server.welcome(name, switched))
    for name in EVERYONE:
        assert refusal.format(name=name) in _refusal(server, name)
    # No box key, no update: only the refusal, so that the server need not wait for them to come back,
    # and not why (a misfit's reason names facts of the hospital's data).
    said = [decode(payload, accept=TO_SERVER, max_bytes=1 << 16) for _, payload in _drain(server)]
    assert said == [Withdraw(round=0, reason="refuses the run it was welcomed to")] * len(EVERYONE)


def test_a_welcome_with_absurd_sizes_is_refused_in_one_line_before_anything_is_allocated(server):
    """Hidden layers of -1 units, and of 10^9 (2.9 GB of parameters were allocated before any check)."""
    server.receive_from_each(Hello, EVERYONE)
    for name, hidden in ((H1, [-1]), (H2, [10**9]), (H3, [-1])):
        config = server.config.to_dict()
        config["model"]["hidden"] = hidden
        server.send(name, dataclasses.replace(server.welcome(name), config=config))
    for name in EVERYONE:
        errors = [line for line in _refusal(server, name).splitlines() if line.startswith("error:")]
        assert (
            len(errors) == 1
            and "the server's run configuration is unusable" in errors[0]
            and "hidden layers" in errors[0]
        )


def test_a_welcome_whose_model_is_not_the_run_s_is_refused_before_the_ledger_hears_of_the_run(server):
    """Initial parameters too short, a model that is not finite, an optimizer state too short: each
    hospital leaves in one line, and its ledger names no run that a correct Welcome would then clash with."""
    server.receive_from_each(Hello, EVERYONE)
    welcome = server.welcome(H1)
    nan = np.frombuffer(welcome.parameters, dtype="<f4").copy()
    nan[0] = np.nan
    broken = {
        H1: {"initial_parameters": welcome.initial_parameters[:-4]},
        H2: {"parameters": nan.tobytes()},
        H3: {"optimizer_state": welcome.optimizer_state[:-4]},
    }
    for name, change in broken.items():
        server.send(name, dataclasses.replace(server.welcome(name), **change))
    for name in EVERYONE:
        errors = [line for line in _refusal(server, name).splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "the server's Welcome is unusable" in errors[0], errors
        ledger = server.federation / name / LEDGER_FILE
        assert not ledger.exists() or server.config.run_id not in ledger.read_text()


def test_a_welcome_that_would_keep_a_hospital_waiting_forever_or_never_is_refused(server):
    """The server's Welcome says how long it may keep a member waiting (5 round steps and 2 welcome
    passes): a hospital waits that long, but neither no time nor more than a day."""
    server.receive_from_each(Hello, EVERYONE)
    for name, wait in ((H1, 0), (H2, 10**9), (H3, 24 * 3600 + 1)):  # (a negative one is not even decoded)
        server.send(name, dataclasses.replace(server.welcome(name), server_wait_s=wait))
    for name in EVERYONE:
        assert "at most 86400 s is accepted" in _refusal(server, name)


def test_a_finished_run_s_welcome_replayed_and_a_round_past_the_last_are_refused(tmp_path):
    server = ScriptedServer(tmp_path, 3, quorum=3, rounds=1)
    try:
        server.set_up()
        _honest_round(server, 1)
        server.send(H1, RoundStart(round=2, box_keys={}))  # a round past the run's last
        assert "started round 2 of a run of 1 rounds" in _refusal(server, H1)
        _finish(server, (H2, H3))
        spent = {name: server.ledger_epsilon(name) for name in EVERYONE}
    finally:
        server.close()

    # The same run, every setting and the initial model, welcomed again to the restarted hospitals.
    replay = ScriptedServer(tmp_path, 3, quorum=3, rounds=1, run_id=server.config.run_id)
    replay.initial, replay.run = server.initial, server.run
    try:
        replay.join()
        for name in EVERYONE:
            assert f"run {server.config.run_id} is over for this party" in _refusal(replay, name)
        assert _drain(replay) == []
        assert {name: replay.ledger_epsilon(name) for name in EVERYONE} == spent
    finally:
        replay.close()
