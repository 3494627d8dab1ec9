"""The run's membership and waits, as units: which joins again cost the others, the cap on those
alone, and how long a hospital waits for its server.

The channels' transports are replaced by a queue of messages or a silent one: what is checked here
is the bookkeeping, and the real transports are exercised by every federation test."""

import logging
import time

import pytest

from consilium.protocol.wire.channel import ServerChannel
from consilium.protocol.wire.messages import Finish, Hello, ProtocolError, Withdraw
from consilium.protocol.run.checkpoint import join_record
from consilium.protocol.run.participants import MAX_JOINS_AGAIN, Participants, Timeouts

HOSPITALS = ("hospital-1", "hospital-2", "hospital-3")


class _Queue:
    """Stands in for ``protocol.wire.channel.PartyChannels``: hands out queued messages, keeps what is sent."""

    def __init__(self) -> None:
        self.incoming: list[tuple[str, object]] = []
        self.sent: list[tuple[str, object]] = []

    def next_message(self, deadline: float):
        return self.incoming.pop(0) if self.incoming else None

    def send(self, name: str, message) -> None:
        self.sent.append((name, message))

    def reject(self, name: str, message, reason: str) -> None:
        raise AssertionError(f"{name}'s message rejected: {reason}")


def _running(kind: type = _Queue) -> tuple[Participants, _Queue]:
    """A run of every hospital with rounds open, over a queue of ``kind``."""
    queue = kind()
    participants = Participants(queue, HOSPITALS, logging.getLogger("test"))
    participants.admit(list(HOSPITALS), before_round=1)
    participants.open_rounds()
    return participants, queue


def _hello(participants: Participants, queue: _Queue, name: str) -> None:
    queue.incoming.append((name, Hello()))
    assert participants.next_message(deadline=0) is None


def test_reconnects_between_rounds_cost_nothing_and_are_never_capped():
    """In the server's order: a round ends, a Hello arrives, and the server reads what arrived before
    it begins the next round (``read_between_rounds``)."""
    participants, queue = _running()
    for before_round in range(2, 2 * MAX_JOINS_AGAIN + 3):
        participants.begin_round()
        participants.end_round()
        queue.incoming.append(("hospital-1", Hello()))
        participants.read_between_rounds()
        assert participants.joining == ["hospital-1"]
        participants.joining = []
        participants.admit(["hospital-1"], before_round=before_round)
    assert participants.active == list(HOSPITALS) and queue.sent == []
    assert participants.broken_joins("hospital-1") == 0 and len(participants.joins) == 2 * MAX_JOINS_AGAIN + 1


def test_joins_that_break_a_round_are_capped():
    participants, queue = _running()
    for before_round in range(2, MAX_JOINS_AGAIN + 2):
        participants.begin_round()
        _hello(participants, queue, "hospital-2")
        assert "hospital-2" not in participants.active  # the round waits for it no longer
        participants.end_round()
        participants.joining = []
        participants.admit(["hospital-2"], before_round=before_round)
    assert participants.broken_joins("hospital-2") == MAX_JOINS_AGAIN
    participants.begin_round()
    _hello(participants, queue, "hospital-2")
    [(name, finish)] = queue.sent
    assert name == "hospital-2" and isinstance(finish, Finish) and "not welcomed any more" in finish.reason
    assert "hospital-2" not in participants.active and "hospital-2" in participants.departures


def test_a_join_a_checkpoint_wrote_before_joins_were_told_apart_counts_as_breaking():
    assert join_record({"hospital": "hospital-1", "before_round": 3})["broke_round"] is True
    assert join_record({"hospital": "hospital-1", "before_round": 3, "broke_round": False})["broke_round"] is False


