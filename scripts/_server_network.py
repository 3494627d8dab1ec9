"""Where a server listens and how long it waits: the network options of ``consilium-server``."""

from __future__ import annotations

import argparse
import math

from consilium.protocol.identity.roster import Roster, RosterError, check_server_address
from consilium.protocol.run.config import MAX_SERVER_WAIT_S
from consilium.protocol.run.participants import Timeouts
from consilium.protocol.run.rules import ConfigError
from consilium.protocol.wire.transport import DEFAULT_MAX_MESSAGES_PER_SECOND
from consilium.training.methods.flags import non_negative_float, positive_float
from consilium.training.voting.vote_privacy import VOTING_METHODS


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        type=_listen_address,
        help="tcp://HOST:PORT to listen on, where that is not the address the roster names, which the parties "
        "connect to (behind a NAT, in a container, behind a load balancer; default: the roster's address)",
    )
    _add_wait_arguments(parser)


def _add_wait_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("waits and floods")
    defaults = Timeouts()
    group.add_argument(
        "--join-timeout",
        type=positive_float,
        default=defaults.join_s,
        help="seconds to wait for hospitals to join, and for each one welcomed to answer with its key "
        f"(default: {defaults.join_s:g})",
    )
    group.add_argument(
        "--round-timeout",
        type=positive_float,
        default=defaults.round_s,
        help="seconds each step of a round waits for every member; one that sends nothing in time leaves the "
        f"round, and may come back (default: {defaults.round_s:g})",
    )
    group.add_argument(
        "--rejoin-window",
        type=non_negative_float,
        help="seconds a training run waits between rounds, while fewer hospitals than the quorum remain, for those "
        f"that fell silent to come back (default: {defaults.rejoin_s:g}; 0 ends the run at once; a voting run "
        "does not wait)",
    )
    group.add_argument(
        "--max-messages-per-second",
        type=positive_float,
        default=DEFAULT_MAX_MESSAGES_PER_SECOND,
        help="drop, unread, what a party sends once more of its messages than this are rejected a second "
        f"(default: {DEFAULT_MAX_MESSAGES_PER_SECOND:g}; an honest hospital's are never rejected)",
    )


def server_timeouts(args: argparse.Namespace) -> Timeouts:
    """The server's waits; ``ConfigError`` where a Welcome would announce more than a hospital accepts."""
    if args.rejoin_window is not None and args.method in VOTING_METHODS:
        raise ConfigError("--rejoin-window is for training runs: a voting run does not wait (its talliers would not)")
    if args.method in VOTING_METHODS:
        rejoin_s = 0.0
    else:
        rejoin_s = Timeouts().rejoin_s if args.rejoin_window is None else args.rejoin_window
    timeouts = Timeouts(
        join_s=args.join_timeout, key_s=args.join_timeout, round_s=args.round_timeout, rejoin_s=rejoin_s
    )
    waits = (timeouts.join_s, timeouts.round_s, timeouts.rejoin_s)
    if not all(math.isfinite(wait) for wait in waits) or timeouts.server_silence_s() > MAX_SERVER_WAIT_S:
        raise ConfigError(
            f"5 x --round-timeout + 2 x --join-timeout + --rejoin-window + 60 must be at most {MAX_SERVER_WAIT_S} s, "
            "the longest a hospital waits for its server"
        )
    return timeouts


def _listen_address(text: str) -> str:
    try:
        check_server_address(text, "the address")
    except RosterError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def listening_on(args: argparse.Namespace, roster: Roster) -> str:
    """Where the server listens, and where the parties reach it where that differs."""
    if args.listen is None or args.listen == roster.server_address:
        return roster.server_address
    return f"{args.listen} (the roster's {roster.server_address})"
