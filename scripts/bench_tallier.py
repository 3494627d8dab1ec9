"""consilium-bench-tallier: what the talliers' checked secure argmax costs, against opening the noisy histogram.

Each cell runs one round of ``tallier.mpc.run_round`` in J real tallier processes
(``--party``, ``play_party``), talking MPyC over mutual TLS on this machine, each with its own
certificate, pinned by the roster of a fresh local federation. H hospitals' ballots on Q
queries of C classes (``protocol.voting.ballots``: votes and noise apart, each value's bits under a
tag) are shared to the talliers with the ranges and field a run would use: with three hospitals a
kNN-DPFL run's (k = 30, sigma = 15), with 100 an AE-DPFL run's (the voting paper's MNIST setting,
sigma = 20). Every round checks every ballot (its tags, bits, votes and noise's energy) and signs
and places its noise before the totals are compared. Two
ways to finish a round, side by side:

- ``labels``: the secure argmax, over MAC-authenticated pairs (``tallier.authenticated``); only each
  query's winning class is opened;
- ``histogram``: the secure sum alone; the noisy totals are opened (``--reveal histogram``).

Reported per cell: the slowest tallier's wall time for a round (connecting, agreeing on the
voters, the checks, the MPC and shutting down), per query, and the bytes each tallier sent to its
peers. Each process runs two rounds and the second is reported: in the first, a tallier whose
process started sooner would wait for the others' imports, which is not the MPC's cost (it swung
the figure twofold from run to run). The grid varies one of Q, C, J and H at a time around Q =
500, C = 10, J = 3, H = 3, the issue's target (at most 10 ms a query there, checks included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from consilium.crypto.mpc_field import MpcField
from consilium.orchestration.local import free_port
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.voting.ballots import BallotLayout, share_ballot
from consilium.protocol.identity.roster import Roster, local_federation
from consilium.scripts._cli import run
from consilium.tallier.mpc import DeviationError, MpcError, TamperError, VoterError, run_round
from consilium.tallier.mpc_network import mpc_party
from consilium.tallier.run_state import KeptOutput
from consilium.training.methods.flags import positive_int
from consilium.training.privacy.secure_random import secure_generator
from consilium.training.voting.vote_privacy import REVEAL_MODES, VotingSettings
from consilium.training.voting.votes import noise_share

# The votes each number of hospitals casts, as a run of that size would: kNN-DPFL's defaults with 3,
# and AE-DPFL's MNIST setting with 100 (scripts/reproduce_voting.py). Every hospital votes: the quorum.
VOTINGS = {
    3: VotingSettings(method="knn-dpfl", noise_std=15.0, quorum=3, neighbours=30),
    100: VotingSettings(method="ae-dpfl", noise_std=20.0, quorum=100),
}
_BASE = {"queries": 500, "classes": 10, "talliers": 3, "hospitals": 3}
_TARGET_MS = 10.0
_TIMEOUT_S = 600.0
_LAYOUT_FIELDS = (
    "queries", "classes", "votes_per_query", "abstains", "noise_range", "energy_cap", "pool_factor"
)  # fmt: skip


@dataclass(frozen=True)
class Measurement:
    queries: int
    classes: int
    talliers: int
    hospitals: int
    reveal: str
    bit_length: int
    pool_factor: int  # M: each ballot's noise is a pool of M Q C values (VotingSettings.noise_pool)
    seconds: float  # the slowest tallier's round
    bytes_per_tallier: float  # mean over the talliers, sent to all peers

    @property
    def ms_per_query(self) -> float:
        return 1000 * self.seconds / self.queries


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-bench-tallier",
        description="Time the talliers' secure argmax (MPyC, real processes over TLS) against opening the noisy "
        "histogram, for several numbers of queries, classes and talliers; write results.md and results.json.",
    )
    parser.add_argument(
        "--queries", type=positive_int, nargs="+", default=[100, 500, 2000], help="Q values (default: 100 500 2000)"
    )
    parser.add_argument(
        "--classes", type=positive_int, nargs="+", default=[2, 10, 50], help="C values (default: 2 10 50)"
    )
    parser.add_argument("--talliers", type=positive_int, nargs="+", default=[3, 5, 7], help="J values (default: 3 5 7)")
    parser.add_argument(
        "--hospitals",
        type=int,
        nargs="+",
        default=list(VOTINGS),
        choices=list(VOTINGS),
        help="H values, each with its run's votes (default: 3 100)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("results/bench_tallier"), help="where results.md and results.json go"
    )
    parser.add_argument(
        "--party",
        nargs=4,
        metavar=("INPUT", "OUT_PREFIX", "FEDERATION", "NAME"),
        help="instead: be tallier NAME of one cell, reading its shares from INPUT (what the benchmark starts J of)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(run(lambda: play_party(*args.party) if args.party else benchmark(args)))


def benchmark(args: argparse.Namespace) -> list[Measurement]:
    cells = _grid(args)
    measurements = []
    with (
        tempfile.TemporaryDirectory(prefix="consilium-bench-tallier-") as work,
        tqdm(total=len(cells), unit="cell") as bar,
    ):
        for index, (queries, classes, talliers, hospitals, reveal) in enumerate(cells):
            bar.set_postfix_str(f"Q={queries} C={classes} J={talliers} H={hospitals} {reveal}")
            measurements.append(_measure(Path(work) / str(index), queries, classes, talliers, hospitals, reveal))
            bar.update()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "measurements": [{**asdict(m), "ms_per_query": m.ms_per_query} for m in measurements],
            },
            indent=1,
        )
    )
    (args.out / "results.md").write_text(results_table(measurements))
    print(f"results: {args.out / 'results.md'}")
    return measurements


def _grid(args: argparse.Namespace) -> list[tuple[int, int, int, int, str]]:
    """One of Q, C, J, H varied at a time around the base cell, each cell in both reveal modes."""
    base = _BASE
    points = [(q, base["classes"], base["talliers"], base["hospitals"]) for q in args.queries]
    points += [(base["queries"], c, base["talliers"], base["hospitals"]) for c in args.classes]
    points += [(base["queries"], base["classes"], j, base["hospitals"]) for j in args.talliers]
    points += [(base["queries"], base["classes"], base["talliers"], h) for h in args.hospitals]
    unique = list(dict.fromkeys(points))
    return [(*point, reveal) for point in unique for reveal in REVEAL_MODES]


def _measure(work: Path, queries: int, classes: int, talliers: int, hospitals: int, reveal: str) -> Measurement:
    addresses = tuple(f"127.0.0.1:{free_port()}" for _ in range(talliers))
    roster = local_federation(
        work / "federation", hospitals=1, address=f"tcp://127.0.0.1:{free_port()}", mpc_addresses=addresses
    )
    field = _write_cell_input(work / "input.npz", queries, classes, talliers, hospitals, reveal)
    failures = _wait_for_talliers(_start_talliers(work, roster))
    if failures:
        raise RuntimeError(
            f"Q={queries} C={classes} J={talliers} H={hospitals} {reveal}: " + "; ".join(map(str, failures))
        )
    results = [np.load(work / f"out-{index}-2.npz") for index in range(talliers)]
    return Measurement(
        queries=queries,
        classes=classes,
        talliers=talliers,
        hospitals=hospitals,
        reveal=reveal,
        bit_length=field.bit_length,
        pool_factor=VOTINGS[hospitals].noise_pool(queries=queries, classes=classes).factor,
        seconds=max(float(r["seconds"]) for r in results),
        bytes_per_tallier=statistics.fmean(int(r["bytes_sent"]) for r in results),
    )


def _write_cell_input(path: Path, queries: int, classes: int, talliers: int, hospitals: int, reveal: str) -> MpcField:
    """Draw the hospitals' ballots for one cell, share them to the talliers and write the talliers' input; its field."""
    voting = VOTINGS[hospitals]
    layout = BallotLayout.for_round(voting, queries=queries, classes=classes, abstains=False)
    mechanism = voting.mechanism(queries=queries, classes=classes, level="record")
    names = tuple(f"hospital-{h}" for h in range(1, hospitals + 1))
    rng = np.random.default_rng()  # the votes' values do not change the work; the noise and shares are the OS's
    ballots = {
        name: (
            rng.multinomial(layout.votes_per_query, np.full(classes, 1 / classes), size=queries),
            noise_share(mechanism, layout.noise_pool, generator=secure_generator()),
        )
        for name in names
    }
    shares, field = share_ballots(ballots, talliers, layout)
    write_input(
        path,
        shares,
        hospitals=names,
        layout=layout,
        quorum=hospitals,
        field=field,
        reveal=reveal,
        timeout=_TIMEOUT_S,
        rounds=2,
        label_threshold=0,
    )
    return field


def _start_talliers(work: Path, roster: Roster) -> list[subprocess.Popen]:
    """One ``--party`` process for each of the roster's talliers, in ``work``."""
    environment = {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    return [
        subprocess.Popen(
            party_command("input.npz", f"out-{index}", work / "federation", name),
            cwd=work,
            env={**os.environ, **environment},
            stderr=subprocess.PIPE,
            text=True,
        )
        for index, name in enumerate(roster.talliers)
    ]


def _wait_for_talliers(processes: list[subprocess.Popen]) -> list[str]:
    """Wait for every tallier, killing those still running at the deadline; the last line of each failure's error."""
    deadline = time.monotonic() + 2 * _TIMEOUT_S + 60
    failures = []
    for index, process in enumerate(processes):
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
        if process.wait() != 0:
            failures.append(f"tallier {index}: {process.stderr.read().strip().splitlines()[-1:] or 'no output'}")
    return failures


def share_ballots(
    ballots: dict[str, tuple[np.ndarray, np.ndarray]], talliers: int, layout: BallotLayout
) -> tuple[dict[tuple[int, str], np.ndarray], MpcField]:
    """Each hospital's ballot (its votes and its noise) in shares among ``talliers``, as
    ``shares[(tallier, hospital)]``, and the field its totals need."""
    field = MpcField.for_bound(layout.totals_bound(len(ballots)))
    shares = {
        (tallier, hospital): vector
        for hospital, (votes, noise) in ballots.items()
        for tallier, vector in enumerate(share_ballot(votes, noise, layout, talliers, field.modulus))
    }
    return shares, field


def write_input(
    path: Path,
    shares: dict[tuple[int, str], np.ndarray],
    *,
    hospitals: tuple[str, ...],
    layout: BallotLayout,
    quorum: int,
    field: MpcField,
    reveal: str,
    timeout: float,
    rounds: int,
    label_threshold: int,
    repeat: bool = False,
) -> None:
    """The file every party reads: ``shares[(tallier, hospital)]`` (pairs left out are shares withheld) and the round's settings."""
    np.savez(
        path,
        **{f"share-{tallier}-{hospital}": vector for (tallier, hospital), vector in shares.items()},
        **{f"layout-{name}": int(getattr(layout, name)) for name in _LAYOUT_FIELDS},
        hospitals=np.array(hospitals),
        quorum=quorum,
        bit_length=field.bit_length,
        modulus=str(field.modulus),
        reveal=reveal,
        timeout=timeout,
        rounds=rounds,
        label_threshold=label_threshold,
        repeat=repeat,
    )


def read_layout(data) -> BallotLayout:
    """The ballot layout ``write_input`` wrote to ``data``."""
    values = {name: int(data[f"layout-{name}"]) for name in _LAYOUT_FIELDS}
    return BallotLayout(**{**values, "abstains": bool(values["abstains"])})


def party_command(source: str, target: str, federation: Path, name: str) -> list[str]:
    """The command line of tallier ``name`` of one cell."""
    return [sys.executable, "-m", "consilium.scripts.bench_tallier", "--party", source, target, str(federation), name]


def play_party(source: str, target: str, federation: str, name: str) -> None:
    """Tallier ``name`` of the federation in ``federation`` (its keys from its folder, its peers from the roster):
    run ``tallier.mpc.run_round`` on its shares in ``source`` (``write_input``) the file's number of times, and
    write each round's result with the seconds it took to ``{target}-{round}.npz``. With ``repeat`` in the file,
    every tally after the first is round 1 again, counting what the first kept (``run_state.KeptOutput``), as a
    tallier tallies a round again once its output began."""
    roster, credentials = Roster.load(Path(federation)), Credentials.load(Path(federation) / name)
    roster.check_own_entry(credentials)
    party = mpc_party(roster, credentials)
    with np.load(source, allow_pickle=False) as data:
        hospitals = tuple(str(hospital) for hospital in data["hospitals"])
        shares = {h: data[f"share-{party.index}-{h}"] for h in hospitals if f"share-{party.index}-{h}" in data}
        settings = {key: int(data[key]) for key in ("quorum", "label_threshold")}
        layout = read_layout(data)
        field = MpcField(int(data["bit_length"]), int(str(data["modulus"])))
        reveal, timeout, rounds = str(data["reveal"]), float(data["timeout"]), int(data["rounds"])
        repeat = bool(data["repeat"])
    kept: list[KeptOutput] = []
    for round_number in range(1, rounds + 1):
        started = time.perf_counter()
        try:
            result = run_round(
                party,
                1 if repeat else round_number,
                shares,
                hospitals=hospitals,
                layout=layout,
                **settings,
                field=field,
                reveal=reveal,
                timeout_s=timeout,
                bad={},
                kept=kept[0] if kept and repeat else None,
                on_output=kept.append,
            )
        except (VoterError, TamperError, DeviationError) as error:
            raise MpcError(str(error)) from None
        extra = {} if result.totals is None else {"totals": result.totals}
        np.savez(
            f"{target}-{round_number}.npz",
            labels=result.labels,
            voters=np.array(result.voters),
            refused=np.array(list(result.refused), dtype=str),
            reasons=np.array(list(result.refused.values()), dtype=str),
            bytes_sent=result.bytes_sent,
            seed=str(result.seed),
            seconds=time.perf_counter() - started,
            **extra,
        )


def results_table(measurements: list[Measurement]) -> str:
    lines = [
        "# The talliers' checked secure argmax against opening the noisy histogram",
        "",
        f"Command: `{' '.join(['consilium-bench-tallier', *sys.argv[1:]])}`. Each cell is two rounds in J real tallier "
        "processes (MPyC over mutual TLS with pinned certificates, on one machine), H hospitals' ballots (votes and noise "
        "apart, each value's bits under a tag) with the ranges and field of a kNN-DPFL run with 3 hospitals (k = 30, sigma = 15) "
        "or an AE-DPFL run with 100 (sigma = 20); every round checks every ballot and places its noise before any comparison; "
        "the checks and the argmax run over MAC-authenticated pairs, checked before any check or label opens "
        "(tallier/authenticated.py). Time: the slowest "
        "tallier's whole second round (connecting, agreeing on the voters, the checks, the MPC, shutting down). Bytes: "
        "what one tallier sends to its peers, mean over the talliers. M: each ballot's noise is a pool of M times the "
        "round's values, as the run's settings choose (training/voting/vote_privacy.py, NoisePool).",
        "",
        "| Q | C | J | H | field bits | M | argmax: ms per query | argmax: kB per tallier | histogram: ms per query "
        "| histogram: kB per tallier | argmax / histogram time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_cell = {(m.queries, m.classes, m.talliers, m.hospitals, m.reveal): m for m in measurements}
    for cell in dict.fromkeys((m.queries, m.classes, m.talliers, m.hospitals) for m in measurements):
        labels, histogram = by_cell[(*cell, "labels")], by_cell[(*cell, "histogram")]
        lines.append(
            f"| {' | '.join(map(str, cell))} | {labels.bit_length} | {labels.pool_factor} | {labels.ms_per_query:.2f} "
            f"| {labels.bytes_per_tallier / 1000:,.0f} | {histogram.ms_per_query:.2f} "
            f"| {histogram.bytes_per_tallier / 1000:,.0f} | {labels.seconds / histogram.seconds:.1f}x |"
        )
    base = by_cell.get((*(_BASE[key] for key in ("queries", "classes", "talliers", "hospitals")), "labels"))
    if base is not None:
        verdict = "met" if base.ms_per_query <= _TARGET_MS else "not met"
        lines += [
            "",
            f"- The checked secure argmax at most {_TARGET_MS:g} ms per query at Q = {base.queries}, C = {base.classes}, "
            f"J = {base.talliers}, H = {base.hospitals}: {base.ms_per_query:.2f} ms, **{verdict}**.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
