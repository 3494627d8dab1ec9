"""consilium-provision: create a federation directory (identities and the public roster)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from protocol.roster import ROSTER_FILE, RosterError, provision
from scripts._cli import non_negative_int, positive_int, run


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
    parser.add_argument(
        "--talliers", type=non_negative_int, default=0, help="number of talliers, for private voting (default: 0; at least 3, for an honest majority)"
    )
    parser.add_argument(
        "--mpc-address", action="append", default=[], metavar="HOST:PORT",
        help="where each tallier listens for the MPC, once per tallier (default: the server's host, the ports after its own)",
    )  # fmt: skip
    return parser


def mpc_addresses(server_address: str, talliers: int, given: list[str]) -> tuple[str, ...]:
    """The talliers' MPC addresses: as given, or the server's host and the ports after the server's."""
    if given:
        if len(given) != talliers:
            raise RosterError(f"{len(given)} MPC addresses for {talliers} talliers")
        return tuple(given)
    host, _, port = server_address.removeprefix("tcp://").rpartition(":")
    if not port.isdigit():
        raise RosterError(f"server address must look like tcp://HOST:PORT, got {server_address!r}")
    return tuple(f"{host}:{int(port) + i}" for i in range(1, talliers + 1))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def provision_federation() -> None:
        addresses = mpc_addresses(args.address, args.talliers, args.mpc_address)
        roster = provision(args.out, hospitals=args.hospitals, address=args.address, mpc_addresses=addresses)
        print(f"provisioned {', '.join(roster.parties)} in {args.out} (public roster: {args.out / ROSTER_FILE})")

    sys.exit(run(provision_federation))


if __name__ == "__main__":
    main()
