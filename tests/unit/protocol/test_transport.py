import time

import pytest

import zmq
from zmq.utils.monitor import recv_monitor_message

from conftest import free_port
from relay import Relay
from consilium.protocol.identity.party_keys import CurveKeyPair
from consilium.protocol.wire.transport import ClientTransport, ServerTransport, TransportError


def _keys():
    return CurveKeyPair(*zmq.curve_keypair())


def test_the_server_names_senders_by_their_authenticated_key():
    server_keys, first, second = _keys(), _keys(), _keys()
    address = f"tcp://127.0.0.1:{free_port()}"
    server = ServerTransport(address, server_keys, {first.public: "hospital-1", second.public: "hospital-2"}, 1 << 16)
    clients = [ClientTransport(address, server_keys.public, keys, 1 << 16) for keys in (first, second)]
    try:
        clients[1].send(b"from two")
        clients[0].send(b"from one")
        received = dict(server.receive(5) for _ in range(2))
        assert received == {"hospital-1": b"from one", "hospital-2": b"from two"}
        assert server.send("hospital-2", b"reply")
        assert clients[1].receive(5) == b"reply" and clients[0].receive(0.2) is None
        assert not server.send("hospital-9", b"nobody")
    finally:
        for client in clients:
            client.close()
        server.close()


def test_an_unenrolled_key_is_refused_at_the_handshake():
    server_keys, enrolled, intruder = _keys(), _keys(), _keys()
    address = f"tcp://127.0.0.1:{free_port()}"
    server = ServerTransport(address, server_keys, {enrolled.public: "hospital-1"}, 1 << 16)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.curve_serverkey, socket.curve_publickey, socket.curve_secretkey = (
        server_keys.public,
        intruder.public,
        intruder.secret,
    )
    monitor = socket.get_monitor_socket()
    try:
        socket.connect(address)
        socket.send(b"let me in", zmq.NOBLOCK)
        events = set()
        deadline = time.monotonic() + 10
        while zmq.EVENT_HANDSHAKE_FAILED_AUTH not in events and time.monotonic() < deadline:
            if monitor.poll(200):
                events.add(recv_monitor_message(monitor)["event"])
        assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in events
        assert server.receive(1) is None
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)
        socket.close(linger=0)
        context.term()
        server.close()


def test_a_party_the_server_did_not_enrol_is_told_at_once_not_left_waiting():
    """ZeroMQ does not try a connection again after the server refused its handshake: a service that
    reached a server of a run without it would wait for nothing until its own timeout."""
    server_keys, enrolled, other = _keys(), _keys(), _keys()
    address = f"tcp://127.0.0.1:{free_port()}"
    server = ServerTransport(address, server_keys, {enrolled.public: "hospital-1"}, 1 << 16)
    client = ClientTransport(address, server_keys.public, other, 1 << 16)
    try:
        client.send(b"hello")
        with pytest.raises(TransportError, match="the server refused this party's key"):
            client.receive(10)
    finally:
        client.close()
        server.close()


def test_a_connection_cut_mid_handshake_is_tried_again_not_taken_for_a_refusal():
    """A relay with no server behind it yet (a NAT, a container's proxy) accepts and closes: the party goes on
    waiting, and reaches the server once it listens."""
    server_keys, enrolled = _keys(), _keys()
    public_port, own_port = free_port(), free_port()
    relay = Relay(public_port, own_port)
    client = ClientTransport(f"tcp://127.0.0.1:{public_port}", server_keys.public, enrolled, 1 << 16)
    try:
        client.send(b"hello")
        assert client.receive(1.5) is None  # cut, and tried again: no TransportError
        server = ServerTransport(f"tcp://127.0.0.1:{own_port}", server_keys, {enrolled.public: "hospital-1"}, 1 << 16)
        try:
            deadline, got = time.monotonic() + 20, None
            while got is None and time.monotonic() < deadline:
                client.send(b"hello again")
                got = server.receive(1.0)
            assert got is not None and got[0] == "hospital-1"
        finally:
            server.close()
    finally:
        client.close()
        relay.close()
