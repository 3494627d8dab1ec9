"""The talliers' box keys for a voting run: asked for once every tallier joined, checked again whenever
one comes back, and waited for after an interrupted MPC.

Each tallier answers the run's ``VotingWelcome`` with ``RunKey``, its box key for the run certified by
its identity key; the hospitals seal their ballots' shares to those keys, so a tallier that comes back
(restarted, or cut off) must come back with the very same key, or the ballots sealed to it could never
be opened and the run stops. A tallier that says Hello mid-run is welcomed again wherever the server
waits (``Participants.intercept``); once it answered with its key it is ``rejoined``, and the server
relays it the round's boxes again.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from consilium.protocol.run.participants import Participants, Timeouts
from consilium.protocol.wire.messages import Hello, Labels, Message, ProtocolError, RunKey, TallyFailed, VotingWelcome

__all__ = ["TallierKeys"]

log = logging.getLogger("consilium.voting_server")


class TallierKeys:
    """The run's talliers, the box key each answered with, and which came back since the boxes were relayed."""

    def __init__(
        self,
        participants: Participants,
        talliers: tuple[str, ...],
        welcome: Callable[[], VotingWelcome],
        timeouts: Timeouts,
    ) -> None:
        self._participants, self._talliers, self._welcome, self._timeouts = participants, talliers, welcome, timeouts
        self.keys: dict[str, bytes] = {}
        self.rejoined: set[str] = set()  # back with their key since the boxes were last relayed
        self._returning: set[str] = set()  # said Hello again and owe their box key

    def ask(self) -> dict[str, bytes]:
        """Send every tallier the run; the box key each answers with (``ProtocolError`` if one refuses or is late)."""
        parties = self._participants.parties
        welcome = self._welcome()
        for name in self._talliers:
            parties.send(name, welcome)
        keys: dict[str, bytes] = {}
        deadline = time.monotonic() + self._timeouts.key_s
        while set(keys) != set(self._talliers) and (got := parties.next_message(deadline)) is not None:
            sender, message = got
            if isinstance(message, TallyFailed) and sender in self._talliers and message.round == 0:
                raise ProtocolError(f"{sender} refuses the run: {message.reason}")
            if not isinstance(message, RunKey) or sender not in self._talliers or sender in keys:
                parties.reject(sender, message, "expected a tallier's box key")
            else:
                keys[sender] = message.certified_key  # the hospitals check it against the tallier's identity
        if set(keys) != set(self._talliers):
            raise ProtocolError(f"the talliers {sorted(set(self._talliers) - set(keys))} sent no box key in time")
        return keys

    def ask_again(self) -> None:
        """After the server's restart: every tallier must answer with the box key the run has."""
        self._refuse_changed(self.ask())

    def _refuse_changed(self, keys: dict[str, bytes]) -> None:
        """``ProtocolError`` naming the talliers that came back with another box key than the run's: their
        sealed run state was lost, and the ballots sealed to them cannot be opened."""
        changed = sorted(name for name, key in keys.items() if key != self.keys[name])
        if changed:
            raise ProtocolError(
                f"{', '.join(changed)} came back with another box key than the run's (sealed run state lost): "
                "the ballots sealed to them cannot be opened"
            )

    def relayed(self) -> None:
        """The boxes went out: a tallier rejoins from here on by coming back again."""
        self.rejoined = set()

    def returns(self, sender: str, message: Message) -> bool:
        """A tallier that says Hello mid-run (restarted, or cut off) is welcomed again and must answer with the
        box key it had; True where ``message`` was that exchange."""
        if sender not in self._talliers:
            return False
        if isinstance(message, Hello):
            log.warning("%s connected again; it is welcomed back to the run", sender)
            self._returning.add(sender)
            self._participants.parties.send(sender, self._welcome())
            return True
        if sender not in self._returning:
            return False
        if isinstance(message, TallyFailed) and message.round == 0:
            raise ProtocolError(f"{sender} refuses the run it joined again: {message.reason}")
        if not isinstance(message, RunKey):
            return False
        self._returning.discard(sender)
        self._refuse_changed({sender: message.certified_key})
        self.rejoined.add(sender)
        log.warning("%s is back in the run with its box key", sender)
        return True

    def await_back(self, silent: set[str], round_number: int, claims: dict[str, dict[str, bytes]]) -> None:
        """Wait until every tallier in ``silent`` is ready for the round again: back with its box key, or
        alive after all (its answer arrives late, and its signed disputes go to ``claims``). ``ProtocolError``
        after twice the round timeout (a tallier waits out its own MPC timeout before it answers)."""
        late: set[str] = set()

        def waiting() -> bool:
            return not silent <= late | self.rejoined

        wait_s = 2 * self._timeouts.round_s
        deadline = time.monotonic() + wait_s
        while waiting() and (got := self._participants.next_message(deadline, waiting)) is not None:
            sender, message = got
            if (
                isinstance(message, (Labels, TallyFailed))
                and sender in silent
                and message.round == round_number
                and not (isinstance(message, TallyFailed) and message.deviated)
            ):
                late.add(sender)
                if isinstance(message, TallyFailed) and message.disputes:
                    claims[sender] = message.disputes
            elif isinstance(message, TallyFailed) and message.deviated and message.round == round_number:
                raise ProtocolError(f"round {round_number}: no labels: {message.reason}; the run stops")
            else:
                self._participants.parties.reject(sender, message, f"round {round_number} waits for the talliers")
        if waiting():
            raise ProtocolError(
                f"round {round_number}: {', '.join(sorted(silent - late - self.rejoined))} did not come back within "
                f"{wait_s:g} s; no label of the round is released"
            )
