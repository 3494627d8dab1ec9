"""Run after run, as a site's long-lived service does (docs/explanation/site-services.md).

``serve_runs`` calls ``one_run`` until ``stop`` is set: at once again after a run it took part in
to its end, and after a pause that doubles from ``FIRST_PAUSE_S`` up to ``MOST_PAUSE_S`` after
anything else (a decline, no run offered, a run that ended in error). The most is half the
server's default join window, so that a server started during a pause still hears the service.
``TallierService`` is the tallier's: a ``tallier.tallier.Tallier`` for each run, each waiting for
the run's Welcome as a tallier started by hand does. The hospital's is
``orchestration.hospital_service``.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from consilium.errors import ConsiliumError
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.wire.channel import STOPPED
from consilium.tallier.tallier import Tallier

__all__ = ["FIRST_PAUSE_S", "MOST_PAUSE_S", "TallierService", "serve_runs", "stop_on_signals"]

log = logging.getLogger("consilium.service")

FIRST_PAUSE_S = 1.0
MOST_PAUSE_S = 30.0


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop``: the service ends its waits within a second and exits, never mid-write."""
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())


def serve_runs(one_run: Callable[[], bool], stop: threading.Event, paused: Callable[[float], None]) -> None:
    """Call ``one_run`` (True where it took part in a run to its end) until ``stop`` is set; ``paused``
    hears of each pause before it begins."""
    pause = FIRST_PAUSE_S
    while not stop.is_set():
        if one_run() or stop.is_set():
            pause = FIRST_PAUSE_S
            continue
        paused(pause)
        stop.wait(pause)
        pause = min(2 * pause, MOST_PAUSE_S)


@dataclass
class TallierService:
    """One tallier's service: its identity and settings, kept across runs; a run's MPC is not interrupted by a
    stop, which then takes effect within the MPC's own timeout."""

    roster: Roster
    credentials: Credentials
    state_dir: Path
    stop: threading.Event = field(default_factory=threading.Event)
    idle_s: float = 180.0  # how long one connection waits for a Welcome before it is made again
    mpc_timeout_s: float = 120.0
    allow_histogram: bool = False
    mpc_listen: tuple[str, int] | None = None

    def serve(self) -> None:
        """Tally run after run until ``stop`` is set."""
        name = self.credentials.name
        log.warning("%s serves: runs that open %s", name, "labels or histograms" if self.allow_histogram else "labels")
        serve_runs(self._one_run, self.stop, lambda pause: log.info("%s connects again in %g s", name, pause))
        log.warning("%s: %s", name, STOPPED)

    def _one_run(self) -> bool:
        tallier = Tallier(
            roster=self.roster,
            credentials=self.credentials,
            state_dir=self.state_dir,
            timeout_s=self.idle_s,
            mpc_timeout_s=self.mpc_timeout_s,
            allow_histogram=self.allow_histogram,
            mpc_listen=self.mpc_listen,
            stop=self.stop,
        )
        try:
            result = tallier.run()
        except ConsiliumError as error:  # the run, not the service, ends: one line, then the next run
            log.info("%s: no run, or the run ended: %s", self.credentials.name, error)
            return False
        log.warning(
            "%s: a run ended after %d rounds: %s", self.credentials.name, len(result["rounds"]), result["finish_reason"]
        )
        return result["finish_reason"] != STOPPED
