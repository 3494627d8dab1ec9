"""The methods that train over the secure round, and what the protocol asks of each.

A method's settings are a frozen dataclass that the server announces in the run configuration
(``to_dict`` names the method; ``settings_from_dict`` reads it back). From them every party derives
the same things, so the protocol needs nothing else of a method:

- ``quorum``: contributions a round needs before its sum may be decrypted;
- ``mechanism(d)``: the Skellam mechanism of one hospital's share for a model of ``d`` parameters
  (``training.privacy.skellam``; its dimension may exceed ``d`` by the method's statistics), and
  ``rows_per_share``, the most rounded rows a share holds on average (it sizes the plain modulus);
- ``local_step(model, data)``: a hospital's step, returning ``(share, rows)``; it keeps the
  ``settings`` it was made with;
- ``levels(mechanism, contributors, coalition)``: one round's release at each level the method
  protects (``LEVELS``; a hospital's ledger is charged at the first), ``coalition`` being the
  hospitals the secure round tolerates beside the server (``training.privacy.accounting.release_of``);
- ``read_sum(total, contributors, parameter_count)``: the released vector a decrypted sum stands for, the
  model's descent direction and then the method's statistics; ``update_rule(model)``, which every
  party applies to the direction (``training.methods.update_rules``); and ``after_release``, the next
  round's settings, computed from the statistics and public values alone;
- ``round_state()`` and ``with_round_state``: what ``after_release`` changes, as numbers;
- ``FLAGS`` and ``DEFAULTS``: the command-line flags it reads, with its defaults
  (``training.methods.flags``), and ``from_flags``, its settings for a new run from them.

``TrainingMethod`` states all of that as a protocol. **Adding a method** is one module with its
settings class and one ``register_method`` line below: the launchers build its flags into their
own argument group, the server makes its settings, and every party derives the rest.

``SharedState`` holds what every party keeps alike from round to round.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Protocol

import numpy as np
from torch import nn

from consilium.training.privacy.accounting import Release
from consilium.training.methods.baselines import BASELINES
from consilium.training.data.datasets import Split
from consilium.training.methods.dopamine import DopamineSettings
from consilium.training.methods.dp_fedavg import DpFedAvgSettings
from consilium.training.methods.flags import Flag
from consilium.training.models.build import parameter_count
from consilium.training.privacy.skellam import SkellamMechanism
from consilium.training.methods.update_rules import UpdateRule
from consilium.training.voting.vote_privacy import VOTING_METHODS

__all__ = [
    "METHODS",
    "LocalStep",
    "SharedState",
    "TrainingMethod",
    "ledger_release",
    "register_method",
    "settings_from_dict",
]


class LocalStep(Protocol):
    """A hospital's step in one round: its noisy integer share, and how many rows it rounded."""

    settings: "TrainingMethod"

    def __call__(self) -> tuple[np.ndarray, int]: ...


class TrainingMethod(Protocol):
    """A method's settings, frozen: what the server announces and every party derives the round from."""

    METHOD: ClassVar[str]
    LEVELS: ClassVar[tuple[str, ...]]
    FLAGS: ClassVar[tuple[Flag, ...]]
    DEFAULTS: ClassVar[dict[str, Any]]
    quorum: int

    @property
    def rows_per_share(self) -> float: ...
    def mechanism(self, dimension: int) -> SkellamMechanism: ...
    def local_step(self, model: nn.Module, data: Split) -> LocalStep: ...
    def levels(self, mechanism: SkellamMechanism, contributors: int, coalition: int) -> dict[str, Release]: ...
    def read_sum(self, total: np.ndarray, contributors: int, parameter_count: int) -> np.ndarray: ...
    def after_release(self, statistics: np.ndarray, contributors: int, parameter_count: int) -> "TrainingMethod": ...
    def round_state(self) -> dict[str, float]: ...
    def with_round_state(self, state: dict[str, float]) -> "TrainingMethod": ...
    def update_rule(self, model: nn.Module) -> UpdateRule: ...
    def to_dict(self) -> dict: ...
    @classmethod
    def from_dict(cls, values: dict) -> "TrainingMethod": ...
    @classmethod
    def from_flags(cls, values: Any, *, quorum: int) -> "TrainingMethod": ...


