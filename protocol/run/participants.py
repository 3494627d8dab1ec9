"""Who takes part in a server's run, and how every run ends: shared by the training and voting servers.

``Participants`` owns the server's channel to its parties (``protocol.wire.channel.PartyChannels``) and
the membership of the run: the hospitals that take part in rounds (``active``), those that said
Hello and wait to be welcomed (``joining``), the ones that left and why (``departures``), and
when each joined after the start (``joins``). Once rounds are open (``open_rounds``), a Hello
from a hospital of the run means it joins again: it leaves the round under way and is welcomed
before the next one. A join that breaks something costs the others: one by a member of the round
in flight (``begin_round``) aborts it, charging every contributor, and one by a hospital being
welcomed holds up the welcome. A hospital makes at most ``MAX_JOINS_AGAIN`` such joins in a run;
the rest cost nothing and are not capped: a Hello read between rounds (``read_between_rounds``),
and every join after the server itself restarted (review 4, finding 4; review 5, finding 5).

**Two ways to leave.** A hospital that falls silent (it sends nothing in time, withdraws, or is turned
away for want of a box key) is ``drop``ped: it may come back, and its Hello is a join like any other.
One the evidence or the protocol convicts (``protocol.run.blame``; a release signed over wrong values;
another mean applied than the sum's; too many joins that broke something; both sides of a dispute
that no evidence settles, repeated, so that a liar costs the run itself and one other) is
``expel``led: it is in
``expelled`` for the rest of the run, a checkpoint keeps it so across a server's restart, and its
Hello is answered with Finish and its reason, so that a liar costs the run no more than itself
however often it connects again.

**Sites may be away for minutes.** Between rounds, while fewer hospitals than the quorum are in the
run, the training server waits up to the rejoin window (``Timeouts.rejoin_s``) for the ones that fell
silent to say Hello again (``await_return``), welcoming each as it comes, and the run goes on once
the quorum is back. The hospitals still in the run wait as long: the window is part of
``Timeouts.server_silence_s``, which every Welcome announces. Every join that cost the others counts
towards ``MAX_JOINS_AGAIN``, like a Hello mid-round: coming back after falling silent mid-round,
after the run waited for it, or after answering nothing at its welcome. No hospital can make the
others wait out the window round after round. (A voting run does not wait: its talliers
are not told how long a server may take, and would give up first.)

``run_to_the_end`` is the one skeleton of a server's ``run``: whatever ends it (the last round, too
few hospitals, a protocol error, a bug or an interrupt), everyone still in the run is sent
``Finish`` with the reason, and the report is written, failing the run only if it had not
already failed.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from consilium.protocol.run.checkpoint import write_at_the_end
from consilium.protocol.wire.channel import PartyChannels
from consilium.protocol.wire.messages import Finish, Hello, Message, ProtocolError, Withdraw
from consilium.training.privacy.budget import BUDGET_REFUSAL

__all__ = ["MAX_JOINS_AGAIN", "Participants", "Timeouts", "run_to_the_end"]

MAX_JOINS_AGAIN = 3  # per hospital and run
_WITHDREW = "withdrew: "  # how a departure of a hospital's own accord begins, in reports and checkpoints
_QUEUED_S = 0.01  # how long ``read_between_rounds`` waits for a message that is already on its way


@dataclass(frozen=True)
class Timeouts:
    """How long a server waits: for hospitals to join, for box keys once welcomed, for each step of a round,
    and between rounds for hospitals that fell silent to come back while fewer than the quorum remain."""

    join_s: float = 60.0
    key_s: float = 60.0
    round_s: float = 60.0
    rejoin_s: float = 300.0

    def server_silence_s(self) -> int:
        """The longest a member may wait for this server's next message, in whole seconds: a round's five
        steps (upload to confirmation) each up to ``round_s``, two welcome passes each up to ``key_s``,
        the rejoin window, and a minute for sums, evaluation and checkpoints. A hospital that rejoins
        mid-round waits that long for its Welcome; the server tells every hospital in its Welcome
        (review 4, finding 7)."""
        return math.ceil(5 * self.round_s + 2 * self.key_s + self.rejoin_s + 60)


class Participants:
    def __init__(self, parties: PartyChannels, hospitals: Iterable[str], log: logging.Logger) -> None:
        self.parties = parties
        self.hospitals = tuple(hospitals)  # the run's: narrowed to those that joined once the run starts
        self.active: list[str] = []  # hold what a round needs and take part in rounds
        self.joining: list[str] = []  # said Hello: welcomed before the next round
        self.departures: dict[str, str] = {}
        self.expelled: set[str] = set()  # left for what they did: never welcomed again in this run
        self._withdrawn: set[str] = set()  # left of their own accord (a budget spent): not waited for
        self.joins: list[
            dict
        ] = []  # hospitals that joined after the start, before which round, and whether it broke one
        self._log = log
        self._rounds_open = False
        self._round_members: set[str] = set()  # of the round in flight
        self._breaking: set[str] = set()  # joining again, and broke a round or a welcome doing so
        # Once rounds are open, a message the server handles itself wherever it waits (a voting server's
        # tallier that says Hello again): True when handled.
        self.intercept: Callable[[str, Message], bool] = lambda sender, message: False

    def narrow_to(self, hospitals: Iterable[str], *, take_part: bool = False) -> None:
        """The run is the hospitals that joined; with ``take_part``, each takes part from now on (and so is
        told when the run ends, however it ends)."""
        self.hospitals = tuple(hospitals)
        if take_part:
            self.active = list(self.hospitals)

    def restore(
        self, *, active: Iterable[str], departures: dict[str, str], joins: list[dict], expelled: Iterable[str]
    ) -> None:
        """The membership a checkpoint holds: whom a resumed server waits for, who left and why, each
        hospital's joins again (which count across restarts), and who may not come back."""
        self.active, self.departures, self.joins = list(active), dict(departures), list(joins)
        self.expelled = set(expelled)
        withdrew = {name for name, reason in self.departures.items() if reason.startswith(_WITHDREW)}
        self._withdrawn = withdrew - set(self.active)  # (one that came back since is in the run)

    def take_joining(self) -> list[str]:
        """The hospitals that said Hello, now to be welcomed: ``joining`` is empty after."""
        joining, self.joining = self.joining, []
        return joining

    def open_rounds(self) -> None:
        """From now on a Hello means that a hospital joins again."""
        self._rounds_open = True

    def begin_round(self) -> None:
        """The active hospitals are members of a round from now until ``end_round``."""
        self._round_members = set(self.active)

    def end_round(self) -> None:
        self._round_members = set()

    def read_between_rounds(self) -> None:
        """Take what arrived since the last round ended before the next begins: a Hello sent between
        rounds then joins between rounds, breaking nothing (review 5, finding 5), and a hospital that
        withdrew (a voting hospital refusing the run, say) leaves. Anything else is rejected."""
        while (got := self.next_message(time.monotonic() + _QUEUED_S)) is not None:
            sender, message = got
            self.parties.reject(sender, message, "expected nothing between rounds")

    def broken_joins(self, name: str) -> int:
        """How often ``name`` joined again in a way that cost the others (see the module's docstring)."""
        return sum(join["hospital"] == name and join["broke_round"] for join in self.joins)

    def next_message(self, deadline: float, waiting: Callable[[], bool] = lambda: True) -> tuple[str, Message] | None:
        """The next valid message before ``deadline``, or None once it passes or ``waiting()`` turns false
        (a hospital that says Hello again leaves the round: what a round waits for may change)."""
        while waiting() and (got := self.parties.next_message(deadline)) is not None:
            sender, message = got
            if isinstance(message, Withdraw) and sender in self.active:  # at any step: it is not waited for
                self.withdrew(sender, message.reason)
                continue
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
            elif sender in self.joining:  # said again on a reconnection: harmless, and no warning
                self._log.info("%s said Hello again while the run gathers its hospitals", sender)
            elif sender in self.expelled:  # a resumed server keeps its expulsions
                self._refuse_expelled(sender, message)
            else:
                self._joins_again(sender)  # told how the run ends from now on, also if it ends mid-join
                self._log.info("%s joined (%d of %d)", sender, len(self.joining), len(expected))

    def admit(self, ready: list[str], *, before_round: int) -> None:
        """``ready`` take part from ``before_round`` on (a join after the start is reported)."""
        if before_round > 1:
            self.joins += [
                {"hospital": name, "before_round": before_round, "broke_round": name in self._breaking}
                for name in ready
            ]
        self._breaking -= set(ready)
        self._withdrawn -= set(ready)
        self.active = [
            name for name in self.hospitals if (name in self.active or name in ready) and name not in self.expelled
        ]

    def welcome(
        self,
        message: Message,
        *,
        before_round: int,
        timeout_s: float,
        awaited: str,
        answer: Callable[[str, Message], str],
    ) -> None:
        """Welcome the hospitals that said Hello with ``message``; each must answer within ``timeout_s`` with
        its ``awaited``, a message ``answer`` accepts (it returns why not, or ""), and takes part from ``before_round`` on, or
        is turned away. One that says Hello again instead is welcomed again later; that counts as a join
        that broke a welcome, so that no hospital can keep the server welcoming it while the others wait
        (review 4, finding 3)."""
        deadline, newcomers = time.monotonic() + timeout_s, self.take_joining()
        self.send_all(newcomers, message)
        ready: list[str] = []

        def waiting() -> bool:  # for a newcomer that neither answered, nor was expelled, withdrew or said Hello again
            return bool(set(newcomers) - set(ready) - self.expelled - self._withdrawn - set(self.joining))

        while waiting() and (got := self.next_message(deadline, waiting)) is not None:
            sender, reply = got
            if sender not in newcomers or sender in ready or sender in self.expelled:
                self.parties.reject(sender, reply, "expected nothing while hospitals join")
            elif isinstance(reply, Withdraw):  # it refused the run it was welcomed to
                self.withdrew(sender, reply.reason)
            elif reason := answer(sender, reply):
                self.parties.reject(sender, reply, reason)
            else:
                ready.append(sender)
        silent = set(newcomers) - set(ready) - set(self.joining) - self.expelled - self._withdrawn
        for name in silent:
            self.turn_away(name, f"sent no {awaited} within {timeout_s:g} s")
        # Saying Hello again instead of answering, or answering nothing, held up the others' welcome.
        self.joins += [
            {"hospital": name, "before_round": before_round, "broke_round": True}
            for name in newcomers
            if name in self.joining or (name in silent and before_round > 1)
        ]
        self.admit(ready, before_round=before_round)

    def turn_away(self, name: str, reason: str) -> None:
        """A hospital that joined but may not take part: it is told why."""
        self.departures[name] = reason
        self._log.warning("%s leaves the run: %s", name, reason)
        self.parties.send(name, Finish(reason=reason))

    def drop(self, name: str, reason: str, *, notify: bool = True) -> None:
        """An active hospital leaves the run (told why, unless it said so itself). A member of the round in
        flight broke it: if it comes back, that join counts towards ``MAX_JOINS_AGAIN``."""
        if name in self.active:
            if name in self._round_members:
                self._breaking.add(name)
            self.active.remove(name)
            self.departures[name] = reason
            self._log.warning("%s leaves the run: %s", name, reason)
            if notify:
                self.parties.send(name, Finish(reason=reason))

    def expel(self, name: str, reason: str, *, connected: bool = False) -> None:
        """``name`` leaves the run for what it did and is never welcomed again; it is told why if it was
        in the run or is ``connected`` (it just said Hello)."""
        if name in self.expelled:
            return
        told = connected or name in self.active or name in self.joining
        self.expelled.add(name)
        self.departures[name] = reason
        self.active = [other for other in self.active if other != name]
        self.joining = [other for other in self.joining if other != name]
        self._log.warning("%s leaves the run for good: %s", name, reason)
        if told:
            self.parties.send(name, Finish(reason=reason))

    def await_return(self, quorum: int, deadline: float) -> bool:
        """Between rounds, while fewer than ``quorum`` hospitals are in the run (active or joining), wait until
        ``deadline`` for one that fell silent to say Hello again (see the module's docstring). True where
        one did: it is in ``joining``, to be welcomed at once, before the server waits on."""

        def waiting() -> bool:
            return not self.joining and len(self.active) < quorum

        missing = sorted(set(self.hospitals) - {*self.active, *self.joining, *self.expelled, *self._withdrawn})
        if not waiting() or not missing or deadline <= time.monotonic():
            return bool(self.joining)
        self._log.warning(
            "%d hospitals in the run, fewer than the quorum of %d: waiting up to %.0f s for %s to come back",
            len(self.active),
            quorum,
            deadline - time.monotonic(),
            ", ".join(missing),
        )
        while waiting() and (got := self.next_message(deadline, waiting)) is not None:
            sender, message = got
            self.parties.reject(sender, message, "expected nothing while the run waits for hospitals")
        self._breaking |= set(self.joining)  # the others waited for it: its return counts towards the cap
        return bool(self.joining)

    def shortfall(self, quorum: int) -> str:
        """Why the run cannot go on with fewer than ``quorum`` hospitals: those that withdrew with their privacy
        budget spent (in their own words, ``training.privacy.budget.BUDGET_REFUSAL``) are named as such."""
        remaining = len(self.active) + len(self.joining)  # (one joining again is still in the run)
        shortfall = f"only {remaining} hospitals remain, fewer than the quorum of {quorum}"
        spent = sorted(name for name in self._withdrawn if self.departures[name].startswith(_WITHDREW + BUDGET_REFUSAL))
        if spent:
            return f"the privacy budget of {', '.join(spent)} is spent: {shortfall}"
        return shortfall

    def withdrew(self, name: str, reason: str) -> None:
        """A hospital of the run said it leaves (its budget spent, the run refused): it is told nothing more."""
        self._withdrawn.add(name)
        self.departures[name] = f"{_WITHDREW}{reason}"
        self.drop(name, f"{_WITHDREW}{reason}", notify=False)

    def finish(self, reason: str, *, others: Iterable[str] = ()) -> None:
        """Tell every hospital still in the run, and ``others`` (talliers), that it ends, and why."""
        self.send_all([*self.active, *self.joining, *others], Finish(reason=reason))

    def send_all(self, names: Iterable[str], message: Message) -> None:
        for name in names:
            self.parties.send(name, message)

    def _refuse_expelled(self, sender: str, message: Hello) -> None:
        self.parties.reject(sender, message, "expelled from this run")
        self.parties.send(sender, Finish(reason=f"{sender} left this run: {self.departures.get(sender, '')}"))

    def _hello_again(self, sender: str, message: Hello) -> None:
        if sender not in self.hospitals:
            self.parties.reject(sender, message, "not a hospital of this run")
            return
        if sender in self.joining:
            self.parties.reject(sender, message, "already joining")
            return
        if sender in self.expelled:
            self._refuse_expelled(sender, message)
            return
        # A member of the round in flight breaks it; one neither active nor joining is being welcomed
        # (the server records that join itself) or was dropped. Either may be refused.
        breaking = sender in self._round_members
        if (breaking or sender not in self.active) and self.broken_joins(sender) >= MAX_JOINS_AGAIN:
            reason = f"joined again {MAX_JOINS_AGAIN} times mid-round or mid-welcome; not welcomed any more"
            self.expel(sender, reason, connected=True)
            return
        if breaking:
            self._breaking.add(sender)
        if sender in self.active:
            self.active.remove(sender)  # whatever it had in flight is gone: a round waits for it no longer
            self._log.warning("%s connected again; it joins again before the next round", sender)
        self._joins_again(sender)

    def _joins_again(self, sender: str) -> None:
        self._withdrawn.discard(sender)  # one that withdrew and came back is waited for like any other
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
