"""What a hospital records of its run: each round it released, and how often it joined.

It is written to ``metrics-RUN.json`` in the hospital's state folder as the hospital stops, and
taken up again by a later process of the same hospital in the same run (one that was killed wrote
nothing, and its rounds are then missing from the file, not from the ledger: the ledger, not this
file, is what privacy is counted from).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from consilium.protocol.run.config import RunConfig
from consilium.protocol.secure_round.hospital_round import HospitalRound
from consilium.training.methods.registry import TrainingMethod

__all__ = ["Contribution", "HospitalMetrics"]

log = logging.getLogger("consilium.hospital")


@dataclass
class Contribution:
    """What a hospital remembers of its update while the round is open."""

    round: int
    bytes_sent_before: int
    bytes_received_before: int
    bytes_received_aggregate: int = 0
    update_bytes: int = 0
    overran_send_offset: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    settings: TrainingMethod | None = None  # the round's (training.methods.registry.SharedState)
    round_keys: HospitalRound | None = None  # the round's one-time key and checks (not in the plaintext benchmark)
    contributors: tuple[str, ...] = ()  # the sum's, once the server sends it

    def summed_by(self, contributors: tuple[str, ...], transport) -> None:
        """The server's sum arrived, of ``contributors``' updates: count what came in for it."""
        self.bytes_received_aggregate = transport.bytes_received - self.bytes_received_before
        self.contributors = tuple(contributors)

    @classmethod
    def starting(cls, round_number: int, settings: TrainingMethod, transport) -> "Contribution":
        """A contribution to ``round_number`` begun now, counting the bytes ``transport`` moves from here."""
        return cls(
            round=round_number,
            settings=settings,
            bytes_sent_before=transport.bytes_sent,
            bytes_received_before=transport.bytes_received,
        )


class HospitalMetrics:
    def __init__(self, state_dir: Path, name: str) -> None:
        self.rounds: list[dict] = []
        self.joins = 0
        self._state_dir = state_dir
        self._name = name

    def continue_run(self, run_id: str) -> None:
        """Keep what an earlier process of this hospital recorded for the run."""
        path = self._path(run_id)
        if not path.exists():
            return
        try:
            earlier = json.loads(path.read_text())
            self.rounds, self.joins = list(earlier["rounds"]), int(earlier["joins"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning(
                "%s: the metrics of its earlier process are unreadable (%s); starting them afresh", self._name, error
            )

    def released(
        self, contribution: Contribution, contributors: int, sent_bytes: int, epsilon: dict[str, float]
    ) -> None:
        self.rounds.append(
            {
                "round": contribution.round,
                "contributors": contributors,
                "round_state": contribution.settings.round_state(),
                "overran_send_offset": contribution.overran_send_offset,
                "seconds": contribution.seconds,
                "update_bytes": contribution.update_bytes,
                "received_bytes": contribution.bytes_received_aggregate,
                "sent_bytes": sent_bytes,
                "epsilon": epsilon,
            }
        )

    def write(self, config: RunConfig, finish_reason: str, *, rejected: int) -> None:
        self._state_dir.mkdir(parents=True, exist_ok=True)
        metrics = {
            "hospital": self._name,
            "run_id": config.run_id,
            "aggregation": config.aggregation,  # with insecure-plaintext-benchmark, no epsilon here holds
            "finish_reason": finish_reason,
            "rejected_messages": rejected,
            "joins": self.joins,
            "rounds": self.rounds,
        }
        self._path(config.run_id).write_text(json.dumps(metrics, indent=1))

    def _path(self, run_id: str) -> Path:
        return self._state_dir / f"metrics-{run_id}.json"
