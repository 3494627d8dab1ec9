"""What the training server records of a run: its rounds, their privacy at every level, the model a
user keeps, and the report made of them (``server_report.json``).

The ledger (``training.privacy.ledger``) is charged at the method's first level, as the hospitals' are,
and is durable; the other levels the method protects are reported only, and rebuilt from the
released rounds on resume. The model kept (``selected_model.pt``) is that of the round selected on
validation alone (accuracy by default, or AUC: ``training.models.evaluation.Selection``), the earliest of
ties, among its candidate rounds (every n-th, and the last of the run however it ends); only that
round is scored on test, since the last round's test scores, or the best on test, would flatter the
method.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from consilium.protocol.run.checkpoint import Checkpoint, CheckpointError, write_retrying
from consilium.protocol.run.config import RunConfig
from consilium.protocol.run.rules import ConfigError
from consilium.training.privacy.accounting import ACCOUNTANT, Release
from consilium.training.privacy.ledger import PrivacyLedger
from consilium.training.data.datasets import Split
from consilium.training.privacy.durable import replace_file
from consilium.training.models.evaluation import Selection, evaluate
from consilium.training.privacy.skellam import SkellamMechanism

__all__ = ["SELECTED_MODEL_FILE", "RoundRecord", "RunRecord", "mechanism_report", "run_selection", "save_model"]

SELECTED_MODEL_FILE = "selected_model.pt"  # the parameters of the round selected on validation

log = logging.getLogger("consilium.server")


@dataclass
class RoundRecord:
    round: int
    status: str  # "released" or "aborted"
    contributors: list[str]
    validation_accuracy: float | None = None
    validation_auc: float | None = None
    test: dict[str, float | None] | None = None  # accuracy and AUC on the test split, if the data have one
    epsilon: dict[str, float] = field(
        default_factory=dict
    )  # by view, see training.privacy.accounting, at the ledger's level
    epsilon_levels: dict[str, dict[str, float]] = field(default_factory=dict)  # level -> view -> epsilon
    seconds: dict[str, float] = field(default_factory=dict)
    update_bytes: dict[str, int] = field(default_factory=dict)
    reason: str = ""
    round_state: dict[str, float] = field(default_factory=dict)  # the method's, this round (adaptive v and C)


class RunRecord:
    def __init__(
        self,
        config: RunConfig,
        mechanism: SkellamMechanism,
        ledger: PrivacyLedger,
        out_dir: Path,
        test: Split | None,
        *,
        coalition: int,
        selection: Selection = Selection(),
    ) -> None:
        self.rounds: list[RoundRecord] = []
        self.phase_seconds: dict[str, float] = {}
        self.write_failures: list[str] = []  # what the system refused to write
        self._training, self._coalition = config.training, coalition
        self._run_id, self._delta, self._classes = config.run_id, config.delta, config.model.num_classes
        self._mechanism = mechanism
        self._ledger = ledger
        self._levels = {level: PrivacyLedger() for level in config.training.LEVELS[1:]}
        self._out_dir = out_dir
        self._test = test
        self._selection, self._last_round = selection, config.rounds
        self._ended = False

    def begin_run(self, run: str) -> int:
        """Begin (or go on with) the run in every ledger; returns the last round the ledger charged."""
        charged_up_to = self._ledger.begin_run(self._run_id, run)
        for ledger in self._levels.values():
            ledger.begin_run(self._run_id, run)
        return charged_up_to

    def resume(self, run: str, checkpoint: Checkpoint, out_dir: Path) -> int:
        """Go on with the run from its checkpoint's rounds; returns the number of rounds started. That is
        never a round number used before, even if the checkpoint on disk were older than the ledger; a
        round under way when the server stopped is recorded as interrupted."""
        try:
            self.rounds = [RoundRecord(**record) for record in checkpoint.rounds]
            if not all(type(r.round) is int for r in self.rounds):
                raise ValueError("round numbers must be integers")
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"the checkpoint in {out_dir} is unusable: {error}") from None
        charged_up_to = self.begin_run(run)
        for record in self.released():
            self._record_other_levels(record)
        rounds_started = max(checkpoint.rounds_started, charged_up_to)
        if rounds_started > max((r.round for r in self.rounds), default=0):
            interrupted = "interrupted: the server stopped during this round"
            self.rounds.append(RoundRecord(round=rounds_started, status="aborted", contributors=[], reason=interrupted))
        log.warning(
            "resuming run %s after round %d (its ledger last charged round %d)",
            self._run_id,
            rounds_started,
            charged_up_to,
        )
        return rounds_started

    def released(self) -> list[RoundRecord]:
        return [r for r in self.rounds if r.status == "released"]

    def charge(self, release: Release, round_number: int) -> None:
        """Charge the ledger, durably, before any member may release its share of the round's key."""
        self._ledger.record(release, run_id=self._run_id, round_number=round_number)

    def score(self, record: RoundRecord, model: torch.nn.Module, validation: Split) -> None:
        """Score a released round's model on validation, and keep it if it is the new selected one."""
        scores = evaluate(model, validation, num_classes=self._classes)
        record.validation_accuracy, record.validation_auc = scores["accuracy"], scores["auc"]
        if self._candidate(record) and self._best(self._candidates([*self.released(), record])) is record:
            self._keep_selected(record, model)

    def account(self, record: RoundRecord) -> None:
        """A round the contributors released (the ledger charged before): its epsilons at every level."""
        record.status = "released"
        self._record_other_levels(record)
        record.epsilon = self._ledger.epsilons(self._delta)
        record.epsilon_levels = self.epsilon_levels()

    def epsilon_levels(self) -> dict[str, dict[str, float]]:
        """Epsilon by view at every level the method protects (the first is the ledger's)."""
        first, *others = self._training.LEVELS
        return {
            first: self._ledger.epsilons(self._delta),
            **{level: self._levels[level].epsilons(self._delta) for level in others},
        }

    def report(self) -> dict:
        """The report's entries of the rounds, the final figures, and what took how long or failed to be written."""
        return {
            "rounds": [dataclasses.asdict(r) for r in self.rounds],
            "final": self.final(),
            "phase_seconds": self.phase_seconds,
            "write_failures": list(self.write_failures),
        }

    def final(self) -> dict:
        """The report's ``final`` entry."""
        released = self.released()
        candidates = self._candidates(released)
        selected = self._best(candidates)
        return {
            "rounds_released": len(released),
            "selection": {"every": self._selection.every, "on": self._selection.on, "candidates": len(candidates)},
            "validation_accuracy": released[-1].validation_accuracy if released else None,
            "selected": None
            if selected is None
            else {
                "round": selected.round,
                "validation_accuracy": selected.validation_accuracy,
                "validation_auc": selected.validation_auc,
                "test": selected.test,
                "model": SELECTED_MODEL_FILE,
            },
            "epsilon": self._ledger.epsilons(self._delta),
            "epsilon_levels": self.epsilon_levels(),
            "delta": self._delta,
            "coalition": self._coalition,  # the hospitals beside the server in the coalition view
            "accountant": ACCOUNTANT,
        }

    def end_selection(self, model: torch.nn.Module) -> None:
        """The run is over, however it ended: its last released round, whose model ``model`` is, is a
        candidate too, so that a run stopped before its last round still keeps a selected model."""
        self._ended = True
        released = self.released()
        if released and not self._candidate(released[-1]) and self._best(self._candidates(released)) is released[-1]:
            self._keep_selected(released[-1], model)

    def _candidate(self, record: RoundRecord) -> bool:
        return self._selection.candidate(record.round, self._last_round)

    def _best(self, candidates: list[RoundRecord]) -> RoundRecord | None:
        score = self._selection.score
        return max(candidates, key=lambda r: (score(r.validation_accuracy, r.validation_auc), -r.round), default=None)

    def _candidates(self, released: list[RoundRecord]) -> list[RoundRecord]:
        last = released[-1] if self._ended and released else None
        return [record for record in released if self._candidate(record) or record is last]

    def _keep_selected(self, record: RoundRecord, model: torch.nn.Module) -> None:
        if self._test is not None:
            record.test = evaluate(model, self._test, num_classes=self._classes)
        try:
            write_retrying(lambda: save_model(model, self._out_dir / SELECTED_MODEL_FILE), "the selected model")
        except CheckpointError as error:
            self.write_failures.append(str(error))
            log.warning("%s", error)

    def _record_other_levels(self, record: RoundRecord) -> None:
        releases = self._training.levels(self._mechanism, len(record.contributors), self._coalition)
        for level, ledger in self._levels.items():
            ledger.record(releases[level], run_id=self._run_id, round_number=record.round)


