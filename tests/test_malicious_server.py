"""A dishonest server, scripted message by message, against real hospital processes.

Whatever the server sends, a hospital uses and releases only the sum of one fresh contribution from
each listed contributor, endorsed by all of them, and its ledger never counts less than it
released.
"""

import dataclasses

import pytest

from crypto.bfv import aggregate_bytes
from protocol.config import INSECURE_PLAINTEXT
from protocol.messages import (
    Aggregate,
    Endorsement,
    Endorsements,
    Finish,
    Hello,
    KeyReady,
    KeyRequest,
    Released,
    RoundStart,
    RunKey,
)
from scripted import ScriptedServer
from training.dp_fedavg import DpFedAvgSettings

pytestmark = pytest.mark.slow

H1, H2, H3 = "hospital-1", "hospital-2", "hospital-3"


@pytest.fixture
def server(tmp_path):
    scripted = ScriptedServer(tmp_path, 3, quorum=2)
    yield scripted
    scripted.close()


def _refusal(server: ScriptedServer, name: str) -> str:
    stderr = server.wait_for_exit(name)
    assert "Traceback" not in stderr
    return stderr


def _ring(config) -> tuple:
    params = config.bfv_parameters()
    return params.poly_modulus_degree, params.plain_modulus, params.coeff_mod_bit_sizes


def _drain(server: ScriptedServer) -> list:
    """What the hospitals sent after they stopped; each has exited, so it is all here."""
    received = []
    while (got := server.transport.receive(1.0)) is not None:
        received.append(got)
    return received


def test_forged_aggregates_are_refused_before_any_release(server):
    server.set_up()
    uploads = server.start_round(1)
    everyone = (H1, H2, H3)
    size = aggregate_bytes(server.public.params)
    forgeries = {
        H1: server.add(uploads[H2], uploads[H2], uploads[H2]),  # 3 Enc(x2): hospital-2's update alone
        H2: [b"\x00" * size] * len(uploads[H1]),  # transparent: decrypts to anything under any key
        H3: server.add(uploads[H1], uploads[H3]),  # hospital-2 listed but left out
    }
    for name, chunks in forgeries.items():
        server.send(name, Aggregate(round=1, contributors=everyone, chunks=tuple(chunks)))
    for name in everyone:
        assert "refusing the server's sum" in _refusal(server, name)
    assert _drain(server) == []  # no endorsement, no release
    for name in everyone:
        assert server.ledger_epsilon(name) > 0  # the upload was charged before it left


def test_a_server_cannot_release_one_update_in_two_sums(server):
    """Equivocation: sum {1, 2} to hospitals 1 and 2, sum {2, 3} to hospital 3, in the same round."""
    server.set_up()
    uploads = server.start_round(1)
    first = Aggregate(round=1, contributors=(H1, H2), chunks=tuple(server.add(uploads[H1], uploads[H2])))
    second = Aggregate(round=1, contributors=(H2, H3), chunks=tuple(server.add(uploads[H2], uploads[H3])))
    for name, aggregate in ((H1, first), (H2, first), (H3, second)):
        server.send(name, aggregate)
    endorsements = server.receive_from_each(Endorsement, (H1, H2, H3))
    server.send(H2, second)  # hospital-2 has endorsed an aggregate of round 1: it endorses no other
    server.send(H3, Endorsements(round=1, signatures={H2: endorsements[H2].signature, H3: endorsements[H3].signature}))
    assert "hospital-2's endorsement is not its signature" in _refusal(server, H3)

    honest = Endorsements(round=1, signatures={H1: endorsements[H1].signature, H2: endorsements[H2].signature})
    server.send(H1, honest)
    server.send(H2, honest)
    releases = server.receive_from_each(Released, (H1, H2))
    assert releases[H1].mean_gradient and releases[H1].digest == releases[H2].digest
    server.send(H1, Finish(reason="test over"))
    server.send(H2, Finish(reason="test over"))
    assert server.hospitals[H1].process.wait(timeout=60) == 0 and server.hospitals[H2].process.wait(timeout=60) == 0
    assert _drain(server) == []  # hospital-2 never endorsed the second sum
    assert "a hospital endorses one per round" in server.logs[H2].read_text()


