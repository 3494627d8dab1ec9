"""A long-lived coordinator: runs an admin submits, one after another, on one socket that stays open.

The design, its message sequence and the argument for each property are in
docs/explanation/site-services.md ("The coordinator and the admin"). In short:

- The coordinator binds the server's address once. Its socket admits the roster's hospitals,
  talliers and admins (``Roster.admins``), and no one else.
- An admin asks one question at a time (``protocol.wire.messages.TO_COORDINATOR``): Submit a run's
  flags, Status, StopRun, RunLog. Each gets one ``AdminAnswer``. Only a party whose key the roster
  lists as an admin is answered in substance; any other that asks is told it is not an admin.
- The queue's head runs as ``consilium-server`` would run it: a ``protocol.run.server.Server`` or
  ``protocol.voting.voting_server.VotingServer``, made by ``make_run`` from the flags, on a view of
  the socket (``_RunSocket``). The view hands the run its own parties' messages only, and the
  Hellos that its parties said while no run of theirs was on, first: a site's service says Hello
  once and waits for a Welcome (``orchestration.hospital_service``). It answers the admins itself.
- StopRun ends the run at its next wait for a message (at most ``_SLICE_S`` into it): the run sees a
  ``ProtocolError``, sends every party Finish with the reason, and writes its report, as any
  stopped run does. No round completes after it: a round is released only after messages the
  run waits for. Questions are read only while the coordinator waits for a message: a run busy
  computing (loading its data, adding ciphertexts, training a voting run's student) answers them,
  and a SIGTERM takes effect, when it next waits.

The queue lives in memory: a coordinator that stops loses the runs not yet started, and says how
many. Each run writes to its own folder, ``out_dir/run-N``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from consilium.errors import ConsiliumError
from consilium.protocol.identity.roster import Roster
from consilium.protocol.run.checkpoint import REPORT_FILE
from consilium.protocol.wire.codec import decode, encode
from consilium.protocol.wire.messages import (
    TO_COORDINATOR,
    AdminAnswer,
    Hello,
    Message,
    MessageError,
    ProtocolError,
    RunLog,
    Status,
    Submit,
)
from consilium.protocol.wire.transport import ServerTransport
from consilium.training.privacy.durable import replace_file

__all__ = ["ADMIN_MESSAGE_BYTES", "MAX_FLAGS", "MAX_QUEUED", "Coordinator", "RunStopped"]

log = logging.getLogger("consilium.coordinator")

ADMIN_MESSAGE_BYTES = 64 << 10  # a Submit's flags, or a question: far less
MAX_QUEUED = 20  # runs waiting; a Submit beyond is refused
MAX_FLAGS = 200  # a Submit's flags and values
_LINES_KEPT = 200  # of each run's log, for RunLog
_RUNS_SHOWN = 20  # the latest runs a Status lists
_RUNS_KEPT = 100  # runs that ended, answered for by RunLog; the oldest are forgotten
_SLICE_S = 1.0  # the longest a wait goes without reading the admin's stop and the coordinator's own
_STOPPED_BY_ADMIN = "the admin stopped the run"
_LAST_RUN_FILE = "last_run_number"  # in out_dir: the N of the last run-N named
_COUNTS = ("dropped", "bytes_received", "bytes_sent")  # per party, on ServerTransport


class RunStopped(ProtocolError):
    """A run ended on a StopRun, or because the coordinator itself is stopping."""


class PreparedRun(Protocol):
    parties: tuple[str, ...]  # the run's hospitals and talliers: whose messages it reads

    def run(self) -> None:
        """Run to the end, writing ``server_report.json`` in the run's folder however it ends."""


# make_run(flags, the run's folder, the socket it runs on, where its lines go): a run, or ConsiliumError
MakeRun = Callable[[tuple[str, ...], Path, "_RunSocket", Callable[[str], None]], PreparedRun]


@dataclass
class _Run:
    name: str
    flags: tuple[str, ...]
    submitted_by: str
    state: str = "queued"  # queued, running, finished, failed
    lines: deque = field(default_factory=lambda: deque(maxlen=_LINES_KEPT))
    stop_requested: bool = False

    def summary(self) -> str:
        said = f"{self.name} ({' '.join(self.flags) or 'the defaults'}; submitted by {self.submitted_by}): {self.state}"
        return f"{said}; {self.lines[-1]}" if self.lines and self.state != "queued" else said


