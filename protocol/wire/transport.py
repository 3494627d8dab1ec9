"""ZeroMQ transport with CurveZMQ: authenticated, encrypted, and nothing waits forever.

The server binds one ROUTER socket; each hospital connects a DEALER. Every connection runs the
CURVE handshake: hospitals know the server's public key from the roster, and the server's ZAP
handler admits only public keys enrolled in the roster, refusing (and logging) any other. The ZAP
handler stamps each connection with the enrolled party's name as its User-Id, so the server names
the sender of a message by the key that authenticated it, never by anything the message says.

Messages are single frames. ``max_message_bytes`` is enforced twice: the application checks it with
a logged rejection (``protocol.wire.codec.decode``), and ZeroMQ's MAXMSGSIZE, a little above it,
drops a connection that sends anything larger before it is buffered.

Floods are bounded: ZeroMQ queues at most ``_RECEIVE_QUEUE_MESSAGES`` messages per connection, at
either end (then it stops reading from that connection, so a flood backs up at its sender). At the
server every rejected message (``reject``, and any message that is not a single frame) takes a token
from its party's bucket, which refills at ``max_messages_per_second`` (bursts of at least
``_BURST_MESSAGES``); while a party's bucket is empty, its messages are dropped unread, counted,
and logged at most once a second. Honest traffic is never rejected, so it never draws from the
bucket however fast the rounds go. Not bounded yet: how many connections one enrolled key may open.

Strangers cannot stop the server either. CURVE asks ZAP only once a client has sent its INITIATE,
which a silent connection never does, so the roster cannot turn such connections away; instead
every connection must finish its handshake within ``_HANDSHAKE_S`` seconds (ZeroMQ's default is
30) or is dropped, the listen backlog is ``_BACKLOG``, and the launchers raise the process's limit
of open files to the hard limit (``scripts._run``). A thread reads the socket's monitor and counts
the connections open; a pile of them is logged (at most every ``_FLOOD_LOG_S`` seconds) and the
peak reported (``ServerTransport.limits``).

ZeroMQ reconnects a hospital by itself, silently; a restarted server would then not know it. The
hospital's transport watches its socket's monitor and raises ``Reconnected`` from ``receive`` when a
CURVE handshake completes after the first, so that the hospital can say Hello again. A server that
refuses the handshake (one whose run leaves this party out, as a service meets between runs) ends
the wait with ``TransportError``: ZeroMQ would not try that connection again.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections import defaultdict

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message
from zmq.utils import z85

from consilium.errors import ConsiliumError
from consilium.protocol.identity.party_keys import CurveKeyPair

__all__ = [
    "ClientTransport",
    "Reconnected",
    "ServerTransport",
    "TransportError",
    "descriptor_limit",
    "raise_descriptor_limit",
]

log = logging.getLogger("consilium.transport")

_HARD_LIMIT_SLACK_BYTES = 4096
_SEND_TIMEOUT_MS = 10_000
# The server's answer to this party's key, after which ZeroMQ does not try again; a connection merely cut
# mid-handshake (EVENT_HANDSHAKE_FAILED_NO_DETAIL: a relay with no server behind it yet) is tried again.
_HANDSHAKE_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_CLIENT_LINGER_MS = 2_000  # let a hospital's last message leave before it exits
_RECEIVE_QUEUE_MESSAGES = 16
_BURST_MESSAGES = 10
_HANDSHAKE_S = 5  # an honest CURVE handshake takes milliseconds, over any network a second
_BACKLOG = 1024
_FLOOD_CONNECTIONS = 100  # open connections beyond the roster's parties at which the server says so
_FLOOD_LOG_S = 10.0
_WATCH_POLL_MS = 100
DEFAULT_MAX_MESSAGES_PER_SECOND = 50.0


class TransportError(ConsiliumError, RuntimeError):
    """A socket that cannot be opened or a message that cannot be sent."""


class Reconnected(Exception):
    """A hospital's connection to the server was made again (the server restarted, or the network
    broke): messages in flight may be lost, and the server may not know this hospital any more."""


class ServerTransport:
    def __init__(
        self,
        bind: str,
        keys: CurveKeyPair,
        enrolled: dict[bytes, str],
        max_message_bytes: int,
        max_messages_per_second: float = DEFAULT_MAX_MESSAGES_PER_SECOND,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self._context = _context()
        self._authenticator = _RosterAuthenticator(self._context, enrolled)
        self._authenticator.start()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.curve_server = True
        self._socket.curve_secretkey = keys.secret
        self._socket.curve_publickey = keys.public
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + _HARD_LIMIT_SLACK_BYTES)
        self._socket.setsockopt(zmq.RCVHWM, _RECEIVE_QUEUE_MESSAGES)
        self._socket.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_S * 1000)
        self._socket.setsockopt(zmq.BACKLOG, _BACKLOG)
        self._connections = _ConnectionWatch(self._socket, len(enrolled))
        try:
            self._socket.bind(bind)
        except zmq.ZMQError as error:
            self.close()
            raise TransportError(f"cannot listen on {bind}: {error}") from None
        self._routes: dict[str, bytes] = {}
        self._rate = _TokenBuckets(max_messages_per_second)
        self._last_drop_warning: dict[str, float] = {}
        self.bytes_received: dict[str, int] = defaultdict(int)
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.dropped: dict[str, int] = defaultdict(int)  # while a party's bucket is empty, or not one frame: never read

    def receive(self, timeout_s: float) -> tuple[str, bytes] | None:
        """The next ``(party, payload)`` within a party's rate, or None once ``timeout_s`` passes without one."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0 and self._socket.poll(int(remaining * 1000)):
            frames = self._socket.recv_multipart(copy=False)
            party = frames[-1].get("User-Id") or "an unauthenticated sender"  # ZAP authenticates every connection
            if not self._rate.has_token(party):
                self._note_dropped(party, f"more than {self._rate.rate:g} rejected messages a second")
            elif len(frames) != 2:
                self.reject(party)
                self._note_dropped(party, f"a message of {len(frames) - 1} frames, not one")
            else:
                self._routes[party] = frames[0].bytes
                payload = frames[1].bytes
                self.bytes_received[party] += len(payload)
                return party, payload
        return None

    @property
    def limits(self) -> dict:
        """What bounds a flood of connections, as set, and the most handshakes seen in progress at once."""
        return {
            "open_files": descriptor_limit(),
            "handshake_seconds": _HANDSHAKE_S,
            "backlog": _BACKLOG,
            "most_connections_open": self._connections.peak,
        }

    def reject(self, party: str) -> None:
        """Charge ``party`` for a message the application rejected."""
        self._rate.take(party)

    def _note_dropped(self, party: str, why: str) -> None:
        self.dropped[party] += 1
        now = time.monotonic()
        if now - self._last_drop_warning.get(party, -1.0) >= 1.0:
            self._last_drop_warning[party] = now
            log.warning("dropping messages from %s: %s (%d so far)", party, why, self.dropped[party])

    def send(self, party: str, payload: bytes) -> bool:
        """Send to a party that has connected; False (logged) if it cannot be reached."""
        route = self._routes.get(party)
        if route is None:
            log.warning("cannot send to %s: it has not connected", party)
            return False
        try:
            self._socket.send_multipart([route, payload])
        except zmq.ZMQError as error:
            log.warning("cannot send to %s: %s", party, error)
            return False
        self.bytes_sent[party] += len(payload)
        return True

    def close(self) -> None:
        self._connections.close()
        self._socket.close(linger=0)
        self._authenticator.stop()
        self._context.term()