def test_a_replayed_round_and_a_reused_run_id_are_refused(tmp_path):
    server = ScriptedServer(tmp_path, 3, quorum=3)
    try:
        server.set_up()
        uploads = server.start_round(1)
        aggregate = Aggregate(round=1, contributors=(H1, H2, H3), chunks=tuple(server.add(*uploads.values())))
        for name in (H1, H2, H3):
            server.send(name, aggregate)
        endorsements = server.receive_from_each(Endorsement, (H1, H2, H3))
        signatures = {name: message.signature for name, message in endorsements.items()}
        for name in (H1, H2, H3):
            server.send(name, Endorsements(round=1, signatures=signatures))
        server.receive_from_each(Released, (H1, H2, H3))
        for name in (H1, H2, H3):
            server.send(name, RoundStart(round=1))
        for name in (H1, H2, H3):
            assert "started round 1 again" in _refusal(server, name)
        assert _drain(server) == []  # no second upload for round 1
        spent = {name: server.ledger_epsilon(name) for name in (H1, H2, H3)}
        assert all(epsilon > 0 for epsilon in spent.values())
        run_id = server.config.run_id
    finally:
        server.close()

    again = ScriptedServer(tmp_path, 3, quorum=3, run_id=run_id)
    try:
        again.join()
        for name in (H1, H2, H3):
            assert f"run {run_id} is already in this privacy ledger" in _refusal(again, name)
        assert _drain(again) == []
        assert {name: again.ledger_epsilon(name) for name in (H1, H2, H3)} == spent
    finally:
        again.close()


def test_hospitals_given_different_settings_get_no_key_through(server):
    """Less noise for hospitals 2 and 3 than for hospital-1: the key holder seals no key to them (nor to nobody)."""
    config = server.config
    less_noise = dataclasses.replace(config, training=dataclasses.replace(config.training, noise_multiplier=0.3))
    assert _ring(less_noise) == _ring(config)  # the same ciphertexts and keys: nothing else would tell them apart
    server.receive_from_each(Hello, (H1, H2, H3))
    server.send(H1, server.welcome(H1))
    for name in (H2, H3):
        server.send(name, server.welcome(name, less_noise))
    run_keys = server.receive_from_each((KeyReady, RunKey), (H1, H2, H3))
    assert isinstance(run_keys.pop(H1), KeyReady)
    server.send(H1, KeyRequest(run_keys={name: message.certified_key for name, message in run_keys.items()}))
    server.wait_for_log(H1, "is not hospital-")
    server.send(H1, KeyRequest(run_keys={}))
    server.wait_for_log(H1, "to no hospital")
    assert _drain(server) == []  # no key setup


DP_FEDAVG = DpFedAvgSettings(
    noise_multiplier=1.0,
    max_update_norm=0.5,
    quorum=2,
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
    server.receive_from_each(Hello, (H1, H2, H3))
    for name in (H1, H2, H3):
        server.send(name, server.welcome(name, switched))
    for name in (H1, H2, H3):
        assert refusal.format(name=name) in _refusal(server, name)
    assert _drain(server) == []  # no key, no update


def test_a_welcome_with_absurd_sizes_is_refused_in_one_line_before_anything_is_allocated(tmp_path):
    """Hidden layers of -1 units, and of 10^9 (2.9 GB of parameters were allocated before any check)."""
    server = ScriptedServer(tmp_path, 2, quorum=2)
    try:
        server.receive_from_each(Hello, (H1, H2))
        for name, hidden in ((H1, [-1]), (H2, [10**9])):
            config = server.config.to_dict()
            config["model"]["hidden"] = hidden
            server.send(name, dataclasses.replace(server.welcome(name), config=config))
        for name in (H1, H2):
            errors = [line for line in _refusal(server, name).splitlines() if line.startswith("error:")]
            assert (
                len(errors) == 1
                and "the server's run configuration is unusable" in errors[0]
                and "hidden layers" in errors[0]
            )
    finally:
        server.close()


def test_a_finished_run_s_welcome_replayed_and_a_round_past_the_last_are_refused(tmp_path):
    server = ScriptedServer(tmp_path, 2, quorum=2, rounds=1)
    try:
        server.set_up()
        uploads = server.start_round(1)
        aggregate = Aggregate(round=1, contributors=(H1, H2), chunks=tuple(server.add(*uploads.values())))
        for name in (H1, H2):
            server.send(name, aggregate)
        signatures = {
            name: message.signature for name, message in server.receive_from_each(Endorsement, (H1, H2)).items()
        }
        for name in (H1, H2):
            server.send(name, Endorsements(round=1, signatures=signatures))
        server.receive_from_each(Released, (H1, H2))
        server.send(H1, RoundStart(round=2))  # a round past the run's last
        assert "started round 2 of a run of 1 rounds" in _refusal(server, H1)
        server.send(H2, Finish(reason="completed all rounds"))
        assert server.hospitals[H2].process.wait(timeout=60) == 0
        spent = {name: server.ledger_epsilon(name) for name in (H1, H2)}
    finally:
        server.close()

    # The same run, every setting and the initial model, welcomed again to the restarted hospitals.
    replay = ScriptedServer(tmp_path, 2, quorum=2, rounds=1, run_id=server.config.run_id)
    replay.initial, replay.run = server.initial, server.run
    try:
        replay.join()
        for name in (H1, H2):
            assert f"run {server.config.run_id} is over for this party" in _refusal(replay, name)
        assert _drain(replay) == []
        assert {name: replay.ledger_epsilon(name) for name in (H1, H2)} == spent
    finally:
        replay.close()
