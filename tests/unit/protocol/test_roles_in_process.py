"""The server's and the hospitals' state machines, driven in one process over transports in memory
(``tests/support/memory_transport.py``): every message encoded, checked and answered by the roles'
own code, every round on real SEAL, in seconds rather than a federation of processes."""

import threading

import numpy as np
import pytest

from consilium.protocol.identity.party_keys import SERVER, Credentials
from consilium.training.privacy.budget import PrivacyBudget
from consilium.training.privacy.ledger import LEDGER_FILE
from consilium.protocol.run.hospital import Hospital
from consilium.protocol.run.participants import Timeouts
from consilium.protocol.run.server import Server
from consilium.protocol.wire.codec import decode, encode
from consilium.protocol.wire.messages import Hello, ProtocolError, Welcome
from memory_transport import MemoryNetwork
from scripted_peers import small_run_config

HOSPITALS = 3


def _hospital(roster, tmp_path, name, data, network, **settings) -> Hospital:
    return Hospital(
        roster=roster,
        credentials=Credentials.load(tmp_path / "federation" / name),
        data=data,
        budget=PrivacyBudget(epsilon=100.0, delta=1e-5),
        state_dir=tmp_path / "federation" / name,
        method="dopamine",
        send_offset_s=0.0,
        timeout_s=30.0,
        transport=network.client(name),
        **settings,
    )


def test_a_federation_of_threads_releases_every_round_and_every_party_applies_the_same_model(threaded_federation):
    roster, data, shares, tmp_path = threaded_federation
    network = MemoryNetwork()
    config = small_run_config(roster, quorum=HOSPITALS, rounds=2)
    server = Server(
        config=config,
        roster=roster,
        credentials=Credentials.load(tmp_path / "federation" / SERVER),
        validation=data.validation,
        out_dir=tmp_path / "out",
        timeouts=Timeouts(join_s=30, key_s=30, round_s=30),
        transport=network.server(),
    )
    hospitals = {name: _hospital(roster, tmp_path, name, shares[name], network) for name in roster.hospitals}
    results: dict[str, dict] = {}
    threads = [
        threading.Thread(target=lambda n=name, h=hospital: results.__setitem__(n, h.run()), daemon=True)
        for name, hospital in hospitals.items()
    ]
    for thread in threads:
        thread.start()
    report = server.run()
    for thread in threads:
        thread.join(timeout=60)
    assert report["finish_reason"] == "completed all rounds"
    assert [r["status"] for r in report["rounds"]] == ["released", "released"]
    assert all(r["contributors"] == list(roster.hospitals) for r in report["rounds"])
    server_model = np.concatenate([p.detach().numpy().ravel() for p in server._model.network.parameters()])
    for name, hospital in hospitals.items():
        assert results[name]["finish_reason"] == "completed all rounds"
        held = np.concatenate([p.detach().numpy().ravel() for p in hospital._model.network.parameters()])
        assert np.array_equal(held, server_model), f"{name} applied another model than the server's"


def test_a_hospital_refuses_a_welcome_to_another_method_before_its_ledger_hears_of_the_run(threaded_federation):
    roster, data, shares, tmp_path = threaded_federation
    network = MemoryNetwork()
    name = roster.hospitals[0]
    hospital = _hospital(roster, tmp_path, name, shares[name], network)
    server = network.server()
    config = small_run_config(roster, quorum=HOSPITALS, rounds=1)
    announced = config.to_dict()
    announced["training"]["method"] = "dp-fedavg"
    welcome = Welcome(
        config=announced,
        initial_parameters=b"",
        parameters=b"",
        optimizer_state=b"",
        next_round=1,
        server_wait_s=60,
    )
    server.send(name, encode(welcome))
    with pytest.raises(ProtocolError, match="trains with 'dp-fedavg'; hospital-1 was started for 'dopamine'"):
        hospital.run()
    sender, hello = server.receive(1.0)
    assert sender == name and isinstance(decode(hello, accept=frozenset({Hello}), max_bytes=1 << 10), Hello)
    assert not (tmp_path / "federation" / name / LEDGER_FILE).exists()
