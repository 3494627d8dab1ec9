"""A tallier as a long-lived service: a ``tallier.tallier.Tallier`` for each run, each waiting for the run's
Welcome as a tallier started by hand does, run after run (``orchestration.site_service.serve_runs``)
until its operator stops it (docs/explanation/site-services.md)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from consilium.errors import ConsiliumError
from consilium.orchestration.site_service import serve_runs
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.wire.channel import STOPPED
from consilium.tallier.tallier import Tallier

__all__ = ["TallierService"]

log = logging.getLogger("consilium.service")


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
