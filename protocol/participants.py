"""Who takes part in a server's run, and how every run ends: shared by the training and voting servers.

``Participants`` owns the server's channel to its parties (``protocol.channel.PartyChannels``) and
the membership of the run: the hospitals that take part in rounds (``active``), those that said
Hello and wait to be welcomed (``joining``), the ones that left and why (``departures``), and
when each joined after the start (``joins``). Once rounds are open (``open_rounds``), a Hello
from a hospital of the run means it joins again: it leaves the round under way and is welcomed
before the next one, at most ``MAX_JOINS_AGAIN`` times, since each join mid-round costs every
contributor a round's charge.

``run_to_the_end`` is the one skeleton of a server's ``run``: whatever ends it (the last round, too
few hospitals, a protocol error, a bug or an interrupt), everyone still in the run is sent
``Finish`` with the reason, and the report is written, failing the run only if it had not
already failed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

from protocol.channel import PartyChannels
from protocol.checkpoint import write_at_the_end
from protocol.messages import Finish, Hello, Message, ProtocolError

__all__ = ["MAX_JOINS_AGAIN", "Participants", "Timeouts", "run_to_the_end"]

MAX_JOINS_AGAIN = 3  # per hospital and run


@dataclass(frozen=True)
class Timeouts:
    join_s: float = 60.0
    key_s: float = 60.0
    round_s: float = 60.0


class Participants:
    def __init__(self, parties: PartyChannels, hospitals: Iterable[str], log: logging.Logger) -> None:
        self.parties = parties
        self.hospitals = tuple(hospitals)  # the run's: narrowed to those that joined once the run starts
        self.active: list[str] = []  # hold what a round needs and take part in rounds
        self.joining: list[str] = []  # said Hello: welcomed before the next round
        self.departures: dict[str, str] = {}
        self.joins: list[dict] = []  # hospitals that joined after the start, and before which round
        self._log = log
        self._rounds_open = False
        # Once rounds are open, a message the server handles itself wherever it waits (a voting server's
        # tallier that says Hello again): True when handled.
        self.intercept: Callable[[str, Message], bool] = lambda sender, message: False

    def open_rounds(self) -> None:
        """From now on a Hello means that a hospital joins again."""
        self._rounds_open = True

    def next_message(self, deadline: float, waiting: Callable[[], bool] = lambda: True) -> tuple[str, Message] | None:
        """The next valid message before ``deadline``, or None once it passes or ``waiting()`` turns false
        (a hospital that says Hello again leaves the round: what a round waits for may change)."""
        while waiting() and (got := self.parties.next_message(deadline)) is not None:
            sender, message = got
            if self._rounds_open and self.intercept(sender, message):
                continue
            if isinstance(message, Hello) and self._rounds_open:
                self._hello_again(sender, message)
            else:
                return got
        return None

    def await_hellos(self, expected: set[str], deadline: float) -> None:
        """Add to ``joining`` each hospital of ``expected`` that says Hello before ``deadline``."""
        while not expected <= set(self.joining):
            got = self.next_message(deadline)
            if got is None:
                return
            sender, message = got
            if not isinstance(message, Hello):
                self.parties.reject(sender, message, "expected hello")
            elif sender not in self.hospitals:
                self.parties.reject(sender, message, "not a hospital of this run")
            elif sender in self.joining:
                self.parties.reject(sender, message, "already joined")
            else:
                self.joining.append(sender)  # told how the run ends from now on, also if it ends mid-join
                self._log.info("%s joined (%d of %d)", sender, len(self.joining), len(expected))

    def admit(self, ready: list[str], *, before_round: int) -> None:
        """``ready`` take part from ``before_round`` on (a join after the start is reported)."""
        if before_round > 1:
            self.joins += [{"hospital": name, "before_round": before_round} for name in ready]
        self.active = [name for name in self.hospitals if name in self.active or name in ready]

    def turn_away(self, name: str, reason: str) -> None:
        """A hospital that joined but may not take part: it is told why."""
        self.departures[name] = reason
        self._log.warning("%s leaves the run: %s", name, reason)
        self.parties.send(name, Finish(reason=reason))

    def drop(self, name: str, reason: str, *, notify: bool = True) -> None:
        """An active hospital leaves the run (told why, unless it said so itself)."""
        if name in self.active:
            self.active.remove(name)
            self.departures[name] = reason
            self._log.warning("%s leaves the run: %s", name, reason)
            if notify:
                self.parties.send(name, Finish(reason=reason))

    def finish(self, reason: str, *, others: Iterable[str] = ()) -> None:
        """Tell every hospital still in the run, and ``others`` (talliers), that it ends, and why."""
        for name in [*self.active, *self.joining, *others]:
            self.parties.send(name, Finish(reason=reason))

    def _hello_again(self, sender: str, message: Hello) -> None:
        if sender not in self.hospitals:
            self.parties.reject(sender, message, "not a hospital of this run")
            return
        if sender in self.joining:
            self.parties.reject(sender, message, "already joining")
            return
        if sum(join["hospital"] == sender for join in self.joins) >= MAX_JOINS_AGAIN:
            reason = f"joined again {MAX_JOINS_AGAIN} times; not welcomed any more"
            if sender in self.active:
                self.drop(sender, reason)
            else:
                self.parties.send(sender, Finish(reason=reason))
            return
        if sender in self.active:
            self.active.remove(sender)  # whatever it had in flight is gone: a round waits for it no longer
            self._log.warning("%s connected again; it joins again before the next round", sender)
        self.joining.append(sender)


def run_to_the_end(
    rounds: Callable[[], str],
    *,
    finish: Callable[[str], None],
    report: Callable[[str], dict],
    write_outputs: Callable[[dict], None],
    close: Callable[[], None],
) -> dict:
    """Run ``rounds`` (which returns why the run ended) and end the run however it ends; returns the report.

    A ``ProtocolError`` or anything unexpected is re-raised after the report says the run stopped:
    a report must never claim success for a run that did not finish.
    """
    finish_reason = "completed all rounds"
    try:
        finish_reason = rounds()
    except ProtocolError as error:
        finish_reason = f"stopped: {error}"
        raise
    except BaseException as error:  # a bug or an interrupt
        finish_reason = f"stopped by an unexpected {type(error).__name__}: {error}"
        raise
    finally:
        finish(finish_reason)
        ended = report(finish_reason)
        try:
            write_at_the_end(lambda: write_outputs(ended), run_failed=finish_reason.startswith("stopped"))
        finally:
            close()
    return ended
