"""What every launcher shares: logging, the roster's fingerprint flag, and the errors a user can fix (one
line each). Light on purpose: a tallier loads nothing of training from here (the run's flags are
``_run_arguments``)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from consilium.errors import ConsiliumError
from consilium.scripts._run import run_with

USER_ERRORS = (ConsiliumError, OSError)


def run(main: Callable[[], None]) -> int:
    """Run a launcher's ``main`` (``scripts._run``), every user error (``consilium.errors``) becoming one line."""
    return run_with(main, USER_ERRORS)


def add_roster_fingerprint(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--roster-fingerprint",
        metavar="DIGITS",
        help="the roster's fingerprint as the consortium compared it out of band (consilium-roster fingerprint); needed the "
        "first time, and for a roster that is neither the one confirmed before nor signed by its parties",
    )


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr, force=True
    )
