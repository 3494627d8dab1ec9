"""consilium-provision: assemble a federation's roster from its parties' public files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from consilium.protocol.identity.roster import ROSTER_FILE, assemble_roster
from consilium.protocol.identity.key_files import KeyFileError
from consilium.scripts._run import run_with


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-provision",
        description="Write roster.toml from the parties' public files (consilium-keygen). It reads no secret and writes "
        "none; every party then checks its own entry and the roster's fingerprint (consilium-roster).",
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="federation directory to write roster.toml into (must hold none)"
    )
    parser.add_argument(
        "--address", required=True, help="where the server listens, as the others reach it: tcp://HOST:PORT"
    )
    parser.add_argument(
        "--previous",
        type=Path,
        help="the roster this one replaces (a party joins or leaves): it is named by its digest",
    )
    parser.add_argument(
        "public_files", type=Path, nargs="+", metavar="PUBLIC_FILE", help="every party's NAME.public.toml"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def provision() -> None:
        roster = assemble_roster(args.out, address=args.address, public_files=args.public_files, previous=args.previous)
        print(f"roster version {roster.version} of {', '.join(roster.parties)} in {args.out / ROSTER_FILE}", flush=True)
        print(f"fingerprint: {roster.fingerprint}", flush=True)
        print(
            "every party checks its own entry and reads this fingerprint aloud: consilium-roster fingerprint",
            flush=True,
        )

    sys.exit(run_with(provision, (KeyFileError, OSError)))


if __name__ == "__main__":
    main()
