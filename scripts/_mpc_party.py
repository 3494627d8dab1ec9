"""One tallier's MPC alone, for the tests and ``consilium-bench-tallier``: reads its shares from a .npz
(``write_input``), runs ``tallier.mpc.run_round`` ``rounds`` times in this one process, and writes
each result with the seconds it took.

    python -m scripts._mpc_party IN.npz OUT_PREFIX FEDERATION NAME

The tallier ``NAME`` of the federation in ``FEDERATION`` (``protocol.roster.local_federation``)
takes its keys from its folder and its peers' addresses and certificates from the roster.
"""

import sys
import time
from pathlib import Path

import numpy as np

from crypto.mpc_field import MpcField
from protocol.party_keys import Credentials
from protocol.roster import Roster
from tallier.mpc import MpcError, VoterError, mpc_party, run_round


def write_input(
    path: Path,
    shares: dict[tuple[int, str], np.ndarray],
    *,
    hospitals: tuple[str, ...],
    queries: int,
    classes: int,
    quorum: int,
    field: MpcField,
    reveal: str,
    timeout: float,
    rounds: int,
    label_threshold: int,
) -> None:
    """The file every party reads: ``shares[(tallier, hospital)]`` (pairs left out are shares withheld) and the round's settings."""
    np.savez(
        path,
        **{f"share-{tallier}-{hospital}": vector for (tallier, hospital), vector in shares.items()},
        hospitals=np.array(hospitals),
        queries=queries,
        classes=classes,
        quorum=quorum,
        bit_length=field.bit_length,
        modulus=str(field.modulus),
        reveal=reveal,
        timeout=timeout,
        rounds=rounds,
        label_threshold=label_threshold,
    )


def command(source: str, target: str, federation: Path, name: str) -> list[str]:
    """The command line of tallier ``name``, run with the repository on PYTHONPATH."""
    return [sys.executable, "-m", "scripts._mpc_party", source, target, str(federation), name]


if __name__ == "__main__":
    source, target, federation, name = sys.argv[1:]
    roster, credentials = Roster.load(Path(federation)), Credentials.load(Path(federation) / name)
    roster.check_own_entry(credentials)
    party = mpc_party(roster, credentials)
    index = party.index
    with np.load(source, allow_pickle=False) as data:
        hospitals = tuple(str(name) for name in data["hospitals"])
        shares = {name: data[f"share-{index}-{name}"] for name in hospitals if f"share-{index}-{name}" in data}
        settings = {k: int(data[k]) for k in ("queries", "classes", "quorum", "label_threshold")}
        field = MpcField(int(data["bit_length"]), int(str(data["modulus"])))
        reveal, timeout, rounds = str(data["reveal"]), float(data["timeout"]), int(data["rounds"])
    for round_number in range(1, rounds + 1):
        started = time.perf_counter()
        try:
            result = run_round(
                party,
                round_number,
                shares,
                hospitals=hospitals,
                **settings,
                field=field,
                reveal=reveal,
                timeout_s=timeout,
            )
        except (MpcError, VoterError) as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        extra = {} if result.totals is None else {"totals": result.totals}
        np.savez(
            f"{target}-{round_number}.npz",
            labels=result.labels,
            voters=np.array(result.voters),
            bytes_sent=result.bytes_sent,
            seconds=time.perf_counter() - started,
            **extra,
        )
