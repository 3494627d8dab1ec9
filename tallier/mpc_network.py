"""MPyC's network, held to the roster: pinned certificates, one connection per party, no code from peers.

MPyC 0.11 trusts its peers further than Consilium may:

- ``Runtime.start`` listens on every interface and lets in any client whose certificate chains to
  a shared authority; the client's party number is the first two bytes it sends, checked against
  nothing, so one certificate can claim several parties or displace one;
- secure arrays travel as pickles (``_distribute``, ``output``, ``_reshare``), and ``transfer``,
  which ``shutdown`` calls, unpickles whatever a peer sent: a crafted pickle runs code here;
- a message may announce up to 4 GiB, and is buffered whole.

This module replaces those parts, and nothing else of MPyC:

1. ``connect``, instead of ``Runtime.start``: listen on this tallier's own address only, TLS 1.3
   with the certificates the roster pins. The listener trusts the pins of lower-numbered parties
   only; a client trusts only the pin of the party it dials and checks that the listener
   presented exactly it. A client's claimed number must be lower than the listener's, not yet
   connected, and its certificate exactly that party's pin, or the connection is dropped and
   logged (the real party can still connect). Every peer is connected once before the deadline,
   then the listener closes.
2. Arrays travel as fixed-width field elements (MPyC's ``--mix32-64bit``, which
   ``MPYC_ARGUMENTS`` sets), and every element a peer sends must lie in the field, whole
   (``_field_elements``).
3. What MPyC still unpickles (``transfer``'s small values) goes through an unpickler that refuses
   every global (``_data_only``): only numbers, strings, bytes, tuples, lists, dicts and sets.
4. Each message is at most ``max_message_bytes`` and a peer holds at most
   ``_BUFFERED_MESSAGES`` times that unread: more, and it is cut off.

A peer that breaks 2 to 4 stops the round at once with ``MpcPeerError``, which names it.
``harden_mpyc`` installs 2 and 3 in this process; ``tests/test_mpc_network.py`` fails if an MPyC
upgrade moves the places that unpickle.
"""

from __future__ import annotations

import asyncio
import io
import logging
import pickle
import ssl
import struct
import time
import types
from dataclasses import dataclass
from pathlib import Path

from crypto.mpc_field import MIN_PARTIES, import_mpyc

_mpyc_runtime = import_mpyc()
from mpyc import asyncoro, finfields  # noqa: E402  (imported safely on the line above)

__all__ = ["MPYC_ARGUMENTS", "MpcParty", "MpcPeerError", "connect", "harden_mpyc", "watch"]

log = logging.getLogger("consilium.mpc")

MPYC_ARGUMENTS = ("--ssl", "--mix32-64bit")  # --ssl only keeps MPyC's own paths consistent; connect makes the connections
_HEADER = struct.Struct("<qI")  # MPyC's framing: program counter, payload size
_BUFFERED_MESSAGES = 64
_RETRY_S = 0.1
_HANDSHAKE_S = 10.0  # a stranger's connection that never finishes TLS is dropped after this


class MpcPeerError(RuntimeError):
    """A peer sent what an honest tallier never sends; the round is aborted."""


@dataclass(frozen=True)
class MpcParty:
    """One tallier in the MPC: every tallier in party order, as the roster pins them, and its own keys."""

    index: int  # 0-based, as MPyC numbers parties
    names: tuple[str, ...]
    addresses: tuple[tuple[str, int], ...]  # (host, port) where each listens
    certificates: tuple[bytes, ...]  # DER, pinned by the roster
    certificate_file: Path  # this tallier's own certificate (PEM) and key
    key_file: Path

    def __post_init__(self) -> None:
        if len(self.addresses) < MIN_PARTIES:
            raise ValueError(f"the MPC needs at least {MIN_PARTIES} talliers for an honest majority, got {len(self.addresses)}")
        if not len(self.names) == len(self.addresses) == len(self.certificates):
            raise ValueError("every tallier needs a name, an address and a pinned certificate")
        if not 0 <= self.index < len(self.addresses):
            raise ValueError(f"tallier index {self.index} is not one of the {len(self.addresses)} talliers")


class _FromPeer(bytes):
    """A payload as it arrived, with the name of the tallier that sent it."""

    sender: str


