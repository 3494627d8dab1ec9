"""consilium-provision: create a federation directory (identities and the public roster)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from protocol.roster import ROSTER_FILE, provision
from scripts._cli import positive_int, run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-provision",
        description="Create a federation directory: a secret-key folder per party and a public roster.toml.",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory to create (must not hold a federation)")
    parser.add_argument("--hospitals", type=positive_int, default=3, help="number of hospitals (default: 3)")
    parser.add_argument(
        "--address", default="tcp://127.0.0.1:5555", help="address the server listens on (default: tcp://127.0.0.1:5555)"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def provision_federation() -> None:
        roster = provision(args.out, hospitals=args.hospitals, address=args.address)
        print(f"provisioned {', '.join(roster.parties)} in {args.out} (public roster: {args.out / ROSTER_FILE})")

    sys.exit(run(provision_federation))


if __name__ == "__main__":
    main()