def mechanism_report(mechanism: SkellamMechanism, config: RunConfig) -> dict:
    bound = mechanism.sum_bound(contributors=len(config.hospitals), expected_batch_size=config.training.rows_per_share)
    return {
        "name": "distributed Skellam, conditional randomized rounding of each row: an example gradient or a sub-client update (training.privacy.skellam)",
        **dataclasses.asdict(mechanism),
        "sum_bound": bound.levels,
        "wrap_probability_per_round": bound.wrap_probability,
    }


def save_model(model: torch.nn.Module, path: Path) -> None:
    """The model's weights, replaced whole: a write the disk refuses leaves the file before it intact."""
    serialized = io.BytesIO()
    torch.save(model.state_dict(), serialized)
    replace_file(path, serialized.getvalue())


def run_selection(selection: Selection | None, checkpoint: Checkpoint | None, out_dir: Path) -> Selection:
    """The model selection a run uses: a resumed run keeps the one it began with, and refuses another."""
    if checkpoint is None:
        return selection or Selection()
    try:
        checkpointed = Selection(**checkpoint.selection)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"the checkpoint in {out_dir} is unusable: {error}") from None
    if selection not in (None, checkpointed):
        raise ConfigError(
            f"the checkpointed run selects its model on {checkpointed.on} among every {checkpointed.every}-th "
            f"round: resume it with --select-every {checkpointed.every} --select-on {checkpointed.on}, or "
            "without either flag"
        )
    return checkpointed