class _ConnectionWatch:
    """The connections open at the server, counted from its socket's monitor by a thread of its own.

    The monitor must be read as its events come: libzmq blocks its I/O thread once a thousand wait
    unread, and a stranger's connections make events while the server is busy adding ciphertexts."""

    def __init__(self, socket: zmq.Socket, parties: int) -> None:
        self._socket = socket
        self._monitor = socket.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._open: set[int] = set()  # by descriptor: every accepted connection ends with one DISCONNECTED
        self._flood = parties + _FLOOD_CONNECTIONS
        self.peak = 0
        self._last_warning = -_FLOOD_LOG_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="consilium-connection-watch", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            if not self._monitor.poll(_WATCH_POLL_MS):
                continue
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._open.add(event["value"])
            else:
                self._open.discard(event["value"])
            self.peak = max(self.peak, len(self._open))
            now = time.monotonic()
            if len(self._open) > self._flood and now - self._last_warning >= _FLOOD_LOG_S:
                self._last_warning = now
                log.warning(
                    "%d connections are open at once (a flood?); each that has not finished its handshake within %d s is dropped",
                    len(self._open),
                    _HANDSHAKE_S,
                )

    def close(self) -> None:
        self._socket.disable_monitor()  # while the thread still drains: libzmq sends its last events first
        self._stop.set()
        self._thread.join()
        self._monitor.close(linger=0)


