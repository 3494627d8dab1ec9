"""Addresses as networks are: the roster names where the parties reach the server, and the server
listens where that arrives, as behind a NAT, in a container or behind a load balancer. Here a relay
on the roster's port forwards to the server's own: the relay stands in for the network's forwarding,
and everything else is real processes over real sockets."""

import pytest

from conftest import free_port
from relay import Relay
from scripted import HospitalProcess, ServerProcess

pytestmark = pytest.mark.slow


def test_a_server_listening_apart_from_the_roster_s_address_completes_a_run(tmp_path):
    public_port, own_port = free_port(), free_port()
    public, listen = f"tcp://localhost:{public_port}", f"tcp://127.0.0.1:{own_port}"  # the roster names a host name
    relay = Relay(public_port, own_port)
    server = ServerProcess(tmp_path, 3, "--rounds", "2", "--listen", listen, address=public)
    hospitals = [
        HospitalProcess(
            server.federation, f"hospital-{i}", i, 3, tmp_path / f"hospital-{i}.log", "--epsilon-budget", "100"
        )
        for i in (1, 2, 3)
    ]
    try:
        report = server.finish()
        for hospital in hospitals:
            assert hospital.process.wait(timeout=60) == 0, hospital.log.read_text()
    finally:
        for process in (server, *hospitals):
            process.kill()
        relay.close()
    assert report["finish_reason"] == "completed all rounds"
    assert [r["status"] for r in report["rounds"]] == ["released", "released"]
    assert f"server on {listen} (the roster's {public})" in server.log.read_text()
