"""DP-FedAvg over intermediaries (Jiang et al., Eq. 1) under secure aggregation: the round's math.

Each round, hospital k splits its records afresh into ``v`` disjoint sub-clients
(``training.methods.fedavg.split_subclients``); each sub-client trains locally from the global model and
clips its update ``Delta_i`` to L2 norm ``C``. The hospital's share is the integer sum of its
sub-clients' updates, each scaled by ``gamma`` and randomly rounded, plus its Skellam noise share
(``training.privacy.skellam``, the same mechanism as Dopamine's, with the sub-client update in place of the
example gradient)::

    s_k = sum_{i in k} round(gamma clip(Delta_i, C)) + Sk(mu),    2 mu = z^2 Delta_2^2 / K_min

so a quorum's sum carries at least ``z`` times the sensitivity of one sub-client in noise. Every
hospital has the same public ``v``, so the shares are equal: proportional to the sub-client count,
and robust to the quorum as Dopamine's. Every party reads the mean update as
``u = sum_k s_k / (gamma v K_c)`` and applies the server optimizer to ``g = -u``
(``training.methods.update_rules``: FedAvg, or FedAdam).

**Privacy, at three levels** (``training.privacy.accounting.release_of``), for adding or removing, with
no amplification by sampling (every sub-client takes part). Each level is a group of rounded rows
that can move together, each by up to ``Delta_2`` (``Delta_1`` in L1):

- ``subclient`` (group 1): adding or removing one whole sub-client, the paper's unit. Sub-clients
  are drawn afresh each round, so this is a per-round figure, not a lasting unit's;
- ``record`` (group 2): one record added or removed leaves its sub-client in the sum but changes
  its update from ``r`` to ``r'``, both within ``Delta_2``: twice a sub-client's sensitivity;
- ``hospital`` (group ``max(v, 2)``, with ``v = max_subclients`` when v is adaptive): a
  hospital's ``v`` sub-clients move together, by up to ``v Delta_2``; for ``v = 1`` its records'
  ``2 Delta_2`` is the larger, so the hospital level covers every record too. For ``v >= 2`` it is
  the privacy of noise multiplier ``z / v`` (exactly for the Gaussian; for the Skellam to within
  its rounding terms).

The record level holds because ``split_subclients`` draws each record's sub-client independently:
with or without the record, the others fall the same way.

Hospitals' ledgers are charged at the hospital level, so their budgets bind on what a consortium
member actually is, and every ledger entry, of either method, is also a valid record-level charge.

**Adaptive v** (``subclient_rule="adaptive"``, Sec. 2.2; ``training.methods.intermediaries``). Each row
then carries one more coordinate, its own clipped norm (weighted by ``alpha``, ``NORM_SLOT_WEIGHT``),
released, noised and accounted with the update; from its sum and public values alone every party
computes the next round's ``v`` alike (``DpFedAvgSettings.after_release``). ``v`` stays within
``[1, max_subclients]`` and the plain modulus is sized for ``max_subclients`` rows.

**Adaptive clipping** (``clip_rule="adaptive"``; Andrew et al. 2021;
``training.methods.adaptive_clipping``). ``C`` then follows the ``target_quantile`` of the
sub-clients' update norms. Each row carries one more coordinate, whether its update was within this
round's ``C`` (weighted by ``beta``, ``COUNT_SLOT_WEIGHT``), released, noised and accounted with the
update; every party reads the count from it and moves ``C`` alike. Every rounded row is calibrated
to the round's ``C``, so ``C`` changes only the scale ``gamma``, never the sensitivities or the
noise in integer levels that the ledgers and the plain modulus see.

Ledgers charge every round at ``v = max_subclients``, not at the round's ``v``. ``v`` follows
the released data, and the sum of per-round costs that were themselves chosen from earlier
outputs is a guarantee only under a privacy filter (Feldman and Zrnic 2021), which the ledger is
not. A data-independent charge needs no such argument. At the hospital level an adaptive run
therefore costs what a run at fixed ``v = max_subclients`` does: what adaptive ``v`` may buy is
utility, not privacy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import numpy as np
from torch import nn

from consilium.training.privacy.accounting import Release, release_of
from consilium.training.data.datasets import Split
from consilium.training.methods.adaptive_clipping import COUNT_SLOT_WEIGHT, clipping_bound, next_clipping_bound
from consilium.training.methods.fedavg import (
    LOCAL_OPTIMIZERS,
    FedAvgError,
    LocalTraining,
    clip_update,
    local_update,
    split_subclients,
)
from consilium.training.methods.flags import Flag, non_negative_float, positive_float, positive_int, probability
from consilium.training.methods.intermediaries import NORM_SLOT_WEIGHT, expected_noise_norm, next_subclient_count
from consilium.training.models.build import parameter_count
from consilium.training.privacy.secure_random import require_cryptographic, secure_generator
from consilium.training.privacy.skellam import SkellamMechanism
from consilium.training.methods.typed_fields import from_typed_dict
from consilium.training.methods.update_rules import MAX_LEARNING_RATE, FedAdamUpdate, MomentumUpdate, UpdateRule

__all__ = [
    "CLIP_RULES",
    "SERVER_OPTIMIZERS",
    "SUBCLIENT_RULES",
    "DpFedAvgSettings",
    "SubclientStep",
]

SERVER_OPTIMIZERS = ("fedavg", "fedadam")
_SERVER_LEARNING_RATES = {"fedavg": 1.0, "fedadam": 0.03}
SUBCLIENT_RULES = ("fixed", "adaptive")
CLIP_RULES = ("fixed", "adaptive")
_MAX_CLIP_LEARNING_RATE = 10.0
_MAX_LOCAL_EPOCHS = 100  # settings come from the server: a bound on the work they ask of a hospital
_MAX_SUBCLIENTS = 1024
_MAX_ROW_VALUES = 1 << 27  # v rows of the model's size held at once: 512 MiB of float32
_MAX_LOCAL_STEPS = 1_000_000  # local optimiser steps a round, over all sub-clients


@dataclass(frozen=True)
class DpFedAvgSettings:
    METHOD: ClassVar[str] = "dp-fedavg"
    LEVELS: ClassVar[tuple[str, ...]] = ("hospital", "record", "subclient")  # the first is the one ledgers charge
    FLAGS: ClassVar[tuple[Flag, ...]] = (
        Flag("--noise-multiplier", non_negative_float, 6.0, "z: noise of a quorum's sum, in units of one sub-client's sensitivity"),
        Flag("--subclients", positive_int, 2, "v, sub-clients (intermediaries) per hospital (the first round's, with --adaptive-subclients)"),
        Flag("--adaptive-subclients", positive_int, None, "re-estimate v each round from the release (Jiang et al., Sec. 2.2), up to this many; without it v is fixed"),
        Flag("--max-update-norm", positive_float, 0.5, "C, clipping norm of each sub-client's update (the first round's, with --clip-quantile)"),
        Flag("--clip-quantile", probability, None, "adapt C each round toward this quantile of the sub-client update norms (Andrew et al. 2021), from a count noised and released with the update; without it C is fixed"),
        Flag("--clip-lr", positive_float, None, "eta_C, the geometric step of adaptive clipping (default 0.2)"),
        Flag("--local-epochs", positive_int, 1, "epochs each sub-client trains per round"),
        Flag("--local-batch-size", positive_int, 16, "sub-clients' batch size"),
        Flag("--local-lr", positive_float, 0.1, "sub-clients' learning rate"),
        Flag("--local-optimizer", str, "sgd", f"sub-clients' optimizer, {' or '.join(LOCAL_OPTIMIZERS)}"),
        Flag("--server-optimizer", str, "fedavg", f"how every party applies the mean update, {' or '.join(SERVER_OPTIMIZERS)}"),
        Flag("--server-lr", positive_float, None, "server learning rate (default: 1 for fedavg, 0.03 for fedadam)"),
    )  # fmt: skip
    DEFAULTS: ClassVar[dict[str, Any]] = {"rounds": 10, "epsilon_budget": 10.0}

    noise_multiplier: float  # z: noise of a quorum's sum, in units of one sub-client's sensitivity
    max_update_norm: float  # C: this round's, when adaptive
    quorum: int  # K_min
    subclients: int  # v: sub-clients per hospital this round, the same at every hospital
    subclient_rule: str  # "fixed", or "adaptive": v re-estimated from each release
    max_subclients: int  # v never exceeds it (the plain modulus is sized for it); equal to v when fixed
    local_epochs: int
    local_batch_size: int
    local_learning_rate: float
    local_optimizer: str
    server_optimizer: str
    server_learning_rate: float
    clip_rule: str = "fixed"  # or "adaptive": C moves toward target_quantile of the update norms
    target_quantile: float = 0.5
    clip_learning_rate: float = 0.2  # eta_C

    def __post_init__(self) -> None:
        if not self.noise_multiplier >= 0:
            raise FedAvgError(f"noise_multiplier must be non-negative, got {self.noise_multiplier}")
        if not (self.max_update_norm > 0 and math.isfinite(self.max_update_norm)):
            raise FedAvgError(f"max_update_norm must be positive and finite, got {self.max_update_norm}")
        if self.clip_rule not in CLIP_RULES:
            raise FedAvgError(f"unknown clipping rule {self.clip_rule!r}; choose one of {', '.join(CLIP_RULES)}")
        if not (0 < self.target_quantile < 1 and 0 < self.clip_learning_rate <= _MAX_CLIP_LEARNING_RATE):
            raise FedAvgError(
                f"adaptive clipping needs a target quantile in (0, 1) and a learning rate in (0, {_MAX_CLIP_LEARNING_RATE:g}], "
                f"got {self.target_quantile} and {self.clip_learning_rate}"
            )
        if self.quorum < 1 or self.subclients < 1:
            raise FedAvgError(f"quorum and subclients must be at least 1, got {self.quorum} and {self.subclients}")
        if self.subclient_rule not in SUBCLIENT_RULES:
            raise FedAvgError(
                f"unknown sub-client rule {self.subclient_rule!r}; choose one of {', '.join(SUBCLIENT_RULES)}"
            )
        if self.subclients > self.max_subclients:
            raise FedAvgError(
                f"v = {self.subclients} sub-clients is more than the most v may reach, {self.max_subclients}"
            )
        if self.max_subclients > _MAX_SUBCLIENTS:
            raise FedAvgError(f"at most {_MAX_SUBCLIENTS} sub-clients a hospital, got {self.max_subclients}")
        if self.subclient_rule == "fixed" and self.subclients != self.max_subclients:
            raise FedAvgError(f"with fixed v, max_subclients must be v = {self.subclients}, got {self.max_subclients}")
        if self.server_optimizer not in SERVER_OPTIMIZERS:
            raise FedAvgError(
                f"unknown server optimizer {self.server_optimizer!r}; choose one of {', '.join(SERVER_OPTIMIZERS)}"
            )
        if not 0 < self.server_learning_rate <= MAX_LEARNING_RATE:
            raise FedAvgError(
                f"the server learning rate must be in (0, {MAX_LEARNING_RATE:g}], got {self.server_learning_rate}"
            )
        if self.local_epochs > _MAX_LOCAL_EPOCHS or self.local_learning_rate > MAX_LEARNING_RATE:
            raise FedAvgError(
                f"local training is limited to {_MAX_LOCAL_EPOCHS} epochs and a learning rate of {MAX_LEARNING_RATE:g}, "
                f"got {self.local_epochs} and {self.local_learning_rate}"
            )
        self.local_training  # checks the rest of the local settings
        if self._adapts_clip:  # C is round state from now on, which travels as float32
            object.__setattr__(self, "max_update_norm", clipping_bound(self.max_update_norm, FedAvgError))

    @property
    def local_training(self) -> LocalTraining:
        return LocalTraining(
            epochs=self.local_epochs,
            batch_size=self.local_batch_size,
            learning_rate=self.local_learning_rate,
            optimizer=self.local_optimizer,
        )

    @property
    def rows_per_share(self) -> float:
        """Rounded rows in one hospital's share, at most: its ``max_subclients`` sub-client updates."""
        return float(self.max_subclients)

    @property
    def _adapts_v(self) -> bool:
        return self.subclient_rule == "adaptive"

    @property
    def _adapts_clip(self) -> bool:
        return self.clip_rule == "adaptive"

    @property
    def statistic_slots(self) -> int:
        """Coordinates after the update in each share and release: the norm slot (adaptive v), then the count slot (adaptive C)."""
        return int(self._adapts_v) + int(self._adapts_clip)

    def mechanism(self, dimension: int) -> SkellamMechanism:
        """The mechanism on rows of ``dimension`` update coordinates and the statistic slots, at this round's ``C``."""
        squared_norm_bound = 1 + self._adapts_v * NORM_SLOT_WEIGHT**2 + self._adapts_clip * (COUNT_SLOT_WEIGHT / 2) ** 2
        return SkellamMechanism.calibrate(
            dimension=dimension + self.statistic_slots,
            max_grad_norm=self.max_update_norm * math.sqrt(squared_norm_bound),
            noise_multiplier=self.noise_multiplier,
            quorum=self.quorum,
        )

    def local_step(
        self, model: nn.Module, data: Split, generator: np.random.Generator | None = None
    ) -> "SubclientStep":
        return SubclientStep(model, data, self, generator)

    def levels(self, mechanism: SkellamMechanism, contributors: int, coalition: int) -> dict[str, Release]:
        """One round's release at each level (see the module's docstring for the group sizes)."""
        groups = {"hospital": max(self.max_subclients, 2), "record": 2, "subclient": 1}
        return {
            level: release_of(
                mechanism, sample_rate=1.0, contributors=contributors, coalition=coalition, group_size=groups[level]
            )
            for level in self.LEVELS
        }

    def read_sum(self, total: np.ndarray, contributors: int, parameter_count: int) -> np.ndarray:
        """The released vector a decrypted sum stands for: ``g = -sum / (gamma v K_c)``, then ``S`` (adaptive v), then ``B`` (adaptive C)."""
        total = np.asarray(total, dtype=np.float64)
        scale = self.mechanism(parameter_count).scale
        released = [-total[:parameter_count] / (scale * self.subclients * contributors)]
        slots = iter(total[parameter_count:])
        if self._adapts_v:
            released.append([next(slots) / (scale * NORM_SLOT_WEIGHT)])
        if self._adapts_clip:
            released.append(
                [next(slots) / (scale * COUNT_SLOT_WEIGHT * self.max_update_norm) + self.subclients * contributors / 2]
            )
        return np.concatenate(released).astype("<f4")

    def after_release(self, statistics: np.ndarray, contributors: int, parameter_count: int) -> "DpFedAvgSettings":
        """The next round's settings, from the released statistics and public values alone.

        Adaptive v: ``zeta`` is the noise on the mean update, as in the paper (``sigma = z C / N``
        for ``N`` clients, here ``v K_c`` sub-clients), taken at its expectation: the sum's noise is
        ``Sk(K_c mu)`` per coordinate, of standard deviation ``sqrt(2 K_c mu) / gamma``.
        Adaptive C: the geometric step toward the target quantile (``training.methods.adaptive_clipping``)."""
        statistics = iter(np.asarray(statistics, dtype=np.float64))
        changes = {}
        if self._adapts_v:
            mechanism = self.mechanism(parameter_count)
            sigma = math.sqrt(2 * mechanism.mu(contributors)) / (mechanism.scale * self.subclients * contributors)
            changes["subclients"] = next_subclient_count(
                self.subclients,
                hospitals=contributors,
                noise_norm=expected_noise_norm(sigma, parameter_count),
                update_norm_sum=next(statistics),
                most=self.max_subclients,
            )
        if self._adapts_clip:
            changes["max_update_norm"] = next_clipping_bound(
                self.max_update_norm,
                count=next(statistics),
                subclients=self.subclients * contributors,
                target_quantile=self.target_quantile,
                learning_rate=self.clip_learning_rate,
            )
        return replace(self, **changes)

    def round_state(self) -> dict[str, float]:
        """What changes between rounds and every party must hold alike: ``v`` and ``C``, where they adapt."""
        state = {"subclients": self.subclients} if self._adapts_v else {}
        return {**state, "max_update_norm": self.max_update_norm} if self._adapts_clip else state

    def with_round_state(self, state: dict[str, float]) -> "DpFedAvgSettings":
        """These settings at a ``round_state`` read back from a Welcome or a checkpoint; ``ValueError`` if it cannot be."""
        if set(state) != set(self.round_state()):
            raise ValueError(f"the round state must hold {sorted(self.round_state())}, got {sorted(state)}")
        changes = {}
        if "subclients" in state:
            v = state["subclients"]
            if not (float(v).is_integer() and 1 <= v <= self.max_subclients):
                raise ValueError(f"v = {v} is not a whole number of sub-clients within [1, {self.max_subclients}]")
            changes["subclients"] = int(v)
        if "max_update_norm" in state:
            changes["max_update_norm"] = clipping_bound(state["max_update_norm"], ValueError)
        return replace(self, **changes)

    def update_rule(self, model: nn.Module) -> UpdateRule:
        if self.server_optimizer == "fedadam":
            return FedAdamUpdate(model, learning_rate=self.server_learning_rate)
        return MomentumUpdate(model, learning_rate=self.server_learning_rate, momentum=0.0)

    @classmethod
    def from_flags(cls, values: Any, *, quorum: int) -> "DpFedAvgSettings":
        """The settings of a new run from its flags (``FLAGS``)."""
        if getattr(values, "expected_batch_size", None) is not None:
            raise ValueError("--expected-batch-size is for dopamine runs, not dp-fedavg")
        if values.clip_lr is not None and values.clip_quantile is None:
            raise ValueError("--clip-lr is the step of adaptive clipping: give --clip-quantile too")
        clipping = {}
        if values.clip_quantile is not None:
            clipping = {"clip_rule": "adaptive", "target_quantile": values.clip_quantile}
            if values.clip_lr:
                clipping["clip_learning_rate"] = values.clip_lr
        server_lr = values.server_lr
        if server_lr is None:  # an unknown optimizer is refused by the settings
            server_lr = _SERVER_LEARNING_RATES.get(values.server_optimizer, 1.0)
        return cls(
            noise_multiplier=values.noise_multiplier,
            max_update_norm=values.max_update_norm,
            quorum=quorum,
            subclients=values.subclients,
            subclient_rule="fixed" if values.adaptive_subclients is None else "adaptive",
            max_subclients=values.subclients if values.adaptive_subclients is None else values.adaptive_subclients,
            local_epochs=values.local_epochs,
            local_batch_size=values.local_batch_size,
            local_learning_rate=values.local_lr,
            local_optimizer=values.local_optimizer,
            server_optimizer=values.server_optimizer,
            server_learning_rate=server_lr,
            **clipping,
        )

    def to_dict(self) -> dict:
        return {"method": self.METHOD, **asdict(self)}

    @classmethod
    def from_dict(cls, values: dict) -> "DpFedAvgSettings":
        return from_typed_dict(cls, values, "DP-FedAvg settings", extra={"method": cls.METHOD})


