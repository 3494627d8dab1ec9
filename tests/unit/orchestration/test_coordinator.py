"""The coordinator's answers to admins and its runs' view of the socket, in one process.

The socket is a list of messages (a unit isolated); the run is a stand-in that reads that view as a
server does. ``tests/end_to_end/test_services.py`` runs the real coordinator, sites and admin."""

import threading
from collections import deque

import pytest

from consilium.errors import ConsiliumError
from consilium.orchestration.coordinator import MAX_QUEUED, Coordinator
from consilium.protocol.identity.roster import local_federation
from consilium.protocol.wire.codec import decode, encode
from consilium.protocol.wire.messages import TO_ADMIN, AdminAnswer, Hello, RunLog, Status, StopRun, Submit


class _Socket:
    """What the coordinator receives, in order, and what it sends and charges."""

    max_message_bytes = 1 << 20
    limits: dict = {}

    def __init__(self) -> None:
        self.inbox: deque[tuple[str, bytes]] = deque()
        self.sent: list[tuple[str, bytes]] = []
        self.rejected: list[str] = []
        self.dropped, self.bytes_received, self.bytes_sent = {}, {}, {}

    def receive(self, timeout_s: float):
        if not self.inbox:
            return None
        party, payload = self.inbox.popleft()
        self.bytes_received[party] = self.bytes_received.get(party, 0) + len(payload)
        return party, payload

    def send(self, party: str, payload: bytes) -> bool:
        self.sent.append((party, payload))
        return True

    def reject(self, party: str) -> None:
        self.rejected.append(party)

    def answers(self, party: str) -> list[AdminAnswer]:
        return [decode(payload, accept=TO_ADMIN, max_bytes=1 << 20) for to, payload in self.sent if to == party]


class _Run:
    """A run of ``parties`` that reads its view until it has ``reads`` messages, or the view raises."""

    def __init__(self, socket, parties, reads, seen):
        self.parties, self._socket, self._reads, self._seen = parties, socket, reads, seen

    def run(self) -> None:
        while len(self._seen) < self._reads:
            got = self._socket.receive(1.0)
            if got is not None:
                self._seen.append(got[0])


@pytest.fixture
def federation(tmp_path):
    return local_federation(tmp_path / "fed", hospitals=2, address="tcp://127.0.0.1:1", admins=("admin",))


def _coordinator(tmp_path, roster, socket, *, reads=1, refuse=None, seen=None):
    seen = [] if seen is None else seen

    def make_run(flags, folder, view, say):
        say(f"started with {' '.join(flags)}")
        return _Run(view, ("hospital-1", "hospital-2"), reads, seen)

    def check(flags):
        if refuse in flags:
            raise ConsiliumError(f"{refuse} is refused")

    return Coordinator(socket, roster, tmp_path / "runs", make_run, check, threading.Event())


def test_only_an_admin_is_answered_in_substance_and_a_malformed_question_changes_nothing(tmp_path, federation):
    socket = _Socket()
    coordinator = _coordinator(tmp_path, federation, socket)
    coordinator.aside("hospital-1", encode(Submit(flags=("--rounds", "2"))))
    coordinator.aside("admin", b"\x92not a message")
    coordinator.aside("admin", encode(Status()))
    (refused,) = socket.answers("hospital-1")
    assert not refused.ok and refused.lines == ("hospital-1 is not an admin of this federation",)
    assert socket.rejected == ["hospital-1", "admin"]  # both charged to their senders' rate
    (status,) = socket.answers("admin")  # none for the malformed one
    assert status.ok and status.lines[-1] == "no runs submitted"


def test_a_submit_is_checked_before_it_is_queued_and_the_queue_is_bounded(tmp_path, federation):
    socket = _Socket()
    coordinator = _coordinator(tmp_path, federation, socket, refuse="--out")
    coordinator.aside("admin", encode(Submit(flags=("--out", "/etc"))))
    for _ in range(MAX_QUEUED + 1):
        coordinator.aside("admin", encode(Submit(flags=("--rounds", "2"))))
    answers = socket.answers("admin")
    assert not answers[0].ok and answers[0].lines == ("refused: --out is refused",)
    assert [answer.ok for answer in answers[1:]] == [True] * MAX_QUEUED + [False]
    assert answers[1].lines == ("run-1 queued (1 in the queue)",)
    coordinator.aside("admin", encode(StopRun(run="run-1")))
    coordinator.aside("admin", encode(StopRun(run="run-99")))
    coordinator.aside("admin", encode(RunLog(run="run-1")))
    stopped, unknown, lines = socket.answers("admin")[-3:]
    assert stopped.ok and stopped.lines == ("run-1 will not start",)
    assert not unknown.ok
    assert lines.lines == ("finished (the admin stopped the run before it started)",)


