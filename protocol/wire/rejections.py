"""Counting rejected messages without letting a flood of them fill the log.

Each party's first ``LOGGED_IN_FULL`` rejections are logged in full, then every thousandth with its
count; the counts themselves are exact. What a line quotes from a peer is already short and
printable (``protocol.wire.messages``).
"""

from __future__ import annotations

import logging
from collections import defaultdict

__all__ = ["LOGGED_IN_FULL", "RejectionLog"]

LOGGED_IN_FULL = 20
_THEN_EVERY = 1000


class RejectionLog:
    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self.by_party: dict[str, int] = defaultdict(int)

    @property
    def total(self) -> int:
        return sum(self.by_party.values())

    def reject(self, party: str, what: str, reason: str) -> None:
        self.by_party[party] += 1
        count = self.by_party[party]
        if count <= LOGGED_IN_FULL or count % _THEN_EVERY == 0:
            self._log.warning("rejected %s from %s: %s (rejection %d from %s)", what, party, reason, count, party)
        if count == LOGGED_IN_FULL:
            self._log.warning("further rejections from %s are logged once every %d", party, _THEN_EVERY)
