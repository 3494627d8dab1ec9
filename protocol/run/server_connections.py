"""A server's connections, as both servers open them: the socket, open to the run's parties only, its
transcript, and who takes part."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.run.participants import Participants
from consilium.protocol.run.rules import ConfigError
from consilium.protocol.wire.channel import PartyChannels
from consilium.protocol.wire.transcript import Transcript
from consilium.protocol.wire.transport import DEFAULT_MAX_MESSAGES_PER_SECOND, ServerTransport

__all__ = ["ServerConnections"]


@dataclass
class ServerConnections:
    transport: ServerTransport
    transcript: Transcript | None
    participants: Participants

    @classmethod
    def open(
        cls,
        roster: Roster,
        credentials: Credentials,
        *,
        hospitals: tuple[str, ...],
        others: tuple[str, ...] = (),
        accept: frozenset,
        limit: int,
        log: logging.Logger,
        transcript: Path | None = None,
        transcript_payloads: bool = True,
        max_messages_per_second: float = DEFAULT_MAX_MESSAGES_PER_SECOND,
        listen: str | None = None,
        transport: ServerTransport | None = None,
    ) -> "ServerConnections":
        """Listen for ``hospitals`` and ``others`` (talliers), and no one else, on ``listen``: by default the
        address the roster names, which is where the parties connect; behind a NAT, in a container or
        behind a load balancer, the local address that reaches (or take ``transport``, a test's
        in-process one, say, or a coordinator's, which must take messages of ``limit`` bytes). With a transcript of every message at ``transcript``, payloads included
        unless told otherwise."""
        if transport is None:
            enrolled = {roster.party(name).curve_public: name for name in (*hospitals, *others)}
            rate, address = max_messages_per_second, listen or roster.server_address
            transport = ServerTransport(address, credentials.curve, enrolled, limit, rate)
        elif limit > transport.max_message_bytes:
            raise ConfigError(
                f"the run's messages take up to {limit:,} bytes, more than the {transport.max_message_bytes:,} its "
                "server's socket takes"
            )
        record = Transcript(transcript, payloads=transcript_payloads, max_payload_bytes=limit) if transcript else None
        parties = PartyChannels(transport, accept=accept, limit=limit, log=log, transcript=record)
        return cls(transport, record, Participants(parties, hospitals, log))

    def report(self) -> dict:
        """What a server's report says of its connections and of who came and went."""
        participants, transport = self.participants, self.transport
        return {
            "rejected_messages": participants.parties.rejections.total,
            "dropped_messages_over_rate": dict(transport.dropped),
            "connection_limits": transport.limits,
            "transcript_records_lost": self.transcript.lost if self.transcript else 0,
            "departures": participants.departures,
            "expelled": sorted(participants.expelled),
            "joins": participants.joins,
            "bytes_received": dict(transport.bytes_received),
            "bytes_sent": dict(transport.bytes_sent),
        }

    def close(self) -> None:
        self.transport.close()
        if self.transcript:
            self.transcript.close()