def test_a_run_reads_the_hellos_its_parties_said_before_it_started_first_and_never_an_outsider_s(tmp_path, federation):
    socket, seen = _Socket(), []
    coordinator = _coordinator(tmp_path, federation, socket, reads=2, seen=seen)
    coordinator.aside("hospital-2", encode(Hello()))  # said while no run was on: kept
    coordinator.aside("admin", encode(Submit(flags=("--rounds", "2"))))
    socket.inbox.extend([("admin", encode(Status())), ("hospital-1", encode(Hello()))])
    coordinator._run(coordinator._queue.popleft())
    assert seen == ["hospital-2", "hospital-1"]  # the admin's question was answered aside, not read by the run
    assert socket.answers("admin")[-1].lines[-1].startswith("run-1 (--rounds 2; submitted by admin): running")


def test_a_stop_ends_the_run_at_its_next_wait_and_the_coordinator_goes_on(tmp_path, federation):
    socket = _Socket()
    coordinator = _coordinator(tmp_path, federation, socket, reads=1)
    coordinator.aside("admin", encode(Submit(flags=("--rounds", "2"))))
    coordinator.aside("admin", encode(Submit(flags=("--rounds", "3"))))
    socket.inbox.append(("admin", encode(StopRun(run="run-1"))))  # the run's only wait sees it
    coordinator._run(coordinator._queue.popleft())
    coordinator.aside("admin", encode(RunLog(run="run-1")))
    assert socket.answers("admin")[-1].lines == (
        "started with --rounds 2",
        "finished (stopped: the admin stopped the run)",
    )
    assert socket.answers("admin")[-2].lines == ("run-1 stops at its next wait",)
    assert [run.name for run in coordinator._queue] == ["run-2"]  # the next run is still to run


def test_a_question_that_fails_unforeseen_is_answered_with_its_error_and_the_coordinator_goes_on(tmp_path, federation):
    socket = _Socket()

    def make_run(flags, folder, view, say):
        raise AssertionError("not reached")

    def check(flags):
        raise RuntimeError("Symlink loop from '/data/loop'")  # Path.resolve's, on Python 3.11

    coordinator = Coordinator(socket, federation, tmp_path / "runs", make_run, check, threading.Event())
    coordinator.aside("admin", encode(Submit(flags=("--data", "loop"))))
    coordinator.aside("admin", encode(Status()))
    failed, status = socket.answers("admin")
    assert not failed.ok and failed.lines == ("submit failed: RuntimeError: Symlink loop from '/data/loop'",)
    assert status.ok and status.lines[-1] == "no runs submitted"


def test_a_run_s_report_counts_its_own_parties_since_it_began(tmp_path, federation):
    socket, views = _Socket(), []

    def make_run(flags, folder, view, say):
        views.append(view)
        return _Run(view, ("hospital-1", "hospital-2"), 1, [])

    coordinator = Coordinator(socket, federation, tmp_path / "runs", make_run, lambda flags: None, threading.Event())
    socket.bytes_received["hospital-1"] = 1000  # a run before this one
    coordinator.aside("admin", encode(Submit(flags=())))
    socket.inbox.extend([("admin", encode(Status())), ("hospital-1", b"12345")])
    coordinator._run(coordinator._queue.popleft())
    assert views[0].bytes_received == {"hospital-1": 5}  # not the admin's question, nor the run before


def test_a_run_that_cannot_be_made_fails_alone_and_the_next_one_runs(tmp_path, federation):
    socket, seen = _Socket(), []

    def make_run(flags, folder, view, say):
        if "--bad" in flags:
            raise ConsiliumError("its data will not load")
        return _Run(view, ("hospital-1",), 1, seen)

    coordinator = Coordinator(socket, federation, tmp_path / "runs", make_run, lambda flags: None, threading.Event())
    for flags in (("--bad",), ("--good",)):
        coordinator.aside("admin", encode(Submit(flags=flags)))
    socket.inbox.append(("hospital-1", encode(Hello())))
    while coordinator._queue:  # as serve does: the first run's error does not leave _run
        coordinator._run(coordinator._queue.popleft())
    coordinator.aside("admin", encode(Status()))
    lines = socket.answers("admin")[-1].lines
    assert lines[1] == "run-1 (--bad; submitted by admin): failed; finished (refused: its data will not load)"
    assert lines[2].startswith("run-2 (--good; submitted by admin): finished")
    assert seen == ["hospital-1"]


def test_ended_runs_are_forgotten_beyond_a_bound_and_run_names_are_never_reused(tmp_path, federation, monkeypatch):
    monkeypatch.setattr("consilium.orchestration.coordinator._RUNS_KEPT", 2)
    socket = _Socket()
    coordinator = _coordinator(tmp_path, federation, socket)
    for _ in range(4):
        coordinator.aside("admin", encode(Submit(flags=())))
        coordinator.aside("admin", encode(StopRun(run=coordinator._queue[-1].name)))  # ends before it starts
    coordinator.aside("admin", encode(Submit(flags=())))
    assert list(coordinator._runs) == ["run-3", "run-4", "run-5"]  # two ended, and the one queued
    again = _coordinator(tmp_path, federation, _Socket())  # the coordinator started again: no run-N folder exists
    again.aside("admin", encode(Submit(flags=())))
    assert [run.name for run in again._queue] == ["run-6"]
