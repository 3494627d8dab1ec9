"""DP-FedAvg over intermediaries (Jiang et al., Eq. 1) under secure aggregation: the round's math.

Each round, hospital k splits its records afresh into ``v`` disjoint sub-clients
(``training.fedavg.split_subclients``); each sub-client trains locally from the global model and
clips its update ``Delta_i`` to L2 norm ``C``. The hospital's share is the integer sum of its
sub-clients' updates, each scaled by ``gamma`` and randomly rounded, plus its Skellam noise share
(``training.skellam``, the same mechanism as Dopamine's, with the sub-client update in place of the
example gradient)::

    s_k = sum_{i in k} round(gamma clip(Delta_i, C)) + Sk(mu),    2 mu = z^2 Delta_2^2 / K_min

so a quorum's sum carries at least ``z`` times the sensitivity of one sub-client in noise. Every
hospital has the same public ``v``, so the shares are equal: proportional to the sub-client count,
and robust to the quorum as Dopamine's. Every party reads the mean update as
``u = sum_k s_k / (gamma v K_c)`` and applies the server optimizer to ``g = -u``
(``training.update_rules``: FedAvg, or FedAdam).

**Privacy, at three levels** (``training.accounting.release_of``), for adding or removing, with
no amplification by sampling (every sub-client takes part). Each level is a group of rounded rows
that can move together, each by up to ``Delta_2`` (``Delta_1`` in L1):

- ``subclient`` (group 1): adding or removing one whole sub-client, the paper's unit. Sub-clients
  are drawn afresh each round, so this is a per-round figure, not a lasting unit's;
- ``record`` (group 2): one record added or removed leaves its sub-client in the sum but changes
  its update from ``r`` to ``r'``, both within ``Delta_2``: twice a sub-client's sensitivity;
- ``hospital`` (group ``max(v, 2)``): a hospital's ``v`` sub-clients move together, by up to
  ``v Delta_2``; for ``v = 1`` its records' ``2 Delta_2`` is the larger, so the hospital level
  covers every record too. For ``v >= 2`` it is the privacy of noise multiplier ``z / v`` (exactly
  for the Gaussian; for the Skellam to within its rounding terms).

Hospitals' ledgers are charged at the hospital level, so their budgets bind on what a consortium
member actually is, and every ledger entry, of either method, is also a valid record-level charge.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np
from torch import nn

from training.accounting import Release, release_of
from training.datasets import Split
from training.fedavg import FedAvgError, LocalTraining, clip_update, local_update, split_subclients
from training.secure_random import require_cryptographic, secure_generator
from training.skellam import SkellamMechanism
from training.typed_fields import from_typed_dict
from training.update_rules import MAX_LEARNING_RATE, FedAdamUpdate, MomentumUpdate, UpdateRule

__all__ = ["SERVER_OPTIMIZERS", "DpFedAvgSettings", "SubclientStep"]

SERVER_OPTIMIZERS = ("fedavg", "fedadam")
_MAX_LOCAL_EPOCHS = 100  # settings come from the server: a bound on the work they ask of a hospital


@dataclass(frozen=True)
class DpFedAvgSettings:
    METHOD: ClassVar[str] = "dp-fedavg"
    LEVELS: ClassVar[tuple[str, ...]] = ("hospital", "record", "subclient")  # the first is the one ledgers charge

    noise_multiplier: float  # z: noise of a quorum's sum, in units of one sub-client's sensitivity
    max_update_norm: float  # C
    quorum: int  # K_min
    subclients: int  # v: sub-clients per hospital, the same at every hospital
    local_epochs: int
    local_batch_size: int
    local_learning_rate: float
    local_optimizer: str
    server_optimizer: str
    server_learning_rate: float

    def __post_init__(self) -> None:
        if not self.noise_multiplier >= 0:
            raise FedAvgError(f"noise_multiplier must be non-negative, got {self.noise_multiplier}")
        if not self.max_update_norm > 0:
            raise FedAvgError(f"max_update_norm must be positive, got {self.max_update_norm}")
        if self.quorum < 1 or self.subclients < 1:
            raise FedAvgError(f"quorum and subclients must be at least 1, got {self.quorum} and {self.subclients}")
        if self.server_optimizer not in SERVER_OPTIMIZERS:
            raise FedAvgError(f"unknown server optimizer {self.server_optimizer!r}; choose one of {', '.join(SERVER_OPTIMIZERS)}")
        if not 0 < self.server_learning_rate <= MAX_LEARNING_RATE:
            raise FedAvgError(f"the server learning rate must be in (0, {MAX_LEARNING_RATE:g}], got {self.server_learning_rate}")
        if self.local_epochs > _MAX_LOCAL_EPOCHS or self.local_learning_rate > MAX_LEARNING_RATE:
            raise FedAvgError(
                f"local training is limited to {_MAX_LOCAL_EPOCHS} epochs and a learning rate of {MAX_LEARNING_RATE:g}, "
                f"got {self.local_epochs} and {self.local_learning_rate}"
            )
        self.local_training  # checks the rest of the local settings

    @property
    def local_training(self) -> LocalTraining:
        return LocalTraining(
            epochs=self.local_epochs, batch_size=self.local_batch_size,
            learning_rate=self.local_learning_rate, optimizer=self.local_optimizer,
        )  # fmt: skip

    @property
    def rows_per_share(self) -> float:
        """Rounded rows in one hospital's share: its ``v`` sub-client updates."""
        return float(self.subclients)

    def mechanism(self, dimension: int) -> SkellamMechanism:
        return SkellamMechanism.calibrate(
            dimension=dimension, max_grad_norm=self.max_update_norm, noise_multiplier=self.noise_multiplier, quorum=self.quorum
        )

    def local_step(self, model: nn.Module, data: Split, generator: np.random.Generator | None = None) -> "SubclientStep":
        return SubclientStep(model, data, self, generator)

    def levels(self, mechanism: SkellamMechanism, contributors: int) -> dict[str, Release]:
        """One round's release at each level (see the module's docstring for the group sizes)."""
        groups = {"hospital": max(self.subclients, 2), "record": 2, "subclient": 1}
        return {level: release_of(mechanism, sample_rate=1.0, contributors=contributors, group_size=groups[level]) for level in self.LEVELS}

    def direction(self, total: np.ndarray, contributors: int, mechanism: SkellamMechanism) -> np.ndarray:
        """``g = -u``, ``u = sum / (gamma v K_c)``: the descent direction a decrypted sum stands for."""
        scale = mechanism.scale * self.subclients * contributors
        return (-np.asarray(total, dtype=np.float64) / scale).astype("<f4")

    def update_rule(self, model: nn.Module) -> UpdateRule:
        if self.server_optimizer == "fedadam":
            return FedAdamUpdate(model, learning_rate=self.server_learning_rate)
        return MomentumUpdate(model, learning_rate=self.server_learning_rate, momentum=0.0)

    def to_dict(self) -> dict:
        return {"method": self.METHOD, **asdict(self)}

    @classmethod
    def from_dict(cls, values: dict) -> "DpFedAvgSettings":
        return from_typed_dict(cls, values, "DP-FedAvg settings", extra={"method": cls.METHOD})


class SubclientStep:
    """One hospital's integer share ``s_k`` of a DP-FedAvg round, for the model's current weights."""

    def __init__(self, model: nn.Module, data: Split, settings: DpFedAvgSettings, generator: np.random.Generator | None = None) -> None:
        self._generator = require_cryptographic(secure_generator() if generator is None else generator)
        split_subclients(len(data), settings.subclients, self._generator)  # an impossible split is refused before any round
        self._model, self._data, self._settings = model, data, settings
        self._local = settings.local_training
        self.mechanism = settings.mechanism(sum(p.numel() for p in model.parameters()))

    def __call__(self) -> tuple[np.ndarray, int]:
        """``(s_k, v)``: the share, and how many sub-client updates it sums."""
        parts = split_subclients(len(self._data), self._settings.subclients, self._generator)
        updates = np.stack(
            [
                clip_update(local_update(self._model, self._data.subset(part), self._local, self._generator), self._settings.max_update_norm)[0]
                for part in parts
            ]
        )
        share = self.mechanism.round_examples(updates, self._generator) + self.mechanism.noise_share(self._generator)
        return share, len(parts)
