"""What a voting server checks before it starts or resumes a run, and what it goes on from after a crash.

``check_startable`` refuses a run that cannot start; ``data_digest`` names the records the server labels and
tests on, so that a resumed server holds the same; ``restored`` reads a ``VotingCheckpoint`` back,
refusing one whose parts do not fit the run.

The server checkpoints the run once every party joined, before each VoteRequest leaves, once a
round's ballots are in, and after each round. Restarted with ``--resume`` it waits for the talliers
and hospitals to say Hello again (their connections are made again by themselves), checks that every
tallier comes back with the box key it had (``protocol.voting.tallier_keys``), and goes on: a round
whose ballots were in is tallied again from the very same boxes (no hospital votes twice on the same
queries, and the server's ledgers charge each round once), one stopped before that is recorded as
interrupted, and the next round asks new queries.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from consilium.protocol.identity.roster import Roster
from consilium.protocol.run.checkpoint import CheckpointError, VotingCheckpoint
from consilium.protocol.run.rules import ConfigError
from consilium.protocol.voting.voting_config import VotingConfig
from consilium.protocol.voting.voting_round import RoundRecord
from consilium.training.data.datasets import Split

__all__ = ["RestoredVote", "check_startable", "data_digest", "restored"]


def check_startable(
    config: VotingConfig, roster: Roster, public_pool: Split, ledgers: dict[str, Path], *, resumed: bool
) -> None:
    """``ConfigError`` where the run cannot start: talliers other than the roster's, a pool too small for its
    queries, or (unless resumed) an output folder that already holds a run's ledgers."""
    if config.talliers != tuple(roster.talliers):
        raise ConfigError(f"the run's talliers {list(config.talliers)} are not the roster's {roster.talliers}")
    if len(public_pool) < config.rounds * config.queries_per_round:
        raise ConfigError(
            f"{config.rounds} rounds of {config.queries_per_round} queries need {config.rounds * config.queries_per_round} "
            f"public records; the pool has {len(public_pool)}"
        )
    if not resumed and any(path.exists() for path in ledgers.values()):
        out_dir = next(iter(ledgers.values())).parent
        raise ConfigError(
            f"{out_dir} already holds a run (its ledgers would mix two runs); choose another --out, or --resume it"
        )


def data_digest(public_pool: Split, test: Split) -> str:
    """A digest of the records a voting server labels and tests on: a resumed server must hold the same."""
    digest = hashlib.sha256(b"consilium voting data v1")
    for array in (public_pool.x, public_pool.y, test.x, test.y):
        data = np.ascontiguousarray(array)
        digest.update(str((data.dtype.str, data.shape)).encode() + data.tobytes())
    return digest.hexdigest()


@dataclass
class RestoredVote:
    order: np.ndarray  # the public pool's order: round r asks records order[(r - 1) Q : r Q]
    rounds: list[RoundRecord]
    labelled: list[tuple[np.ndarray, np.ndarray]]  # per labelled round: pool indices and their labels
    active: list[str]
    pending_round: int  # the round whose ballots are in but not yet tallied (0: none)


def restored(checkpoint: VotingCheckpoint, config: VotingConfig, pool_size: int, out_dir: Path) -> RestoredVote:
    """What ``checkpoint`` holds of the run, once every part checks against it (``CheckpointError``)."""
    try:
        order = np.array(checkpoint.order, dtype=np.int64)
        if sorted(order.tolist()) != list(range(pool_size)):
            raise ValueError("the pool's order is not a permutation of the pool")
        rounds = [RoundRecord(**record) for record in checkpoint.rounds]
        labelled = [(np.array(i, dtype=np.int64), np.array(y, dtype=np.int64)) for i, y in checkpoint.labelled]
        if any(i.shape != y.shape or i.size and not 0 <= i.min() <= i.max() < pool_size for i, y in labelled):
            raise ValueError("a labelled round names records outside the pool")
        if set(checkpoint.tallier_keys) != set(config.talliers):
            raise ValueError("it does not hold every tallier's box key")
        pending = checkpoint.pending_round
        if pending and (pending != checkpoint.rounds_started or not checkpoint.pending_ballots):
            raise ValueError(f"its pending round {pending} is not the last one started")
        if not set(checkpoint.pending_ballots) <= set(config.hospitals) or any(
            set(boxes) != set(config.talliers) for boxes in checkpoint.pending_ballots.values()
        ):
            raise ValueError("its pending ballots are not one box per tallier from hospitals of the run")
        active = [str(name) for name in checkpoint.active if name in config.hospitals]
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        raise CheckpointError(f"the checkpoint in {out_dir} is unusable: {error}") from None
    return RestoredVote(order, rounds, labelled, active, pending)
