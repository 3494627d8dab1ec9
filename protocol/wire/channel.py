"""A party's channel to the server (``ServerChannel``) and the server's to its parties (``PartyChannels``):
send a message, or wait, with a deadline, for one of the kinds expected.

What the server sends is decoded for the receiving role (``accept``) within the size limit of the
run (``limit``, raised once the run's settings are known). A message that fails to decode, or is
not one the caller waits for, is logged as rejected and skipped; a ``Finish`` the caller does not
wait for ends the wait with ``ProtocolError``, as does the deadline. With a ``Transcript``, every
message is recorded as it arrives, before anything reads it. ``PartyChannels`` also charges
each rejection to its sender's rate limit (``ServerTransport.reject``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, TypeVar

from consilium.protocol.run.rules import (
    MAX_MESSAGE_BYTES,
)  # until the run's settings, and so its largest message, are known
from consilium.errors import ConsiliumError
from consilium.protocol.wire.messages import Finish, Hello, Message, MessageError, ProtocolError, Withdraw
from consilium.protocol.wire.codec import decode, encode
from consilium.protocol.wire.rejections import RejectionLog
from consilium.protocol.wire.transcript import Transcript
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.wire.transport import ClientTransport, Reconnected, ServerTransport, TransportError

__all__ = ["STOPPED", "PartyChannels", "ServerChannel", "Stopped"]

M = TypeVar("M", bound=Message)
STOPPED = "its operator stopped its service"  # the reason a stopped service withdraws with, and returns
_STOP_POLL_S = 1.0  # how long a wait may go on unchecked after a stop


class Stopped(ConsiliumError):
    """This party's operator stopped it (a service's SIGTERM) while it waited."""


class ServerChannel:
    def __init__(
        self,
        transport: ClientTransport,
        *,
        accept: frozenset[type],
        limit: int,
        timeout_s: float,
        log: logging.Logger,
        transcript: Transcript | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.transport = transport
        self.transcript = transcript
        self.stop = stop  # set by a service's SIGTERM: every wait ends within _STOP_POLL_S
        self.limit = limit
        self.rejections = RejectionLog(log)
        self._log = log
        self._accept = accept
        self._timeout_s = timeout_s

    @classmethod
    def connect(
        cls,
        roster: Roster,
        credentials: Credentials,
        *,
        accept: frozenset[type],
        timeout_s: float,
        log: logging.Logger,
        transcript: Transcript | None = None,
        transport: ClientTransport | None = None,
        stop: threading.Event | None = None,
    ) -> "ServerChannel":
        """A channel to the roster's server, authenticated with ``credentials``; over ``transport`` where one
        is given (a test's in-process one, say)."""
        if transport is None:
            address, server_key = roster.server_address, roster.server.curve_public
            transport = ClientTransport(address, server_key, credentials.curve, MAX_MESSAGE_BYTES)
        return cls(
            transport,
            accept=accept,
            limit=MAX_MESSAGE_BYTES,
            timeout_s=timeout_s,
            log=log,
            transcript=transcript,
            stop=stop,
        )

    def send(self, message: Message) -> None:
        self.transport.send(encode(message))

    def wait_until(self, when: float) -> float:
        """Wait until ``when`` (``time.monotonic``); returns how many seconds past it it was already (0 if not)."""
        wait = when - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return max(0.0, -wait)

    def wait_at_least(self, seconds: float) -> None:
        """Wait up to ``seconds`` for each message from now on, where that is longer than the wait so far."""
        self._timeout_s = max(self._timeout_s, seconds)

    def take_part(self, welcome: type[M], take_part: Callable[[M], str], name: str, welcomed: M | None = None) -> str:
        """Say Hello, then ``take_part`` in the run that the ``welcome`` offers, until it returns why the run
        ended; ``welcomed`` is a Welcome that already came on this connection, after the Hello a service
        said (``orchestration.hospital_service``). If the connection to the server is made again (the
        server restarted, say), what was in flight is lost and the server may have forgotten this party:
        it says Hello again, and takes part from the next ``welcome`` on. Where this party's operator
        stops it (``stop``), it withdraws from the run, and says so."""
        if welcomed is None:
            self.send(Hello())
        try:
            while True:
                try:
                    return take_part(welcomed if welcomed is not None else self.expect(welcome))
                except Reconnected:
                    self._log.warning("%s: the connection to the server was made again; joining again", name)
                    self.send(Hello())
                    welcomed = None
        except Stopped:
            with contextlib.suppress(TransportError):  # leaving is what matters, not whether the server hears it
                self.send(Withdraw(round=0, reason=STOPPED))
            self._log.warning("%s: %s; it withdrew from the run", name, STOPPED)
            return STOPPED

    def expect(self, *types: type[M]) -> M:
        """The next message of one of ``types``; others are logged and skipped. Times out."""
        deadline = time.monotonic() + self._timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            payload = self.transport.receive(remaining if self.stop is None else min(remaining, _STOP_POLL_S))
            if self.stop is not None and self.stop.is_set():
                raise Stopped(STOPPED)
            if payload is None:
                if self.stop is None:  # the whole wait passed (a slice of it, where a stop is polled)
                    break
                continue
            if self.transcript:
                self.transcript.record("server", payload)
            try:
                message = decode(payload, accept=self._accept, max_bytes=self.limit)
            except MessageError as error:
                self.rejections.reject("the server", "a message", str(error))
                continue
            if isinstance(message, Finish) and Finish not in types:
                raise ProtocolError(f"the server ended the run: {message.reason}")
            if isinstance(message, types):
                return message
            self.rejections.reject("the server", message.TYPE, "not expected now")
        raise ProtocolError(f"no {' or '.join(t.TYPE for t in types)} from the server within {self._timeout_s:g} s")

    def close(self) -> None:
        self.transport.close()
        if self.transcript:
            self.transcript.close()


class PartyChannels:
    def __init__(
        self,
        transport: ServerTransport,
        *,
        accept: frozenset[type],
        limit: int,
        log: logging.Logger,
        transcript: Transcript | None,
    ) -> None:
        self.rejections = RejectionLog(log)
        self._transport = transport
        self._accept = accept
        self._limit = limit
        self._transcript = transcript

    def next_message(self, deadline: float) -> tuple[str, Message] | None:
        """The next valid message and its sender before ``deadline`` (``time.monotonic``), or None once it passes."""
        while (remaining := deadline - time.monotonic()) > 0:
            got = self._transport.receive(remaining)
            if got is None:
                return None
            sender, payload = got
            if self._transcript:
                self._transcript.record(sender, payload)
            try:
                return sender, decode(payload, accept=self._accept, max_bytes=self._limit)
            except MessageError as error:
                self.reject(sender, None, str(error))
        return None

    def reject(self, sender: str, message: Message | None, reason: str) -> None:
        self.rejections.reject(sender, message.TYPE if message else "a message", reason)
        self._transport.reject(sender)

    def send(self, name: str, message: Message) -> None:
        self._transport.send(name, encode(message))