def harden_mpyc() -> None:
    """Make every decoder MPyC applies to a peer's bytes refuse what is not data (2 and 3 above)."""
    _mpyc_runtime.pickle = types.SimpleNamespace(dumps=pickle.dumps, loads=_data_only)
    finfields.FiniteFieldElement.from_bytes = classmethod(_field_elements)


def watch(runtime) -> list[str]:
    """Where this round's reasons to abort collect: a peer's broken rule, or an MPyC task's error
    (which MPyC would print as a traceback); either stops the event loop at once."""
    _aborts.clear()

    def record(loop, context: dict) -> None:
        error = context.get("exception")
        if error is None:  # e.g. a pending task collected after a failure: nothing to abort for
            log.debug("MPyC: %s", context.get("message"))
        else:
            _stop(runtime, str(error) if isinstance(error, MpcPeerError) else f"{context.get('message')}: {error!r}")

    runtime._loop.set_exception_handler(record)
    return _aborts


async def connect(runtime, party: MpcParty, max_message_bytes: int, deadline_s: float) -> None:
    """Connect this tallier to every other, as the module docstring's point 1 says;
    ``asyncio.TimeoutError`` if that cannot be done within ``deadline_s``."""
    loop, me = runtime._loop, runtime.pid
    for peer in runtime.parties:
        peer.protocol = asyncio.Future(loop=loop) if peer.pid == me else None
    listener = None
    if me:
        host, port = party.addresses[me]
        context = _context(ssl.PROTOCOL_TLS_SERVER, party, trusted=party.certificates[:me])
        factory = lambda: _PinnedExchanger(runtime, party, None, max_message_bytes)  # noqa: E731
        listener = await loop.create_server(factory, host=host, port=port, ssl=context, ssl_handshake_timeout=_HANDSHAKE_S)
    try:
        ends = time.monotonic() + deadline_s
        for pid in range(me + 1, len(party.names)):
            await _dial(runtime, party, pid, max_message_bytes, ends)
        await asyncio.wait_for(asyncio.shield(runtime.parties[me].protocol), max(0.0, ends - time.monotonic()))
    finally:
        if listener is not None:
            listener.close()
    runtime.start_time = time.time()


async def _dial(runtime, party: MpcParty, pid: int, max_message_bytes: int, ends: float) -> None:
    host, port = party.addresses[pid]
    context = _context(ssl.PROTOCOL_TLS_CLIENT, party, trusted=(party.certificates[pid],))
    name = party.names[pid]
    while True:
        try:
            await runtime._loop.create_connection(lambda: _PinnedExchanger(runtime, party, pid, max_message_bytes), host, port, ssl=context)
            return
        except ssl.SSLCertVerificationError:
            log.warning("refused %s:%d as %s: it did not present %s's pinned certificate", host, port, name, name)
        except OSError as error:
            log.debug("%s not reachable yet: %s", name, error)
        if time.monotonic() >= ends:
            raise asyncio.TimeoutError
        await asyncio.sleep(_RETRY_S)


def _context(purpose: ssl._SSLMethod, party: MpcParty, trusted: tuple[bytes, ...]) -> ssl.SSLContext:
    """TLS 1.3 with this tallier's own certificate, trusting exactly the ``trusted`` pins (self-signed, DER)."""
    context = ssl.SSLContext(purpose)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # the exact pin, checked on the certificate itself, is stricter than a name
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(party.certificate_file, party.key_file)
    context.load_verify_locations(cadata=b"".join(trusted))
    return context


