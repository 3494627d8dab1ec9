"""consilium-keygen: make one party's keys on the machine that will use them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from consilium.protocol.identity.party_keys import ROLES, SECRET_FILE, generate_party_keys
from consilium.protocol.identity.key_files import KeyFileError
from consilium.scripts._run import run_with


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-keygen",
        description="Make one party's keys in its own folder: a secret file that never leaves it (mode 0600) and "
        "NAME.public.toml, which the party hands to whoever assembles the roster (consilium-provision).",
    )
    parser.add_argument("--role", required=True, choices=ROLES, help="this party's role")
    parser.add_argument("--name", required=True, help="its name in the roster: server, hospital-1, tallier-1, ...")
    parser.add_argument(
        "--out", type=Path, required=True, help="its own folder, e.g. FEDERATION/NAME (must hold no keys yet)"
    )
    parser.add_argument(
        "--mpc-address", metavar="HOST:PORT", help="a tallier's address, where the other talliers reach it for the MPC"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def keygen() -> None:
        public_file = generate_party_keys(args.out, name=args.name, role=args.role, mpc_address_text=args.mpc_address)
        print(
            f"{args.name}: secret keys in {args.out / SECRET_FILE} (keep them here); public file {public_file}",
            flush=True,
        )

    sys.exit(run_with(keygen, (KeyFileError, OSError)))


if __name__ == "__main__":
    main()