_REGISTERED: dict[str, type[TrainingMethod]] = {}
METHODS: Mapping[str, type[TrainingMethod]] = MappingProxyType(_REGISTERED)  # by name, in the order registered


def register_method(settings: type[TrainingMethod]) -> None:
    """Make a method known to every launcher and party of this installation (its own code: none travels).

    Register before any launcher module is imported (in the method's package, or a ``sitecustomize``):
    the launchers build their flags once. A name already taken, by a registered method, a voting
    method or a baseline, is refused, as is a flag another method declares with another type.
    """
    name = settings.METHOD
    if name in (*VOTING_METHODS, *BASELINES) or _REGISTERED.get(name, settings) is not settings:
        raise ValueError(f"a method named {name!r} is registered already")
    kinds = {flag.name: flag.kind for other in _REGISTERED.values() for flag in other.FLAGS}
    for flag in settings.FLAGS:
        if kinds.get(flag.name, flag.kind) is not flag.kind:
            raise ValueError(f"{name} declares {flag.name} with another type than the methods that read it already")
    _REGISTERED[name] = settings


register_method(DopamineSettings)
register_method(DpFedAvgSettings)


def settings_from_dict(values: dict) -> TrainingMethod:
    """The settings ``to_dict`` wrote, or ``ValueError`` naming what is wrong."""
    if not isinstance(values, dict) or values.get("method") not in METHODS:
        method = values.get("method") if isinstance(values, dict) else None
        raise ValueError(f"unknown training method {method!r}; choose one of {', '.join(METHODS)}")
    return METHODS[values["method"]].from_dict(values)


def ledger_release(settings: TrainingMethod, mechanism: SkellamMechanism, contributors: int, coalition: int) -> Release:
    """What one round of ``contributors`` shares costs in a ledger: its release at the method's first level."""
    return settings.levels(mechanism, contributors, coalition)[settings.LEVELS[0]]


class SharedState:
    """What the server and every hospital hold alike and move on with each release.

    That is the model under its update rule, and ``settings``, the coming round's: the run's
    settings at the method's round state. ``state()`` is all of it but the model, as float32 (the
    rule's state, then the round state's values): what a Welcome and the server's checkpoint carry.
    Round states are float32 values (small whole numbers, or a clipping bound rounded to float32),
    so they travel exactly. They may change the mechanism's scale (``gamma``, with ``C``) but never
    its sensitivities or noise in integer levels, nor the plain modulus: ``mechanism`` is the run's
    for those, which is what ledgers and message sizes use; ``read_sum`` takes each round's from its
    own settings.
    """

    def __init__(self, settings: TrainingMethod, model: nn.Module) -> None:
        self._run_settings = settings
        self.settings = settings
        self.parameter_count = parameter_count(model)
        self.mechanism = settings.mechanism(self.parameter_count)
        self._rule = settings.update_rule(model)

    def apply(self, released: np.ndarray, contributors: int) -> None:
        """Move the model by the released direction, and on to the next round's settings."""
        released = np.asarray(released, dtype="<f4")
        if released.shape != (self.mechanism.dimension,):
            raise ValueError(
                f"expected a released vector of {self.mechanism.dimension} values, got shape {released.shape}"
            )
        self._rule.apply(released[: self.parameter_count])
        self.settings = self.settings.after_release(
            released[self.parameter_count :], contributors, self.parameter_count
        )

    def state(self) -> np.ndarray:
        return np.concatenate(
            [self._rule.state(), np.array(list(self.settings.round_state().values()), dtype="<f4")]
        ).astype("<f4")

    def load_state(self, values: np.ndarray) -> None:
        """Continue from ``state()``'s values, e.g. a Welcome's; ``ValueError`` if they cannot be."""
        values = np.asarray(values, dtype="<f4")
        names = list(self._run_settings.round_state())
        rule_size = values.size - len(names)
        settings = self._run_settings.with_round_state(dict(zip(names, values[rule_size:].tolist())))
        self._rule.load_state(values[:rule_size])
        self.settings = settings
