"""What a voting run reports: its configuration and ranges, each round, and the final figures (labels
released and their accuracy, the student's test accuracy, epsilon per level, the MPC's time per query)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from consilium.protocol.voting.voting_config import VotingConfig
from consilium.protocol.voting.voting_round import RoundRecord
from consilium.training.data.splits import Split
from consilium.training.models.build import accuracy
from consilium.training.voting.vote_privacy import ACCOUNTANT

__all__ = ["final_figures", "run_report"]


def run_report(config: VotingConfig, finish_reason: str, fingerprint: str, rounds: list[RoundRecord]) -> dict:
    """The run as configured and as it ended, round by round."""
    layout = config.ballot_layout()
    return {
        "method": config.voting.method,
        "config": config.to_dict(),
        "field": dataclasses.asdict(config.field()),
        "ballot": {
            "votes_per_query": layout.votes_per_query,
            "abstains": layout.abstains,
            "noise_range": [-layout.noise_range, layout.noise_range],
            "energy_cap": layout.energy_cap,
            "noise_pool_factor": layout.pool_factor,
        },
        "totals_bound": config.totals_bound(),
        "finish_reason": finish_reason,
        "run_fingerprint": fingerprint,
        "reveal": config.reveal,
        "reveal_warning": (
            "histogram mode: the server and every tallier saw the noisy vote totals, not only the labels"
            if config.reveal == "histogram"
            else ""
        ),
        "rounds": [dataclasses.asdict(r) for r in rounds],
    }


def final_figures(
    config: VotingConfig,
    rounds: list[RoundRecord],
    labelled: list[tuple[np.ndarray, np.ndarray]],
    pool: Split,
    test: Split,
    student: torch.nn.Module | None,
    epsilon: dict[str, dict[str, float]],
) -> dict:
    """The labels released and how many were right, the student's test accuracy, epsilon per level, and the
    MPC's seconds per query asked (released or withheld)."""
    done = [r for r in rounds if r.status == "labelled"]
    queries = sum(len(indices) for indices, _ in labelled)
    asked = queries + sum(r.labels_withheld for r in done)
    correct = sum(int(np.sum(labels == pool.y[indices])) for indices, labels in labelled)
    mpc_seconds = sum(r.mpc_seconds for r in done)
    return {
        "rounds_labelled": len(done),
        "queries_labelled": queries,
        "queries_withheld": asked - queries,
        "label_accuracy": correct / queries if queries else None,
        "student_test_accuracy": accuracy(student, test.x, test.y) if student is not None else None,
        "epsilon": epsilon,
        "delta": config.delta,
        "accountant": ACCOUNTANT,
        "mpc_seconds_per_query": mpc_seconds / asked if asked else None,
    }
