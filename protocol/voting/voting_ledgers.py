"""The voting server's privacy ledgers: one per level the voting method protects
(``training.voting.vote_privacy.LEVELS``), each durable on its own, each charging a round once even when
a resumed server tallies that round again."""

from __future__ import annotations

from pathlib import Path

from consilium.protocol.voting.voting_config import VotingConfig
from consilium.protocol.voting.voting_round import RoundRecord
from consilium.training.privacy.ledger import PrivacyLedger
from consilium.training.voting.vote_privacy import LEVELS

__all__ = ["VotingLedgers", "ledger_paths"]


def ledger_paths(out_dir: Path) -> dict[str, Path]:
    return {level: out_dir / f"privacy_ledger_{level}.jsonl" for level in LEVELS}


class VotingLedgers:
    def __init__(self, out_dir: Path, *, key: bytes, config: VotingConfig, roster_hospitals: int) -> None:
        self._ledgers = {level: PrivacyLedger(path, key=key) for level, path in ledger_paths(out_dir).items()}
        self._config, self._roster_hospitals = config, roster_hospitals
        self._charged: dict[str, int] = {}  # per level, the last round it charged before this server began

    def begin_run(self, config: VotingConfig, run: str) -> int:
        """Begin (or go on with) the run in every ledger; returns the last round any of them charged."""
        self._config = config
        self._charged = {level: ledger.begin_run(config.run_id, run) for level, ledger in self._ledgers.items()}
        return max(self._charged.values())

    def charge(self, record: RoundRecord, queries: int) -> None:
        """Charge every level for a labelled round of ``queries`` queries, once, and note its epsilons."""
        config = self._config
        for level, ledger in self._ledgers.items():
            if self._charged.get(level, 0) < record.round:
                release = config.voting.release(
                    queries=queries,
                    classes=config.classes,
                    contributors=len(record.voters),
                    coalition=config.coalition(self._roster_hospitals),
                    level=level,
                )
                ledger.record(release, run_id=config.run_id, round_number=record.round)
            record.epsilon[level] = ledger.epsilons(config.delta)

    def epsilons(self) -> dict[str, dict[str, float]]:
        """Epsilon by view at every level."""
        return {level: ledger.epsilons(self._config.delta) for level, ledger in self._ledgers.items()}