class SubclientStep:
    """One hospital's integer share ``s_k`` of a DP-FedAvg round, for the model's current weights."""

    def __init__(
        self, model: nn.Module, data: Split, settings: DpFedAvgSettings, generator: np.random.Generator | None = None
    ) -> None:
        self._generator = require_cryptographic(secure_generator() if generator is None else generator)
        split_subclients(
            len(data), settings.max_subclients, self._generator
        )  # an impossible split is refused before any round
        self._model, self._data, self.settings = model, data, settings
        self._local = settings.local_training
        self.mechanism = settings.mechanism(parameter_count(model))
        # What a round asks of this hospital, bounded before any round: a server chose the settings.
        if settings.max_subclients * self.mechanism.dimension > _MAX_ROW_VALUES:
            raise FedAvgError(
                f"{settings.max_subclients} sub-client updates of {self.mechanism.dimension:,} values exceed the {_MAX_ROW_VALUES:,} a hospital holds"
            )
        steps = settings.local_epochs * (math.ceil(len(data) / settings.local_batch_size) + settings.max_subclients)
        if steps > _MAX_LOCAL_STEPS:
            raise FedAvgError(f"{steps:,} local steps a round exceed the {_MAX_LOCAL_STEPS:,} a hospital takes")

    def __call__(self) -> tuple[np.ndarray, int]:
        """``(s_k, v)``: the share, and how many sub-client updates it sums."""
        settings, bound = self.settings, self.settings.max_update_norm
        rows = []
        for part in split_subclients(len(self._data), settings.subclients, self._generator):
            clipped, norm = clip_update(
                local_update(self._model, self._data.subset(part), self._local, self._generator), bound
            )
            slots = [NORM_SLOT_WEIGHT * min(norm, bound)] if settings._adapts_v else []
            slots += [COUNT_SLOT_WEIGHT * bound * (float(norm <= bound) - 0.5)] if settings._adapts_clip else []
            rows.append(np.concatenate([clipped, np.asarray(slots, dtype=np.float32)]))
        share = self.mechanism.round_examples(np.stack(rows), self._generator) + self.mechanism.noise_share(
            self._generator
        )
        return share, len(rows)
