"""A tallier's policy: which voting runs it tallies, written by its own operator, never seen by the server.

A tallier holds no data and spends no budget, but it decides what its MPC opens. Its operator's file
(``consilium-tallier --policy FILE``, TOML, read whole or refused: ``protocol.run.policy_file``):

- ``methods``: the voting methods it tallies (``ae-dpfl``, ``knn-dpfl``);
- ``reveal``: what it helps open: ``"labels"`` (each query's winning label only) or ``"histogram"``
  (the noisy totals too, and so labels);
- ``max_queries_per_run``: the most queries one run may put to it (rounds times queries a round);
- ``min_quorum``: the fewest hospitals whose votes a round may count: with fewer, each hospital's
  votes weigh more in each label;
- ``min_noise_std``: the least standard deviation of the noise on each vote total: with less, what it
  opens is nearer the exact votes.

A run outside it is refused before the tallier sends its run key, with the policy's reason, which
the server reports: a tallier's reasons say nothing of any patient. Without a file, a tallier takes
every run that opens labels only, or the noisy totals too with ``--allow-histogram``. The policy
caps one run: a tallier keeps nothing across runs, so a server may offer run after run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from consilium.protocol.run.policy_file import PolicyError, listed, read_policy
from consilium.protocol.voting.voting_config import VotingConfig
from consilium.training.voting.vote_privacy import REVEAL_MODES, VOTING_METHODS

__all__ = ["TallierPolicy"]

_KEYS = frozenset({"methods", "reveal", "max_queries_per_run", "min_quorum", "min_noise_std"})


@dataclass(frozen=True)
class TallierPolicy:
    methods: tuple[str, ...] = VOTING_METHODS
    reveal: str = "labels"  # or "histogram", which opens labels too
    max_queries_per_run: int | None = None  # None: any
    min_quorum: int = 1
    min_noise_std: float = 0.0

    @classmethod
    def load(cls, path: Path) -> "TallierPolicy":
        values = read_policy(path, _KEYS)
        for key in ("max_queries_per_run", "min_quorum"):
            value = values[key]
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise PolicyError(f"policy file {path}: {key} must be a positive whole number, got {value!r}")
        noise = values["min_noise_std"]
        if not (isinstance(noise, (int, float)) and not isinstance(noise, bool) and 0 <= noise < math.inf):
            raise PolicyError(f"policy file {path}: min_noise_std must be a number at least 0, got {noise!r}")
        if values["reveal"] not in REVEAL_MODES:
            raise PolicyError(f"policy file {path}: reveal must be one of {', '.join(map(repr, REVEAL_MODES))}")
        return cls(
            methods=listed(path, values, "methods", VOTING_METHODS),
            reveal=values["reveal"],
            max_queries_per_run=values["max_queries_per_run"],
            min_quorum=values["min_quorum"],
            min_noise_std=float(noise),
        )

    def refusal(self, config: VotingConfig) -> str:
        """Why this tallier does not tally the run ``config`` describes, or ""."""
        voting, queries = config.voting, config.rounds * config.queries_per_round
        if voting.method not in self.methods:
            return f"policy: this tallier tallies {', '.join(self.methods)} runs, not {voting.method[:64]!r}"
        if config.reveal != "labels" and self.reveal == "labels":
            return f"policy: the run would reveal the noisy {config.reveal}; this tallier opens labels only"
        if self.max_queries_per_run is not None and queries > self.max_queries_per_run:
            return f"policy: {queries} queries, more than the {self.max_queries_per_run} this tallier answers in a run"
        if voting.quorum < self.min_quorum:
            return (
                f"policy: a quorum of {voting.quorum}, fewer hospitals than the {self.min_quorum} this tallier counts"
            )
        if voting.noise_std < self.min_noise_std:
            return f"policy: vote noise of standard deviation {voting.noise_std:g}, less than this tallier's {self.min_noise_std:g}"
        return ""
