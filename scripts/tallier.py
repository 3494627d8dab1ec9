"""consilium-tallier: run one tallier of a provisioned federation (private voting)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from consilium.protocol.identity.party_keys import KeyFileError, mpc_address
from consilium.orchestration.site_service import stop_on_signals
from consilium.orchestration.tallier_service import TallierService
from consilium.protocol.identity.roster_confirmation import join_federation
from consilium.protocol.run.rules import ConfigError
from consilium.scripts._cli import add_logging_arguments, add_roster_fingerprint, configure_logging, run
from consilium.training.methods.flags import positive_float
from consilium.tallier.tallier import Tallier
from consilium.tallier.tallier_policy import TallierPolicy


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-tallier",
        description="Run a tallier: it sums its own shares of the hospitals' votes and, with the other talliers, "
        "reveals only each query's winning label (MPyC over mutual TLS).",
    )
    parser.add_argument(
        "--federation",
        type=Path,
        required=True,
        help="federation directory: roster.toml, and this tallier's keys in NAME/",
    )
    parser.add_argument("--name", required=True, help="this tallier's name in the roster, e.g. tallier-1")
    add_roster_fingerprint(parser)
    parser.add_argument(
        "--state", type=Path, help="where this tallier's sealed run state lives (default: FEDERATION/NAME)"
    )
    parser.add_argument(
        "--listen",
        type=_listen_address,
        help="HOST:PORT where this tallier's MPC listens, where that is not the address the roster names, which the "
        "other talliers dial (behind a NAT, in a container; default: the roster's address)",
    )
    parser.add_argument("--timeout", type=positive_float, default=180.0, help="seconds to wait for the server")
    parser.add_argument("--mpc-timeout", type=positive_float, default=120.0, help="seconds one round's MPC may take")
    parser.add_argument(
        "--transcript", type=Path, help="record every message the server sends this tallier, whole, in this file"
    )
    parser.add_argument(
        "--allow-histogram",
        action="store_true",
        help="take part in runs that open the noisy vote totals (--reveal histogram); without --policy",
    )
    parser.add_argument(
        "--policy",
        type=Path,
        help="this tallier's policy file (TOML: methods, reveal, max_queries_per_run, min_quorum, min_noise_std): the runs it tallies "
        "(docs/how-to/deploy-across-hosts.md); default: every run that opens labels only",
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="run as a service: tally run after run, each waited for up to --timeout before connecting again, "
        "until SIGTERM",
    )
    add_logging_arguments(parser)
    return parser


def _listen_address(text: str) -> tuple[str, int]:
    try:
        return mpc_address(text, "--listen")
    except KeyFileError:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT with a port from 1 to 65535, got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args)
    sys.exit(run(lambda: serve(args) if args.serve else tally(args)))


def tally(args: argparse.Namespace) -> None:
    result = _tallier(args)().run()
    print(f"{args.name}: {len(result['rounds'])} rounds tallied, finished: {result['finish_reason']}", flush=True)


def serve(args: argparse.Namespace) -> None:
    """This tallier as a service (``orchestration.tallier_service``) until SIGTERM or SIGINT."""
    if args.transcript:
        raise ConfigError("--transcript records one run: it is not for a service")
    service = TallierService(name=args.name, tallier=_tallier(args))
    stop_on_signals(service.stop)
    service.serve()


def _tallier(args: argparse.Namespace) -> Callable[..., Tallier]:
    """This tallier's role for one run, its roster confirmed once; a service's reads its ``stop`` flag."""
    if args.policy is not None and args.allow_histogram:
        raise ConfigError('--allow-histogram is the policy\'s to say (reveal = "histogram")')
    policy = TallierPolicy.load(args.policy) if args.policy else TallierPolicy(reveal=_reveal(args.allow_histogram))
    roster, credentials = join_federation(args.federation, args.name, args.roster_fingerprint)
    return lambda stop=None: Tallier(
        roster=roster,
        credentials=credentials,
        state_dir=args.state or args.federation / args.name,
        timeout_s=args.timeout,
        mpc_timeout_s=args.mpc_timeout,
        transcript=args.transcript,
        policy=policy,
        mpc_listen=args.listen,
        stop=stop,
    )


def _reveal(allow_histogram: bool) -> str:
    return "histogram" if allow_histogram else "labels"


if __name__ == "__main__":
    main()
