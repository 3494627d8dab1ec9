"""A tallier as a long-lived service: a ``tallier.tallier.Tallier`` for each run, each waiting for the run's
Welcome as a tallier started by hand does, run after run (``orchestration.site_service.serve_runs``)
until its operator stops it (docs/explanation/site-services.md)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from consilium.errors import ConsiliumError
from consilium.orchestration.site_service import serve_runs
from consilium.protocol.wire.channel import STOPPED
from consilium.tallier.tallier import Tallier

__all__ = ["TallierService"]

log = logging.getLogger("consilium.service")


@dataclass
class TallierService:
    """One tallier's service: a ``Tallier`` for each run, as ``tallier`` makes it, reading ``stop`` at every wait for
    the server; a run's MPC is not interrupted by a stop, which then takes effect within the MPC's own timeout."""

    name: str
    tallier: Callable[[threading.Event], Tallier]
    stop: threading.Event = field(default_factory=threading.Event)

    def serve(self) -> None:
        """Tally run after run until ``stop`` is set."""
        log.warning("%s serves", self.name)
        serve_runs(self._one_run, self.stop, lambda pause: log.info("%s connects again in %g s", self.name, pause))
        log.warning("%s: %s", self.name, STOPPED)

    def _one_run(self) -> bool:
        try:
            result = self.tallier(self.stop).run()
        except ConsiliumError as error:  # the run, not the service, ends: one line, then the next run
            log.info("%s: no run, or the run ended: %s", self.name, error)
            return False
        log.warning("%s: a run ended after %d rounds: %s", self.name, len(result["rounds"]), result["finish_reason"])
        return result["finish_reason"] != STOPPED