class Coordinator:
    """Serves admins and runs their runs until ``stop`` is set."""

    def __init__(
        self,
        transport: ServerTransport,
        roster: Roster,
        out_dir: Path,
        make_run: MakeRun,
        check: Callable[[tuple[str, ...]], None],
        stop: threading.Event,
    ) -> None:
        """``check`` refuses (``ConsiliumError``) flags that no run could take, before they are queued."""
        self._transport = transport
        self._check = check
        self._admins = frozenset(roster.admins)
        self._out_dir = out_dir
        self._make_run = make_run
        self.stop = stop
        self._runs: dict[str, _Run] = {}
        self._queue: deque[_Run] = deque()
        self._hellos: dict[str, bytes] = {}  # party -> its last Hello, said while no run of its was on
        self._last_seen: dict[str, float] = {}
        self._numbered = _last_run_number(out_dir)

    def serve(self) -> None:
        log.warning("the coordinator serves; admins: %s", ", ".join(sorted(self._admins)) or "none in the roster")
        while not self.stop.is_set():
            if self._queue:
                self._run(self._queue.popleft())
                continue
            got = self._transport.receive(_SLICE_S)
            if got is not None:
                self.aside(*got)
        if self._queue:
            log.warning("the coordinator stops; %d queued run(s) not started", len(self._queue))

    # -- messages not for a run ----------------------------------------------------------------------

    def aside(self, party: str, payload: bytes) -> None:
        """A message from a party that no run in progress reads: an admin's question, or a site's Hello."""
        self._last_seen[party] = time.monotonic()
        accept = TO_COORDINATOR if party in self._admins else TO_COORDINATOR | {Hello}
        try:
            message = decode(payload, accept=accept, max_bytes=ADMIN_MESSAGE_BYTES)
        except MessageError as error:
            log.warning("rejected a message from %s: %s", party, error)
            self._transport.reject(party)
            return
        if isinstance(message, Hello):
            self._hellos[party] = payload
            log.info("%s is connected and waits for a run", party)
            return
        if party not in self._admins:
            log.warning("refused %s from %s: not an admin", message.TYPE, party)
            self._transport.reject(party)
            self._answer(party, False, f"{party} is not an admin of this federation")
            return
        try:
            self._admin_asks(party, message)
        except Exception as error:  # a bug, or a check that failed unforeseen: the admin hears it, the rest goes on
            log.exception("%s from %s failed", message.TYPE, party)
            self._answer(party, False, f"{message.TYPE} failed: {type(error).__name__}: {error}")

    def _admin_asks(self, admin: str, message: Message) -> None:
        if isinstance(message, Submit):
            if len(self._queue) >= MAX_QUEUED:
                self._answer(admin, False, f"{MAX_QUEUED} runs are queued already: submit it once one has started")
                return
            if len(message.flags) > MAX_FLAGS:
                self._answer(admin, False, f"a run takes at most {MAX_FLAGS} flags and values")
                return
            try:
                self._check(message.flags)
            except ConsiliumError as error:
                self._answer(admin, False, f"refused: {error}")
                return
            self._numbered += 1
            self._out_dir.mkdir(parents=True, exist_ok=True)
            replace_file(self._out_dir / _LAST_RUN_FILE, str(self._numbered).encode())
            run = _Run(f"run-{self._numbered}", message.flags, admin)
            self._runs[run.name] = run
            self._forget_old_runs()
            self._queue.append(run)
            log.warning("%s submitted %s: %s", admin, run.name, " ".join(run.flags))
            self._answer(admin, True, f"{run.name} queued ({len(self._queue)} in the queue)")
        elif isinstance(message, Status):
            self._answer(admin, True, *self._status())
        elif (run := self._runs.get(message.run)) is None:
            self._answer(admin, False, f"no run is named {message.run!r} (Status lists them)")
        elif isinstance(message, RunLog):
            self._answer(admin, True, *run.lines)
        elif run.state == "queued":  # StopRun
            self._queue.remove(run)
            run.state = "failed"
            run.lines.append(f"finished ({_STOPPED_BY_ADMIN} before it started)")
            self._answer(admin, True, f"{run.name} will not start")
        elif run.state == "running":
            run.stop_requested = True
            log.warning("%s stops %s", admin, run.name)
            self._answer(admin, True, f"{run.name} stops at its next wait")
        else:
            self._answer(admin, False, f"{run.name} has ended already")

    def _forget_old_runs(self) -> None:
        """Keep the latest ``_RUNS_KEPT`` runs that ended (their folders keep the rest), and every other."""
        ended = [name for name, run in self._runs.items() if run.state in ("finished", "failed")]
        for name in ended[: max(0, len(ended) - _RUNS_KEPT)]:
            del self._runs[name]

    def _answer(self, party: str, ok: bool, *lines: str) -> None:
        self._transport.send(party, encode(AdminAnswer(ok=ok, lines=lines)))

    def _status(self) -> list[str]:
        now = time.monotonic()
        seen = sorted(self._last_seen.items())
        lines = [
            "connected (last heard): "
            + (", ".join(f"{party} {now - when:.0f} s ago" for party, when in seen) or "no one yet")
        ]
        shown = list(self._runs.values())[-_RUNS_SHOWN:]
        lines += [run.summary() for run in shown] or ["no runs submitted"]
        return lines

    # -- a run ---------------------------------------------------------------------------------------

    def _run(self, run: _Run) -> None:
        run.state = "running"

        def say(line: str) -> None:
            run.lines.append(line)
            print(f"{run.name}: {line}", flush=True)

        folder = self._out_dir / run.name
        try:
            socket = _RunSocket(self, run)
            prepared = self._make_run(run.flags, folder, socket, say)
            socket.admit(prepared.parties)
            prepared.run()
        except RunStopped as error:
            run.state = "failed"
            say(f"finished (stopped: {error})")
        except (ConsiliumError, OSError) as error:  # a flag the server refuses, or a run that could not go on
            run.state = "failed"
            say(f"finished ({_report(folder).get('finish_reason') or f'refused: {error}'})")
        except Exception as error:  # a bug: logged whole, and the next run still runs
            log.exception("%s stopped by an unexpected %s", run.name, type(error).__name__)
            run.state = "failed"
            say(f"finished (stopped by an unexpected {type(error).__name__}: {error})")
        else:
            run.state = "finished"
        departures = _report(folder).get("departures")
        if isinstance(departures, dict) and departures:
            say("departures: " + "; ".join(f"{party} {why}" for party, why in sorted(departures.items())))