def raise_descriptor_limit() -> int:
    """Raise this process's limit of open files to the hard limit (each connection takes one); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as error:  # e.g. an infinite hard limit the kernel caps lower
            log.warning("cannot raise the limit of open files from %d: %s", soft, error)
    return descriptor_limit()


def descriptor_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class ClientTransport:
    def __init__(self, connect: str, server_public: bytes, keys: CurveKeyPair, max_message_bytes: int) -> None:
        self._context = _context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.curve_serverkey = server_public
        self._socket.curve_publickey = keys.public
        self._socket.curve_secretkey = keys.secret
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + _HARD_LIMIT_SLACK_BYTES)
        self._socket.setsockopt(zmq.RCVHWM, _RECEIVE_QUEUE_MESSAGES)
        self._socket.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self._socket.setsockopt(zmq.LINGER, _CLIENT_LINGER_MS)
        # ZeroMQ reconnects by itself and says nothing; its monitor reports each CURVE handshake, completed or not.
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_REFUSED)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._connected_before = False
        try:
            self._socket.connect(connect)
        except zmq.ZMQError as error:
            self.close()
            raise TransportError(f"cannot connect to {connect}: {error}") from None
        self.bytes_received = 0
        self.bytes_sent = 0

    def send(self, payload: bytes) -> None:
        try:
            self._socket.send(payload)
        except zmq.Again:
            raise TransportError(f"the server did not take a message within {_SEND_TIMEOUT_MS / 1000:g} s") from None
        self.bytes_sent += len(payload)

    def receive(self, timeout_s: float) -> bytes | None:
        """The next message, or None once ``timeout_s`` passes without one.

        Raises ``Reconnected`` when a connection to the server completes after the first one, and
        ``TransportError`` when the server refuses this party's handshake (it did not enrol this party:
        a server of a run without it, or of another roster), after which ZeroMQ does not try again."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            ready = dict(self._poller.poll(max(1, int(remaining * 1000))))
            if self._monitor in ready:
                if recv_monitor_message(self._monitor)["event"] & _HANDSHAKE_REFUSED:
                    raise TransportError("the server refused this party's key: it runs without this party")
                reconnected, self._connected_before = self._connected_before, True
                if reconnected:
                    raise Reconnected("the connection to the server was made again")
            elif self._socket in ready:
                payload = self._socket.recv()
                self.bytes_received += len(payload)
                return payload
        return None

    def close(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close()
        self._context.term()


def _context() -> zmq.Context:
    """A context whose sockets linger 0 unless told otherwise, so that ending it never waits forever
    (ZeroMQ's default is to wait for every queued message to leave, however long that takes)."""
    context = zmq.Context()
    context.set(zmq.BLOCKY, False)
    return context


class _TokenBuckets:
    """Per party: ``rate`` tokens a second, up to ``max(rate, _BURST_MESSAGES)`` in store; a rejection takes one."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._capacity = max(rate, _BURST_MESSAGES)
        self._tokens: dict[str, float] = {}
        self._updated: dict[str, float] = {}

    def has_token(self, party: str) -> bool:
        return self._refill(party) >= 1

    def take(self, party: str) -> None:
        self._tokens[party] = max(0.0, self._refill(party) - 1)

    def _refill(self, party: str) -> float:
        now = time.monotonic()
        elapsed = max(0.0, now - self._updated.get(party, now))  # a clock that steps back must not cost tokens
        self._tokens[party] = min(self._capacity, self._tokens.get(party, self._capacity) + elapsed * self.rate)
        self._updated[party] = now
        return self._tokens[party]


class _RosterAuthenticator(ThreadAuthenticator):
    """Admits the enrolled CURVE keys only, and names each connection after its enrolled party."""

    def __init__(self, context: zmq.Context, enrolled: dict[bytes, str]) -> None:
        super().__init__(context)
        self._enrolled = dict(enrolled)
        self._refused = 0
        self._last_warning = -1.0

    def start(self) -> None:
        super().start()
        self.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._enrolled:
            return True
        self._refused += 1
        now = time.monotonic()
        if now - self._last_warning >= 1.0:  # anyone who reaches the port can try: at most a line a second
            self._last_warning = now
            log.warning(
                "refused a connection from an unenrolled CurveZMQ key %s (%d refused so far)",
                key.decode("ascii", "replace"),
                self._refused,
            )
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._enrolled[z85.encode(client_public_key)]
