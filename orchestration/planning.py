"""Privacy planning before a run: the epsilon it will spend, and the least noise that keeps it within a target.

A hospital's ledger charges each released round at the quorum (the server charges at the
contributors, never fewer), so the plan of a secure-round run is its ledger after ``rounds``
releases at the quorum, computed before any process starts (``planned_spend``; ``rounds_within``,
the rounds a budget lets a hospital take part in). ``calibrated`` searches that plan for a target,
as Opacus's ``get_noise_multiplier`` does for DP-SGD (and ``make_private_with_epsilon`` with it): it
doubles sigma until the run fits, then bisects. Sigma is found to within a factor ``1 + precision``
(a ratio, as sigma spans orders of magnitude between methods); the target binds on a view and every
view before it, as a budget does. ``planned_run`` is what ``consilium-federation`` shows before
round 1: the plan by view, the calibration, and the round after which the budget stops the run.
"""

from __future__ import annotations

import dataclasses
import math

from consilium.orchestration.run_flags import build_run_config
from consilium.orchestration.spec import RunSpec, resolve
from consilium.protocol.run.config import RunConfig
from consilium.protocol.run.rules import ConfigError
from consilium.training.data.datasets import Dataset
from consilium.training.methods.dp_fedavg import DpFedAvgSettings
from consilium.training.privacy.accounting import VIEWS
from consilium.training.privacy.ledger import PrivacyLedger
from consilium.training.privacy.budget import PrivacyBudget
from consilium.training.methods.registry import METHODS as TRAINING_METHODS

__all__ = [
    "calibrated",
    "check_first_round",
    "least_noise_multiplier",
    "planned_epsilons",
    "planned_run",
    "planned_spend",
    "rounds_within",
    "spend_line",
]

_LARGEST_NOISE_MULTIPLIER = 1e4


def planned_epsilons(spec: RunSpec) -> dict[str, float]:
    """Epsilon by view, at the method's first level, that a hospital's ledger will hold once every
    round of ``spec`` is released (``ConfigError`` for a method without a secure round)."""
    return planned_spend(_run_config(*_resolved_training(spec)))


def least_noise_multiplier(
    spec: RunSpec, target_epsilon: float, *, view: str = "server", precision: float = 1e-3
) -> float:
    """The least noise multiplier (to within ``precision``, relative) at which ``spec`` spends at most
    ``target_epsilon`` in ``view`` and every view before it (``training.privacy.accounting.VIEWS``)."""
    config = _run_config(*_resolved_training(spec))
    return calibrated(config, target_epsilon, view=view, precision=precision).training.noise_multiplier


def planned_run(spec: RunSpec, data: Dataset) -> tuple[RunSpec, str]:
    """A resolved training ``spec``, its noise calibrated where it has a target epsilon (which it then names in
    place of the target), and the line that says
    what it will spend, and where each hospital's budget stops it, to be shown before round 1."""
    config = _run_config(spec, data)
    words = _view_words(config)
    notes = ""
    if spec.target_epsilon is not None:
        config = calibrated(config, spec.target_epsilon, view=spec.budget_view)
        notes = f", calibrated to epsilon {spec.target_epsilon:g} {words[spec.budget_view]}"
        # The target is met by the noise: the spec now names the noise, as if typed.
        spec = dataclasses.replace(spec, target_epsilon=None).with_flags(
            noise_multiplier=config.training.noise_multiplier
        )
    budget = PrivacyBudget(epsilon=spec.epsilon_budget, delta=spec.delta, view=spec.budget_view)
    within = rounds_within(config, budget)
    if within < config.rounds:
        notes += (
            f"; a hospital's budget of {budget.epsilon:g} {words[budget.view]} (and each view before it) stops the "
            f"run after round {within}"
        )
    return spec, spend_line(config, planned_spend(config)) + notes