class _RunSocket:
    """The coordinator's socket as one run sees it: ``ServerTransport``'s calls, its run's parties' messages only.

    Everything else goes to ``Coordinator.aside`` while the run waits. Every wait is cut into
    slices of ``_SLICE_S``, after each of which an admin's stop, or the coordinator's, ends the run."""

    def __init__(self, coordinator: Coordinator, run: _Run) -> None:
        self._coordinator = coordinator
        self._transport = coordinator._transport
        self._run = run
        self._parties: frozenset[str] = frozenset()
        self._said: deque[tuple[str, bytes]] = deque()
        self.max_message_bytes = self._transport.max_message_bytes
        # The socket's counts are since it opened; the run's report gives its own.
        self._before = {name: dict(getattr(self._transport, name)) for name in _COUNTS}

    def admit(self, parties: tuple[str, ...]) -> None:
        """The run reads ``parties``' messages, starting with the Hellos they said while it was not on."""
        self._parties = frozenset(parties)
        hellos = self._coordinator._hellos
        self._said.extend((party, hellos.pop(party)) for party in parties if party in hellos)

    def receive(self, timeout_s: float) -> tuple[str, bytes] | None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_stop()
            if self._said:
                return self._said.popleft()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            got = self._transport.receive(min(remaining, _SLICE_S))
            if got is None:
                continue
            party, payload = got
            if party not in self._parties:
                self._coordinator.aside(party, payload)
                continue
            self._coordinator._last_seen[party] = time.monotonic()
            return got

    def _check_stop(self) -> None:
        if self._run.stop_requested:
            raise RunStopped(_STOPPED_BY_ADMIN)
        if self._coordinator.stop.is_set():
            raise RunStopped("the coordinator is stopping")

    def send(self, party: str, payload: bytes) -> bool:
        return self._transport.send(party, payload)

    def reject(self, party: str) -> None:
        self._transport.reject(party)

    @property
    def limits(self) -> dict:
        return self._transport.limits

    @property
    def dropped(self) -> dict[str, int]:
        return self._since_admitted("dropped")

    @property
    def bytes_received(self) -> dict[str, int]:
        return self._since_admitted("bytes_received")

    @property
    def bytes_sent(self) -> dict[str, int]:
        return self._since_admitted("bytes_sent")

    def _since_admitted(self, count: str) -> dict[str, int]:
        """The run's parties' count since the run began: an admin's questions and others' Hellos are not the run's."""
        before, now = self._before[count], getattr(self._transport, count)
        return {
            party: now[party] - before.get(party, 0)
            for party in self._parties
            if now.get(party, 0) != before.get(party, 0)
        }

    def close(self) -> None:
        """The socket outlives the run: the coordinator closes it."""


def _last_run_number(out_dir: Path) -> int:
    """The highest N a coordinator named a run here before, folder or not: run names are never reused."""
    numbers = [int(path.name[4:]) for path in out_dir.glob("run-*") if path.name[4:].isdigit()]
    try:
        numbers.append(int((out_dir / _LAST_RUN_FILE).read_text()))
    except (OSError, ValueError):
        pass  # a coordinator's first start here
    return max(numbers, default=0)


def _report(folder: Path) -> dict:
    try:
        report = json.loads((folder / REPORT_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}
