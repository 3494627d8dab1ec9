"""consilium-roster: a party's checks of the roster it was given, and its signature over a new version."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.identity.roster_confirmation import SIGNATURES_FILE, sign_roster
from consilium.protocol.identity.key_files import KeyFileError
from consilium.scripts._run import run_with


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-roster",
        description="Check the roster against this party's own keys and print its fingerprint, to compare out of band "
        "with every other party; or sign a new roster version that only removes parties or moves the server, for the "
        "parties that confirmed the one before (a newcomer needs the fingerprint compared again).",
    )
    parser.add_argument(
        "action", choices=("fingerprint", "sign"), help="fingerprint: check, then print; sign: check, then sign"
    )
    parser.add_argument("--federation", type=Path, required=True, help="federation directory holding roster.toml")
    parser.add_argument("--name", required=True, help="this party's name; its keys are in FEDERATION/NAME")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def check() -> None:
        credentials = Credentials.load(args.federation / args.name)
        roster = Roster.load(args.federation)
        roster.check_own_entry(credentials)
        if args.action == "sign":
            changes = sign_roster(args.federation, credentials)
            print(
                f"{args.name} signed roster version {roster.version} ({args.federation / SIGNATURES_FILE}); it changes the roster "
                f"{args.name} confirmed last: {'; '.join(changes) or 'nothing'}",
                flush=True,
            )
        else:
            print(
                f"{args.name}'s entry holds its own keys; roster version {roster.version} of {len(roster.parties)} parties",
                flush=True,
            )
            print(f"fingerprint: {roster.fingerprint}", flush=True)

    sys.exit(run_with(check, (KeyFileError, OSError)))


if __name__ == "__main__":
    main()
