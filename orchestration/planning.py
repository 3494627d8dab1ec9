"""Privacy planning before a run: the epsilon it will spend, and the least noise that keeps it within a target.

A hospital's ledger charges each released round at the quorum (the server charges at the
contributors, never fewer), so the plan of a secure-round run is its ledger after ``rounds``
releases at the quorum, computed before any process starts. ``least_noise_multiplier`` searches
that plan for a target, as Opacus's ``get_noise_multiplier`` does for DP-SGD: it doubles sigma
until the run fits, then bisects. Sigma is found to within a factor ``1 + precision`` (a ratio, as
sigma spans orders of magnitude between methods), and the data set is loaded once for the search.
"""

from __future__ import annotations

import math

from consilium.orchestration.run_flags import build_run_config
from consilium.orchestration.spec import RunSpec, resolve
from consilium.protocol.run.config import RunConfig
from consilium.protocol.run.rules import ConfigError
from consilium.training.data.datasets import Dataset
from consilium.training.methods.dp_fedavg import DpFedAvgSettings
from consilium.training.privacy.ledger import PrivacyBudget, PrivacyLedger
from consilium.training.methods.registry import METHODS as TRAINING_METHODS, ledger_release

__all__ = ["check_first_round", "least_noise_multiplier", "planned_epsilons"]

_LARGEST_NOISE_MULTIPLIER = 1e4


def planned_epsilons(spec: RunSpec) -> dict[str, float]:
    """Epsilon by view, at the method's first level, that a hospital's ledger will hold once every
    round of ``spec`` is released (``ConfigError`` for a method without a secure round)."""
    spec, data = _resolved_training(spec)
    return _planned(spec, data)


def least_noise_multiplier(
    spec: RunSpec, target_epsilon: float, *, view: str = "server", precision: float = 1e-3
) -> float:
    """The least noise multiplier (to within ``precision``, relative) at which ``spec`` spends at most
    ``target_epsilon`` in ``view`` (one of ``training.privacy.accounting.VIEWS``)."""
    spec, data = _resolved_training(spec)

    def spent(noise: float) -> float:
        return _planned(spec.with_flags(noise_multiplier=noise), data)[view]

    low, high = 0.01, 1.0
    while spent(high) > target_epsilon:
        low, high = high, 2 * high
        if high > _LARGEST_NOISE_MULTIPLIER:
            raise ConfigError(
                f"no noise multiplier up to {_LARGEST_NOISE_MULTIPLIER:g} keeps {spec.method} on {spec.data} "
                f"within epsilon {target_epsilon:g}"
            )
    while high / low > 1 + precision:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if spent(middle) > target_epsilon else (low, middle)
    return high


def check_first_round(spec: RunSpec, data: Dataset, part_sizes: list[int]) -> None:
    """What would stop a resolved secure-round run at its first round, said before any process starts (``ConfigError``)."""
    config = _run_config(spec, data)
    if isinstance(config.training, DpFedAvgSettings) and config.training.max_subclients > min(part_sizes):
        raise ConfigError(
            f"{'up to ' if config.training.subclient_rule == 'adaptive' else ''}v = {config.training.max_subclients} "
            f"sub-clients per hospital, but the smallest hospital has "
            f"{min(part_sizes)} records: more sub-clients than records"
        )
    budget = PrivacyBudget(epsilon=spec.epsilon_budget, delta=spec.delta, view=spec.budget_view)
    refusal = budget.refusal(
        PrivacyLedger(),
        ledger_release(config.training, config.mechanism(), config.training.quorum, config.coalition(spec.hospitals)),
        1,
    )
    if refusal:
        raise ConfigError(f"{refusal}: the first round alone exceeds --epsilon-budget (raise the noise or the budget)")


def _resolved_training(spec: RunSpec) -> tuple[RunSpec, Dataset]:
    if spec.method not in TRAINING_METHODS:
        raise ConfigError(f"{spec.method} does not run over the secure round: it has no ledger to plan")
    return resolve(spec)


def _planned(spec: RunSpec, data: Dataset) -> dict[str, float]:
    config = _run_config(spec, data)
    ledger = PrivacyLedger()
    ledger.begin_run(config.run_id, "planned")
    release = ledger_release(
        config.training, config.mechanism(), config.training.quorum, config.coalition(spec.hospitals)
    )
    for number in range(1, spec.rounds + 1):
        ledger.record(release, run_id=config.run_id, round_number=number)
    return ledger.epsilons(spec.delta)


def _run_config(spec: RunSpec, data: Dataset) -> RunConfig:
    """The configuration the server of this local federation will announce (its run id aside)."""
    return build_run_config(spec.values(), tuple(f"hospital-{k}" for k in range(1, spec.hospitals + 1)), data)
