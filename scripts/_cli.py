"""What every launcher shares: logging, the roster's fingerprint flag, and the errors a user can fix (one
line each). Light on purpose: a tallier loads nothing of training from here (the run's flags are
``_run_arguments``)."""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import sys
from pathlib import Path
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


_LOG_FILE_BYTES = 10 << 20  # a log file's size before it rotates ...
_LOG_FILES_KEPT = 5  # ... and how many rotated files are kept


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="warning", help="debug, info, warning or error (default: warning)")
    parser.add_argument(
        "--log-file",
        type=Path,
        help=f"log to this file instead of standard error, rotated at {_LOG_FILE_BYTES >> 20} MiB with "
        f"{_LOG_FILES_KEPT} old files kept (a service's log)",
    )


def configure_logging(args: argparse.Namespace) -> None:
    """Log at ``--log-level`` to standard error, or to ``--log-file``, rotated."""
    if args.log_file is None:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
    else:
        handler = logging.handlers.RotatingFileHandler(
            args.log_file, maxBytes=_LOG_FILE_BYTES, backupCount=_LOG_FILES_KEPT, encoding="utf-8"
        )
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler], force=True)