def spend_line(config: RunConfig, epsilons: dict[str, float]) -> str:
    """What ``config``'s plan spends, by view: the line every launcher shows before round 1."""
    words = _view_words(config)
    spends = ", ".join(f"{epsilons[view]:.3f} {words[view]}" for view in VIEWS)
    return (
        f"plan: {config.rounds} rounds, each released at the quorum of {config.training.quorum}, spend epsilon "
        f"{spends} (per {config.training.LEVELS[0]}, delta {config.delta:g}) at noise multiplier "
        f"{config.training.noise_multiplier:.4g}"
    )


def planned_spend(config: RunConfig) -> dict[str, float]:
    """Epsilon by view, at the method's first level, that a hospital's ledger holds once every round of
    ``config`` is released at the quorum, at the run's delta."""
    release = config.quorum_release(len(config.hospitals))
    return {
        view: PrivacyLedger().epsilon(config.delta, view=view, extra=release, times=config.rounds) for view in VIEWS
    }


def rounds_within(config: RunConfig, budget: PrivacyBudget) -> int:
    """How many of ``config``'s rounds a hospital that begins with an empty ledger takes part in under
    ``budget``, each round released at the quorum."""
    ledger = PrivacyLedger()
    ledger.begin_run(config.run_id, "planned")
    release = config.quorum_release(len(config.hospitals))
    for number in range(1, config.rounds + 1):
        if budget.refusal(ledger, release, number):
            return number - 1
        ledger.record(release, run_id=config.run_id, round_number=number)
    return config.rounds


def calibrated(config: RunConfig, target_epsilon: float, *, view: str, precision: float = 1e-3) -> RunConfig:
    """``config`` with the least noise multiplier at which its plan spends at most ``target_epsilon`` in
    ``view`` and every view before it, as a hospital's budget binds (``ConfigError`` where none does)."""
    if "noise_multiplier" not in {field.name for field in dataclasses.fields(config.training)}:
        raise ConfigError(f"{config.training.METHOD} has no noise multiplier to calibrate to a target epsilon")
    binding = VIEWS[: VIEWS.index(view) + 1]

    def at(noise: float) -> RunConfig:
        return dataclasses.replace(config, training=dataclasses.replace(config.training, noise_multiplier=noise))

    def spent(noise: float) -> float:
        epsilons = planned_spend(at(noise))
        return max(epsilons[name] for name in binding)

    low, high = 0.01, 1.0
    while spent(high) > target_epsilon:
        low, high = high, 2 * high
        if high > _LARGEST_NOISE_MULTIPLIER:
            raise ConfigError(
                f"no noise multiplier up to {_LARGEST_NOISE_MULTIPLIER:g} keeps {config.rounds} rounds of "
                f"{config.training.METHOD} within epsilon {target_epsilon:g}"
            )
    while high / low > 1 + precision:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if spent(middle) > target_epsilon else (low, middle)
    return at(high)


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
    refusal = budget.refusal(PrivacyLedger(), config.quorum_release(spec.hospitals), 1)
    if refusal:
        raise ConfigError(f"{refusal}: the first round alone exceeds --epsilon-budget (raise the noise or the budget)")


def _resolved_training(spec: RunSpec) -> tuple[RunSpec, Dataset]:
    if spec.method not in TRAINING_METHODS:
        raise ConfigError(f"{spec.method} does not run over the secure round: it has no ledger to plan")
    return resolve(spec)


def _run_config(spec: RunSpec, data: Dataset) -> RunConfig:
    """The configuration the server of this local federation will announce (its run id aside)."""
    return build_run_config(spec.values(), tuple(f"hospital-{k}" for k in range(1, spec.hospitals + 1)), data)


def _view_words(config: RunConfig) -> dict[str, str]:
    coalition = config.coalition(len(config.hospitals))
    return {
        "server": "against the server",
        "peer_hospital": "against a fellow hospital",
        "coalition": f"against the server with {coalition} hospital{'s' if coalition != 1 else ''}",
        "collusion": "if all the others collude",
    }