def test_a_hospital_waits_as_long_as_the_server_says_it_may_take():
    """The Welcome's wait covers a round's five steps, two welcome passes and the rejoin window; the
    channel waits that long from then on, and never less than its own timeout."""
    assert Timeouts(join_s=1, key_s=30, round_s=100, rejoin_s=7).server_silence_s() == 5 * 100 + 2 * 30 + 7 + 60

    class _Silent:
        waited: list[float] = []

        def receive(self, timeout: float):
            self.waited.append(timeout)
            return None

    transport = _Silent()
    channel = ServerChannel(transport, accept=frozenset(), limit=1, timeout_s=180, log=logging.getLogger("test"))
    channel.wait_at_least(620)
    with pytest.raises(ProtocolError, match="within 620 s"):
        channel.expect(Finish)
    assert transport.waited[0] > 600
    channel.wait_at_least(10)  # never shorter than it was
    with pytest.raises(ProtocolError, match="within 620 s"):
        channel.expect(Finish)


def test_a_hello_during_its_own_welcome_is_counted_once_by_the_server_not_again_on_admission():
    """A hospital being welcomed (neither active nor joining) that says Hello again: the server's
    ``_admit`` records that join; ``Participants`` does not count it a second time when it is admitted."""
    participants, queue = _running()
    participants.active.remove("hospital-3")  # being welcomed again
    _hello(participants, queue, "hospital-3")
    participants.joins.append({"hospital": "hospital-3", "before_round": 2, "broke_round": True})  # as _admit does
    participants.joining = []
    participants.admit(["hospital-3"], before_round=2)
    assert participants.broken_joins("hospital-3") == 1


def test_a_withdrawal_read_between_rounds_is_a_departure():
    """A voting hospital that refuses the run withdraws before any round: the server reads it then."""
    participants, queue = _running()
    queue.incoming.append(("hospital-2", Withdraw(round=0, reason="labels only")))
    participants.read_between_rounds()
    assert participants.departures == {"hospital-2": "withdrew: labels only"} and queue.sent == []


class _Refusing(_Queue):
    """A queue that keeps what the server rejects instead of failing on it."""

    def __init__(self) -> None:
        super().__init__()
        self.rejected: list[tuple[str, str]] = []

    def reject(self, name: str, message, reason: str) -> None:
        self.rejected.append((name, reason))


def test_a_hospital_that_fell_silent_joins_again_and_an_expelled_one_is_told_to_go():
    participants, queue = _running(_Refusing)
    participants.drop("hospital-1", "sent no update for round 1 within 60 s")
    participants.expel("hospital-2", "round 1: hospital-3's opening shows it dealt a wrong share")
    queue.incoming += [("hospital-1", Hello()), ("hospital-2", Hello())]
    participants.read_between_rounds()
    assert participants.joining == ["hospital-1"] and participants.active == ["hospital-3"]
    assert ("hospital-2", "expelled from this run") in queue.rejected
    finish = [message for name, message in queue.sent if name == "hospital-2" and isinstance(message, Finish)]
    assert len(finish) == 2 and "dealt a wrong share" in finish[-1].reason  # told when expelled, and again


def test_the_run_waits_for_a_hospital_that_fell_silent_and_not_for_one_expelled_or_withdrawn():
    participants, queue = _running(_Refusing)
    participants.begin_round()
    participants.drop("hospital-3", "sent no update for round 1 within 60 s")
    participants.end_round()
    queue.incoming.append(("hospital-3", Hello()))
    assert participants.await_return(quorum=3, deadline=time.monotonic() + 60)
    assert participants.joining == ["hospital-3"]
    participants.admit(participants.take_joining(), before_round=2)
    assert participants.broken_joins("hospital-3") == 1  # its silence broke round 1: it counts towards the cap

    for leave in (
        lambda p: p.expel("hospital-3", "applied another mean"),
        lambda p: p.withdrew("hospital-3", "its budget is spent"),
        lambda p: p.drop("hospital-3", "sent no update"),  # with the window over
    ):
        participants, queue = _running(_Refusing)
        leave(participants)
        waited_for = []
        queue.next_message = lambda deadline: waited_for.append(deadline) or None
        deadline = time.monotonic() + (0 if "sent no update" in participants.departures["hospital-3"] else 60)
        assert not participants.await_return(quorum=3, deadline=deadline)
        assert participants.joining == [] and waited_for == []  # nobody to wait for, or no time left: no wait


