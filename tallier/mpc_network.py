"""MPyC's network, held to the roster: pinned certificates, one connection per party, no code from peers.

MPyC 0.11 trusts its peers further than Consilium may:

- ``Runtime.start`` listens on every interface and lets in any client whose certificate chains to
  a shared authority; the client's party number is the first two bytes it sends, checked against
  nothing, so one certificate can claim several parties or displace one;
- secure arrays travel as pickles (``_distribute``, ``output``, ``_reshare``), and ``transfer``,
  which ``shutdown`` calls, unpickles whatever a peer sent: a crafted pickle runs code here;
- a message may announce up to 4 GiB, and is buffered whole.

This module and ``tallier.mpc_values`` replace those parts, and nothing else of MPyC. A round's
``MpcNetwork``:

1. **Connects** (``connect``, instead of ``Runtime.start``): it listens on this tallier's own
   address only (the roster's, or ``MpcParty.listen`` behind a NAT or in a container), TLS 1.3 with the certificates the roster pins. The listener trusts the pins of
   lower-numbered parties only; a client trusts only the pin of the party it dials and checks that
   the listener presented exactly it. A client's claimed number must be lower than the listener's,
   not connected yet, and its certificate exactly that party's pin, or the connection is dropped
   and logged (the real party can still connect); at most ``_STRANGERS`` connections may be
   unidentified at once, each for at most ``_HANDSHAKE_S``. A connection this tallier dialled that
   ends before every peer is in (it reached a peer still ending the round before, say) is dialled
   again until the deadline. Once every peer is connected, the listener closes.
2. **Decodes only data** (``tallier.mpc_values``): where MPyC would pickle, it gets a codec of
   field elements below the round's modulus, or one integer; nothing a peer sends is unpickled.
3. **Bounds what a peer sends**: a message of at most the round's ``max_message_bytes``, and at
   most ``_BUFFERED_MESSAGES`` messages and 16 more a hospital of the run (each counted at ``_MESSAGE_COST``
   bytes at least) waiting
   unread, within ``_BUFFERED_LIMITS`` of the round's largest messages or ``_BUFFERED_BYTES``,
   whichever is more (a round's inputs, every ballot's bits, make one message far larger than the
   rest).
4. **Opens values from every share, checked** (``tallier.mpc_values.open_checked``, instead of
   ``Runtime.output``): each tallier takes a value only once all ``J`` shares lie on one polynomial
   of degree ``t``, so a peer's wrong share ends the round.
5. **Ends a round on the first failure, and says whose**: a peer that breaks 2 or 3, leaves before
   the round is over, or whose message makes one of MPyC's steps fail, stops the event loop at
   once; this tallier then tells its peers why (``_ABORT``), so that each names the cause rather
   than "a peer left". ``aborts`` holds the reasons; ``tallier.mpc`` reports the first. A fault of this
   machine's in a step (``_LOCAL_FAULTS``: out of memory, say) is told as its own, never as a peer's.

What a tallier computes inside MPyC between the inputs and the openings (its part of each
multiplication's resharing, of the comparisons' random bits) is checked by the MAC checks of
``tallier.authenticated``, not here.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from consilium.crypto.mpc_field import MIN_PARTIES, import_mpyc
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.tallier.mpc_values import MpcPeerError

import_mpyc()
from mpyc import asyncoro  # noqa: E402  (imported safely on the line above)

__all__ = ["MpcNetwork", "MpcParty", "mpc_party"]

log = logging.getLogger("consilium.mpc")


def _not_a_write_after_a_peer_left(record: logging.LogRecord) -> bool:
    """asyncio warns of every write to a connection already lost. MPyC may have several sends under way when a
    peer aborts the round; the round ends with the ``MpcError`` that says why, and the warnings add nothing."""
    return record.getMessage() != "socket.send() raised exception."


logging.getLogger("asyncio").addFilter(_not_a_write_after_a_peer_left)

_HEADER = struct.Struct("<qI")  # MPyC's framing: program counter, payload size
_ABORT = -(2**63)  # a program counter MPyC never uses (its counters are hashes): "I abort the round, because..."
_ABORT_TEXT = 300
_LOCAL_FAULTS = (MemoryError, OSError, RecursionError)  # this machine's own (a peer's bytes are bounded data)
_BUFFERED_MESSAGES = 4096  # and 16 more a hospital: step 4 reshares about ten values a ballot, each its own message
_BUFFERED_LIMITS = 4
_BUFFERED_BYTES = 256 << 20
_MESSAGE_COST = 256  # what a buffered message costs at least, in memory
_STRANGERS = 64
_HANDSHAKE_S = 5.0
_RETRY_S = 0.1


@dataclass(frozen=True)
class MpcParty:
    """One tallier in the MPC: every tallier in party order, as the roster pins them, and its own keys."""

    index: int  # 0-based, as MPyC numbers parties
    names: tuple[str, ...]
    addresses: tuple[tuple[str, int], ...]  # (host, port) where each listens
    certificates: tuple[bytes, ...]  # DER, pinned by the roster
    certificate_file: Path  # this tallier's own certificate (PEM) and key
    key_file: Path
    listen: tuple[str, int] | None = None  # where this tallier listens, where that is not its roster address

    def __post_init__(self) -> None:
        if len(self.addresses) < MIN_PARTIES:
            raise ValueError(
                f"the MPC needs at least {MIN_PARTIES} talliers for an honest majority, got {len(self.addresses)}"
            )
        if not len(self.names) == len(self.addresses) == len(self.certificates):
            raise ValueError("every tallier needs a name, an address and a pinned certificate")
        if not 0 <= self.index < len(self.addresses):
            raise ValueError(f"tallier index {self.index} is not one of the {len(self.addresses)} talliers")


class _FromPeer(bytes):
    """A payload as it arrived, with the name of the tallier that sent it (which ``tallier.mpc_values`` names
    in a refusal)."""

    sender: str


def mpc_party(roster: Roster, credentials: Credentials, listen: tuple[str, int] | None = None) -> MpcParty:
    """This tallier's place in the MPC, as the roster lists the talliers and pins their certificates; it listens
    on ``listen`` where that is not the address the roster gives its peers."""
    names = tuple(roster.talliers)
    return MpcParty(
        index=names.index(credentials.name),
        names=names,
        addresses=tuple(roster.party(name).mpc_address for name in names),
        certificates=tuple(roster.party(name).mpc_certificate for name in names),
        certificate_file=credentials.mpc_certificate_file,
        key_file=credentials.mpc_key_file,
        listen=listen,
    )


class MpcNetwork:
    """One round's connections among the talliers (the module docstring's points 1, 3 and 5)."""

    def __init__(self, runtime, party: MpcParty, *, max_message_bytes: int, hospitals: int = 0) -> None:
        self.runtime, self.party, self.limit = runtime, party, max_message_bytes
        self.max_messages = _BUFFERED_MESSAGES + 16 * hospitals  # messages a peer may have waiting unread
        self.aborts: list[str] = []
        self.caught: list[str] = []  # what a peer sent that no honest tallier sends, seen here (not told by a peer)
        self.connected = False  # every peer once: from then on a connection that ends ends the round
        self.strangers = 0  # connections accepted whose party is not known yet
        self._ends = 0.0  # when connecting gives up (time.monotonic)
        self._redials: list[asyncio.Task] = []  # dials made again: referenced, so that they run to their end
        runtime._loop.set_exception_handler(self._exception)

    async def connect(self, deadline_s: float) -> None:
        """Connect to every other tallier; ``asyncio.TimeoutError`` if that cannot be done within ``deadline_s``."""
        runtime, party, loop, me = self.runtime, self.party, self.runtime._loop, self.runtime.pid
        for peer in runtime.parties:
            peer.protocol = asyncio.Future(loop=loop) if peer.pid == me else None
        listener = None
        if me:
            host, port = party.listen or party.addresses[me]
            context = _context(ssl.PROTOCOL_TLS_SERVER, party, trusted=party.certificates[:me])
            listener = await loop.create_server(
                lambda: _PinnedExchanger(self, None),
                host=host,
                port=port,
                ssl=context,
                ssl_handshake_timeout=_HANDSHAKE_S,
            )
        try:
            ends = self._ends = time.monotonic() + deadline_s
            for pid in range(me + 1, len(party.names)):
                await self._dial(pid, ends)
            await asyncio.wait_for(asyncio.shield(runtime.parties[me].protocol), max(0.0, ends - time.monotonic()))
        finally:
            if listener is not None:
                listener.close()
        self.connected = True
        runtime.start_time = time.time()

    async def _dial(self, pid: int, ends: float) -> None:
        party = self.party
        (host, port), name = party.addresses[pid], party.names[pid]
        context = _context(ssl.PROTOCOL_TLS_CLIENT, party, trusted=(party.certificates[pid],))
        while True:
            try:
                await self.runtime._loop.create_connection(lambda: _PinnedExchanger(self, pid), host, port, ssl=context)
                return
            except ssl.SSLCertVerificationError:
                log.warning("refused %s:%d as %s: it did not present %s's pinned certificate", host, port, name, name)
            except OSError as error:
                log.debug("%s not reachable yet: %s", name, error)
            if time.monotonic() >= ends:
                raise asyncio.TimeoutError
            await asyncio.sleep(_RETRY_S)

    def dial_again(self, pid: int) -> None:
        """Dial party ``pid`` anew, in the background, until the connection deadline: its connection ended
        before every peer was in (the round's own deadline still bounds the wait)."""

        async def dial() -> None:
            try:
                await self._dial(pid, self._ends)
            except asyncio.TimeoutError:
                pass  # connect's own wait ends the round at the same deadline

        self._redials.append(self.runtime._loop.create_task(dial()))

    def stop(self, reason: str, *, tell_peers: bool = True) -> None:
        """End the round now, and (unless the reason came from a peer) tell every connected peer why."""
        self.aborts.append(reason)
        if tell_peers and len(self.aborts) == 1:
            notice = reason.encode("utf-8", "replace")[:_ABORT_TEXT]
            for peer in self.runtime.parties:
                if isinstance(peer.protocol, _PinnedExchanger) and not peer.protocol.transport.is_closing():
                    peer.protocol.send(_ABORT, notice)
        self.runtime._loop.stop()

    def _exception(self, loop, context: dict) -> None:
        """An exception in one of MPyC's steps (which MPyC would print as a traceback) ends the round;
        one about a single connection (say, out of descriptors on accept) is logged and does not."""
        error, in_a_step = context.get("exception"), "mpc_coro" in str(context.get("message"))
        if isinstance(error, MpcPeerError):
            self.caught.append(str(error))
            self.stop(str(error))
        elif in_a_step and isinstance(error, _LOCAL_FAULTS):  # a retry, as silence would have: not a deviation
            self.stop(f"this tallier failed in a step of the MPC: {error!r}")
        elif error is not None and in_a_step:  # one of MPyC's coroutines failed
            self.caught.append(f"a step of the MPC failed on a peer's message (of the wrong size?): {error!r}")
            self.stop(self.caught[-1])
        elif error is not None:
            log.warning("the MPC's event loop: %s (%r)", context.get("message"), error)
        else:  # e.g. a pending task collected after the round stopped
            log.debug("the MPC's event loop: %s", context.get("message"))


class _PinnedExchanger(asyncoro.MessageExchanger):
    """MPyC's connection to one peer, which knows for sure which peer that is."""

    __slots__ = ("network", "unread", "stored", "counted")

    def __init__(self, network: MpcNetwork, peer_pid: int | None) -> None:
        super().__init__(network.runtime, peer_pid)
        self.network = network
        self.unread = 0  # bytes a peer sent that the protocol has not read yet, each message at _MESSAGE_COST at least
        self.stored = 0  # messages a peer sent that wait unread (not this tallier's own pending reads, also in buffers)
        self.counted = False  # among the network's strangers

    def connection_made(self, transport) -> None:
        network = self.network
        if self.peer_pid is not None:  # this tallier dialled: the listener's pin, once more, exactly
            if _certificate(transport) != network.party.certificates[self.peer_pid]:
                log.warning(
                    "refused the connection to %s: not its pinned certificate", network.party.names[self.peer_pid]
                )
                self.peer_pid = None
                transport.abort()
                return
            super().connection_made(transport)
            return
        self.transport = transport
        if network.strangers >= _STRANGERS:
            log.warning(
                "refused an MPC connection from %s: %d are unidentified already", _address(transport), _STRANGERS
            )
            transport.abort()
            return
        network.strangers += 1
        self.counted = True

    def data_received(self, data: bytes) -> None:
        self.bytes.extend(data)
        if self.peer_pid is None and not self._identify():
            return
        name, limit = self.network.party.names[self.peer_pid], self.network.limit
        while len(self.bytes) >= _HEADER.size:
            pc, size = _HEADER.unpack_from(self.bytes)
            if size > limit:
                return self._abort(f"{name} announced an MPC message of {size} bytes, more than the round's {limit}")
            if len(self.bytes) < _HEADER.size + size:
                break
            payload = _FromPeer(self.bytes[_HEADER.size : _HEADER.size + size])
            payload.sender = name
            del self.bytes[: _HEADER.size + size]
            if pc == _ABORT:
                text = "".join(c if c.isprintable() else "?" for c in payload.decode("utf-8", "replace"))[:_ABORT_TEXT]
                return self.network.stop(f"{name} aborted the round: {text}", tell_peers=False)
            waiting = self.buffers.pop(pc, None)
            if isinstance(waiting, asyncio.Future):
                waiting.set_result(payload)
            elif waiting is None:
                self.buffers[pc] = payload
                self.unread += _cost(payload)
                self.stored += 1
            else:
                return self._abort(f"{name} sent two MPC messages for one step")
        buffered = max(_BUFFERED_LIMITS * limit, _BUFFERED_BYTES)
        if self.stored > self.network.max_messages or self.unread + len(self.bytes) > buffered:
            self._abort(f"{name} sent more MPC messages ahead of the protocol than an honest tallier does")

    def receive(self, pc: int):
        """MPyC's read of the message for step ``pc`` (a Future until it arrives), keeping the count of unread bytes."""
        payload = self.buffers.pop(pc, None)
        if payload is None:
            payload = self.buffers[pc] = asyncio.Future(loop=self.runtime._loop)
        elif isinstance(payload, bytes):
            self.unread -= _cost(payload)
            self.stored -= 1
        return payload

    def _identify(self) -> bool:
        """A client's claimed party number, checked (module docstring, point 1); whether it is registered."""
        if len(self.bytes) < 2:
            return False
        runtime, names, claimed = self.runtime, self.network.party.names, int.from_bytes(self.bytes[:2], "little")
        refusal = None
        if not claimed < runtime.pid:
            refusal = f"claimed party {claimed}, which dials higher-numbered parties only"
        elif runtime.parties[claimed].protocol is not None:
            refusal = f"claimed party {claimed} ({names[claimed]}), which is connected already"
        elif _certificate(self.transport) != self.network.party.certificates[claimed]:
            refusal = f"claimed party {claimed} ({names[claimed]}) without its pinned certificate"
        if refusal:
            log.warning("refused an MPC connection from %s: it %s", _address(self.transport), refusal)
            self.transport.abort()
            self.bytes.clear()
            return False
        keys = 0 if runtime.options.no_prss else runtime._prss_keys_from_peer(claimed)
        if len(self.bytes) < 2 + keys:
            return False
        self.peer_pid = claimed
        self._uncount()
        if keys:
            runtime._prss_keys_from_peer(claimed, self.bytes[2 : 2 + keys])
        del self.bytes[: 2 + keys]
        runtime.set_protocol(claimed, self)
        return True

    def _uncount(self) -> None:
        if self.counted:
            self.counted = False
            self.network.strangers -= 1

    def _abort(self, reason: str) -> None:
        """End the round for what this peer sent, which no honest tallier sends."""
        self.network.caught.append(reason)
        self.network.stop(reason)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._uncount()
        runtime, network = self.runtime, self.network
        if self.peer_pid is None or runtime.parties[self.peer_pid].protocol is not self:
            return  # refused before it was registered
        name = network.party.names[self.peer_pid]
        if not network.connected:  # not every peer is in yet: its place opens again, and the round waits on
            runtime.parties[self.peer_pid].protocol = None
            log.warning("%s's MPC connection ended before every tallier was connected (%s)", name, exc or "closed")
            if (
                self.peer_pid > runtime.pid
            ):  # this tallier dialled it (say, the listener of a round the peer was ending)
                network.dial_again(self.peer_pid)
            return
        own = runtime.parties[runtime.pid].protocol
        waiting = any(isinstance(b, asyncio.Future) and not b.done() for b in self.buffers.values())
        if (
            exc is not None or own.done() or waiting
        ):  # shutdown() gives this party a fresh future before connections close
            network.stop(f"{name} left the MPC before the round ended ({exc or 'connection closed'})")
            return
        runtime.unset_protocol(self.peer_pid)


def _cost(payload: bytes) -> int:
    return _HEADER.size + max(len(payload), _MESSAGE_COST)


def _context(purpose: ssl._SSLMethod, party: MpcParty, trusted: tuple[bytes, ...]) -> ssl.SSLContext:
    """TLS 1.3 with this tallier's own certificate, trusting exactly the ``trusted`` pins (self-signed, DER)."""
    context = ssl.SSLContext(purpose)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # the exact pin, checked on the certificate itself, is stricter than a name
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(party.certificate_file, party.key_file)
    context.load_verify_locations(cadata=b"".join(trusted))
    return context


def _certificate(transport) -> bytes | None:
    tls = transport.get_extra_info("ssl_object")
    return tls.getpeercert(binary_form=True) if tls is not None else None


def _address(transport) -> str:
    peer = transport.get_extra_info("peername")
    return "%s:%s" % peer[:2] if peer else "an unknown address"
