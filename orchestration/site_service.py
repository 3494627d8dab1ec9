"""Run after run, as a site's long-lived service does (docs/explanation/site-services.md).

``serve_runs`` calls ``one_run`` until ``stop`` is set: at once again after a run it took part in
to its end, and after a pause that doubles from ``FIRST_PAUSE_S`` up to ``MOST_PAUSE_S`` after
anything else (a decline, no run offered, a run that ended in error). The most is half the
server's default join window, so that a server started during a pause still hears the service.
The services are ``orchestration.hospital_service`` and ``orchestration.tallier_service``; this
module imports neither, so that a hospital loads nothing of the talliers' MPC.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Callable


__all__ = ["FIRST_PAUSE_S", "MOST_PAUSE_S", "serve_runs", "stop_on_signals"]

FIRST_PAUSE_S = 1.0
MOST_PAUSE_S = 30.0
_POLL_S = 0.2


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
        _sleep_unless(stop, pause)
        pause = min(2 * pause, MOST_PAUSE_S)


def _sleep_unless(stop: threading.Event, seconds: float) -> None:
    """Sleep ``seconds``, or until ``stop`` is set. Polled: ``Event.wait`` holds the lock that ``Event.set``, called
    from a signal handler in this very thread, would wait for."""
    ends = time.monotonic() + seconds
    while not stop.is_set() and (left := ends - time.monotonic()) > 0:
        time.sleep(min(left, _POLL_S))
