"""A tallier's policy: which voting runs it tallies, written by its own operator, never seen by the server.

A tallier holds no data and spends no budget, but it decides what its MPC opens. Its operator's file
(``consilium-tallier --policy FILE``, TOML, read whole or refused: ``protocol.run.policy_file``):

- ``methods``: the voting methods it tallies (``ae-dpfl``, ``knn-dpfl``);
- ``reveal``: what it helps open, ``["labels"]`` or ``["labels", "histogram"]`` (the noisy totals);
- ``max_rounds``: the most rounds of one run;
- ``min_quorum``: the fewest hospitals whose votes a round may count: with fewer, each hospital's
  votes weigh more in each label.

A run outside it is refused before the tallier sends its run key, with the policy's reason, which the
server reports: a tallier's reasons say nothing of any patient. Without a file, a tallier takes every
method, any number of rounds and any quorum, and opens labels only unless ``--allow-histogram``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from consilium.protocol.run.policy_file import PolicyError, listed, read_policy
from consilium.protocol.voting.voting_config import VotingConfig
from consilium.training.voting.vote_privacy import REVEAL_MODES, VOTING_METHODS

__all__ = ["TallierPolicy"]

_KEYS = frozenset({"methods", "reveal", "max_rounds", "min_quorum"})


@dataclass(frozen=True)
class TallierPolicy:
    methods: tuple[str, ...] = VOTING_METHODS
    reveal: tuple[str, ...] = ("labels",)
    max_rounds: int | None = None  # None: any
    min_quorum: int = 1

    @classmethod
    def load(cls, path: Path) -> "TallierPolicy":
        values = read_policy(path, _KEYS)
        for key in ("max_rounds", "min_quorum"):
            value = values[key]
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise PolicyError(f"policy file {path}: {key} must be a positive whole number, got {value!r}")
        return cls(
            methods=listed(path, values, "methods", VOTING_METHODS),
            reveal=listed(path, values, "reveal", REVEAL_MODES),
            max_rounds=values["max_rounds"],
            min_quorum=values["min_quorum"],
        )

    def refusal(self, config: VotingConfig) -> str:
        """Why this tallier does not tally the run ``config`` describes, or ""."""
        if config.voting.method not in self.methods:
            return f"policy: this tallier tallies {', '.join(self.methods)} runs, not {config.voting.method[:64]!r}"
        if config.reveal not in self.reveal:
            return f"policy: the run would reveal the noisy {config.reveal}; this tallier opens {', '.join(self.reveal)} only"
        if self.max_rounds is not None and config.rounds > self.max_rounds:
            return f"policy: {config.rounds} rounds, more than the {self.max_rounds} this tallier tallies in a run"
        if config.voting.quorum < self.min_quorum:
            return f"policy: a quorum of {config.voting.quorum}, fewer hospitals than the {self.min_quorum} this tallier counts"
        return ""