def test_an_expelled_hospital_stays_out_of_a_resumed_run_and_of_a_welcome_under_way():
    queue = _Refusing()  # a resumed server: rounds not yet open
    participants = Participants(queue, HOSPITALS, logging.getLogger("test"))
    participants.restore(active=[], departures={"hospital-2": "dealt a wrong share"}, joins=[], expelled=["hospital-2"])
    queue.incoming += [("hospital-1", Hello()), ("hospital-2", Hello()), ("hospital-3", Hello())]
    participants.await_hellos({"hospital-1", "hospital-3"}, time.monotonic() + 60)
    assert participants.joining == ["hospital-1", "hospital-3"]
    assert ("hospital-2", "expelled from this run") in queue.rejected

    participants, queue = _running(_Refusing)
    participants.drop("hospital-1", "sent no update")
    queue.incoming.append(("hospital-1", Hello()))
    participants.read_between_rounds()

    def answer(name, message):  # hospital-1 is expelled while it is being welcomed, then answers anyway
        participants.expel(name, "dealt a wrong share")
        return ""

    queue.incoming.append(("hospital-1", object()))
    participants.welcome(Finish(reason="a welcome"), before_round=2, timeout_s=60, awaited="box key", answer=answer)
    assert "hospital-1" not in participants.active and "hospital-1" in participants.expelled
    assert participants.departures["hospital-1"] == "dealt a wrong share"  # not turned away over it


def test_a_newcomer_that_refuses_its_welcome_withdraws_and_is_not_waited_for():
    participants, queue = _running(_Refusing)
    participants.drop("hospital-1", "sent no update")
    queue.incoming.append(("hospital-1", Hello()))
    participants.read_between_rounds()
    queue.incoming.append(("hospital-1", Withdraw(round=0, reason="another method")))
    participants.welcome(Finish(reason="a welcome"), before_round=2, timeout_s=60, awaited="box key", answer=None)
    assert participants.departures["hospital-1"] == "withdrew: another method"
    assert not participants.await_return(quorum=3, deadline=time.monotonic() + 60)


def test_a_hospital_that_withdrew_and_came_back_is_welcomed_and_waited_for_again():
    participants, queue = _running(_Refusing)
    participants.withdrew("hospital-3", "its budget is spent")
    queue.incoming.append(("hospital-3", Hello()))
    participants.read_between_rounds()
    queue.incoming.append(("hospital-3", "its box key"))
    participants.welcome(
        Finish(reason="a welcome"), before_round=2, timeout_s=60, awaited="box key", answer=lambda n, m: ""
    )
    assert participants.active == list(HOSPITALS)
    participants.drop("hospital-3", "sent no update")
    queue.incoming.append(("hospital-3", Hello()))
    assert participants.await_return(quorum=3, deadline=time.monotonic() + 60)


def test_every_way_of_making_the_others_wait_counts_towards_the_cap_until_the_hospital_is_expelled():
    """Silent at its welcome, or waited for in the rejoin window: each costs the others, and the
    ``MAX_JOINS_AGAIN``-th such join is the last."""
    participants, queue = _running(_Refusing)
    for attempt in range(MAX_JOINS_AGAIN):
        participants.drop("hospital-3", "sent no box key")  # (the first time: silent mid-round is counted too)
        queue.incoming.append(("hospital-3", Hello()))
        assert participants.await_return(quorum=3, deadline=time.monotonic() + 60)
        silent = attempt % 2 == 0
        queue.incoming.extend([] if silent else [("hospital-3", "its box key")])
        participants.welcome(
            Finish(reason="w"), before_round=2 + attempt, timeout_s=0.01, awaited="box key", answer=lambda n, m: ""
        )
        assert participants.broken_joins("hospital-3") == attempt + 1
    participants.drop("hospital-3", "sent no update")
    queue.incoming.append(("hospital-3", Hello()))
    participants.read_between_rounds()
    assert "hospital-3" in participants.expelled and participants.joining == []