class _PinnedExchanger(asyncoro.MessageExchanger):
    """MPyC's connection to one peer, which knows for sure which peer that is."""

    __slots__ = ("party", "limit")

    def __init__(self, runtime, party: MpcParty, peer_pid: int | None, limit: int) -> None:
        super().__init__(runtime, peer_pid)
        self.party = party
        self.limit = limit

    def connection_made(self, transport) -> None:
        if self.peer_pid is not None and _certificate(transport) != self.party.certificates[self.peer_pid]:
            log.warning("refused the connection to %s: not its pinned certificate", self.party.names[self.peer_pid])
            self.peer_pid = None
            transport.abort()
            return
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.bytes.extend(data)
        if self.peer_pid is None and not self._identify():
            return
        name, limit = self.party.names[self.peer_pid], self.limit
        while len(self.bytes) >= _HEADER.size:
            pc, size = _HEADER.unpack_from(self.bytes)
            if size > limit:
                return self._abort(f"{name} announced an MPC message of {size} bytes, more than the round's {limit}")
            if len(self.bytes) < _HEADER.size + size:
                break
            payload = _FromPeer(self.bytes[_HEADER.size : _HEADER.size + size])
            payload.sender = name
            del self.bytes[: _HEADER.size + size]
            waiting = self.buffers.pop(pc, None)
            if isinstance(waiting, asyncio.Future):
                waiting.set_result(payload)
            elif waiting is None:
                self.buffers[pc] = payload
            else:
                return self._abort(f"{name} sent two MPC messages for one step")
        unread = sum(len(b) for b in self.buffers.values() if isinstance(b, bytes)) + len(self.bytes)
        if unread > _BUFFERED_MESSAGES * limit:
            self._abort(f"{name} sent more than {_BUFFERED_MESSAGES} messages' worth ahead of the protocol")

    def _identify(self) -> bool:
        """A client's claimed party number, checked (module docstring, point 1); whether it is registered."""
        if len(self.bytes) < 2:
            return False
        runtime, claimed = self.runtime, int.from_bytes(self.bytes[:2], "little")
        refusal = None
        if not claimed < runtime.pid:
            refusal = f"claimed party {claimed}, which dials higher-numbered parties only"
        elif runtime.parties[claimed].protocol is not None:
            refusal = f"claimed party {claimed} ({self.party.names[claimed]}), which is connected already"
        elif _certificate(self.transport) != self.party.certificates[claimed]:
            refusal = f"claimed party {claimed} ({self.party.names[claimed]}) without its pinned certificate"
        if refusal:
            log.warning("refused an MPC connection from %s: it %s", _address(self.transport), refusal)
            self.transport.abort()
            self.bytes.clear()
            return False
        keys = 0 if runtime.options.no_prss else runtime._prss_keys_from_peer(claimed)
        if len(self.bytes) < 2 + keys:
            return False
        self.peer_pid = claimed
        if keys:
            runtime._prss_keys_from_peer(claimed, self.bytes[2 : 2 + keys])
        del self.bytes[: 2 + keys]
        runtime.set_protocol(claimed, self)
        return True

    def _abort(self, reason: str) -> None:
        _stop(self.runtime, reason)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer_pid is None or self.runtime.parties[self.peer_pid].protocol is not self:
            return  # refused before it was registered
        own = self.runtime.parties[self.runtime.pid].protocol
        if exc is not None or own.done():  # shutdown() gives this party a fresh future before connections close
            _stop(self.runtime, f"{self.party.names[self.peer_pid]} left the MPC before the round ended ({exc or 'connection closed'})")
            return
        self.runtime.unset_protocol(self.peer_pid)


_aborts: list[str] = []


def _stop(runtime, reason: str) -> None:
    """End the round now; ``tallier.mpc`` reports the first reason (``watch``)."""
    _aborts.append(reason)
    runtime._loop.stop()


def _certificate(transport) -> bytes | None:
    tls = transport.get_extra_info("ssl_object")
    return tls.getpeercert(binary_form=True) if tls is not None else None


def _address(transport) -> str:
    peer = transport.get_extra_info("peername")
    return "%s:%s" % peer[:2] if peer else "an unknown address"


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"names {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("holds a persistent reference")


def _data_only(data: bytes):
    """``pickle.loads`` for a peer's bytes: plain data, never a global (so never code)."""
    try:
        return _NoGlobals(io.BytesIO(data)).load()
    except Exception as error:  # any failure to parse a peer's bytes is the peer's
        raise MpcPeerError(f"{_sender(data)} sent an MPC message that is not plain data ({error})") from None


def _field_elements(cls, data: bytes) -> list[int]:
    """``FiniteFieldElement.from_bytes``, refusing anything but whole elements of the field."""
    width = cls.byte_length
    if len(data) % width:
        raise MpcPeerError(f"{_sender(data)} sent {len(data)} bytes, not a whole number of {width}-byte field elements")
    values = [int.from_bytes(data[i : i + width], "little") for i in range(0, len(data), width)]
    if values and max(values) >= cls.order:
        raise MpcPeerError(f"{_sender(data)} sent a value outside the field")
    return values


def _sender(data: bytes) -> str:
    return getattr(data, "sender", "a peer")
