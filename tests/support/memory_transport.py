"""Transports in memory, so that a server and its hospitals run as threads of one process.

They stand in for ZeroMQ and CurveZMQ only (``protocol.wire.transport``): every message is still
encoded, decoded and checked by the roles' own channels, and every round runs on real SEAL. A test
that claims anything of the transport itself (authentication, rate limits, reconnection) uses the
real one, between processes.
"""

from __future__ import annotations

import queue
from collections import defaultdict


class MemoryNetwork:
    """One server and any number of named parties, each with an inbox."""

    def __init__(self) -> None:
        self.server_inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.inboxes: dict[str, queue.Queue[bytes]] = defaultdict(queue.Queue)

    def server(self) -> MemoryServerTransport:
        return MemoryServerTransport(self)

    def client(self, name: str) -> MemoryClientTransport:
        return MemoryClientTransport(self, name)


class MemoryServerTransport:
    """``ServerTransport``'s interface, over a ``MemoryNetwork``."""

    def __init__(self, network: MemoryNetwork) -> None:
        self._network = network
        self.bytes_received: dict[str, int] = defaultdict(int)
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.dropped: dict[str, int] = defaultdict(int)
        self.limits: dict = {}
        self.max_message_bytes = 1 << 40  # no socket between: the run's own limit, the codec's, is what holds

    def receive(self, timeout_s: float) -> tuple[str, bytes] | None:
        try:
            party, payload = self._network.server_inbox.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None
        self.bytes_received[party] += len(payload)
        return party, payload

    def send(self, party: str, payload: bytes) -> bool:
        self._network.inboxes[party].put(payload)
        self.bytes_sent[party] += len(payload)
        return True

    def reject(self, party: str) -> None:
        """(The real transport charges the party's rate here.)"""

    def close(self) -> None:
        pass


class MemoryClientTransport:
    """``ClientTransport``'s interface, over a ``MemoryNetwork``, as party ``name``."""

    def __init__(self, network: MemoryNetwork, name: str) -> None:
        self._network, self._name = network, name
        self.bytes_received = 0
        self.bytes_sent = 0

    def send(self, payload: bytes) -> None:
        self._network.server_inbox.put((self._name, payload))
        self.bytes_sent += len(payload)

    def receive(self, timeout_s: float) -> bytes | None:
        try:
            payload = self._network.inboxes[self._name].get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None
        self.bytes_received += len(payload)
        return payload

    def close(self) -> None:
        pass
