"""Dopamine (Malekzadeh et al., Algorithm 1): one DP-SGD step per hospital per round.

At round t, hospital k

- (line 7) samples ``D_k^t``, each of its records independently with probability ``q``;
- (lines 9-10) computes per-example gradients (Opacus's ``GradSampleModule``) and clips each to
  L2 norm ``C``;
- (line 12) turns them into its integer share of the sum and adds its share of the noise
  (``training.privacy.skellam``: each example scaled by ``gamma`` and randomly rounded, Skellam noise)::

      s_k = sum_{i in D_k^t} round(gamma clip(grad_i)) + Sk(mu),    2 mu = sigma^2 Delta_2^2 / K_min

The ``s_k`` are summed under encryption, modulo ``t``. A sum of ``K_c >= K_min`` shares carries
``Sk(K_c mu)``, at least central DP-SGD's noise with multiplier sigma (``training.privacy.accounting``
turns this into epsilon). Every party reads the mean gradient as ``sum_k s_k / (gamma B K_c)``.
Three departures from the paper, all to keep that guarantee true:

- Noise is integer and added after rounding, so the sum's law is exactly known (Skellam shares
  add up to a Skellam); rounded real noise would only approximate it.
- The noise is split over the quorum ``K_min``, not over all ``K`` hospitals: with ``sigma^2/K``
  each, a single dropout leaves the sum under-noised. A round with fewer than ``K_min``
  contributions is never decrypted.
- ``B`` is a federation-wide public constant (``q`` times the expected size of a hospital's data),
  not the sampled batch size: dividing by ``|D_k^t|`` would make the sensitivity depend on the
  data. An empty batch still contributes its noise.

Sampling, rounding and noise draw from a ChaCha20 generator keyed by the OS
(``training.privacy.secure_random``); Opacus computes per-example gradients and nothing else.

Momentum (lines 13-14, ``training.methods.update_rules``) is applied to the decrypted mean by every party alike,
``m <- beta m + mean_k g_k``, ``w <- w - lr m``. When every hospital contributes every round this
equals the mean of the hospitals' local momentum buffers (the paper's Appendix C, Eq. 5); keeping
the momentum of the mean instead means a hospital's ``g_k`` only ever leaves it inside a sum of at
least ``K_min`` noise shares, also when the set of contributors changes between rounds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np
from torch import nn

from consilium.training.privacy.accounting import Release, release_of
from consilium.training.data.datasets import Split
from consilium.training.methods.flags import Flag, below_one, non_negative_float, positive_float, rate
from consilium.training.methods.per_example import ClippedGradients
from consilium.training.privacy.secure_random import require_cryptographic, secure_generator
from consilium.training.privacy.skellam import SkellamMechanism
from consilium.training.methods.typed_fields import from_typed_dict
from consilium.training.methods.update_rules import MAX_LEARNING_RATE, MomentumUpdate

__all__ = ["DopamineSettings", "NoisyGradientStep", "mean_gradient"]


@dataclass(frozen=True)
class DopamineSettings:
    METHOD: ClassVar[str] = "dopamine"
    LEVELS: ClassVar[tuple[str, ...]] = ("record",)
    FLAGS: ClassVar[tuple[Flag, ...]] = (
        Flag("--sample-rate", rate, 0.1, "q, probability that a record is in a round's batch (Poisson sampling)"),
        Flag(
            "--noise-multiplier",
            non_negative_float,
            2.3,
            "sigma: noise of a quorum's sum, in units of one record's sensitivity",
        ),
        Flag("--max-grad-norm", positive_float, 1.0, "C, per-example gradient clipping norm"),
        # One rate for all data: on the validation AUC of PneumoniaMNIST and of a 1,000-record subset, 0.05
        # did best on the mean against 0.15 and 0.5 (docs/how-to/baselines-and-comparison.md, "The learning rate").
        Flag("--lr", positive_float, 0.05, "learning rate"),
        Flag("--momentum", below_one, 0.9, "momentum, applied to the decrypted mean gradient"),
    )
    DEFAULTS: ClassVar[dict[str, Any]] = {"rounds": 100, "epsilon_budget": 3.0}

    sample_rate: float  # q
    noise_multiplier: float  # sigma: noise of a quorum's sum, in units of the sensitivity
    max_grad_norm: float  # C
    quorum: int  # K_min: contributions needed before a sum may be decrypted
    expected_batch_size: float  # B: the federation-wide divisor, a public figure
    learning_rate: float
    momentum: float

    def __post_init__(self) -> None:
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if not self.noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be non-negative, got {self.noise_multiplier}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {self.max_grad_norm}")
        if self.quorum < 1:
            raise ValueError(f"quorum must be at least 1, got {self.quorum}")
        if not self.expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be positive, got {self.expected_batch_size}")
        if not 0 < self.learning_rate <= MAX_LEARNING_RATE:
            raise ValueError(f"learning_rate must be in (0, {MAX_LEARNING_RATE:g}], got {self.learning_rate}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")

    @property
    def rows_per_share(self) -> float:
        """Rounded rows in one hospital's share, on average: its expected batch size ``B``."""
        return self.expected_batch_size

    def mechanism(self, dimension: int) -> SkellamMechanism:
        """The integer mechanism for a model of ``dimension`` parameters."""
        return SkellamMechanism.calibrate(
            dimension=dimension,
            max_grad_norm=self.max_grad_norm,
            noise_multiplier=self.noise_multiplier,
            quorum=self.quorum,
        )

    def local_step(
        self, model: nn.Module, data: Split, generator: np.random.Generator | None = None
    ) -> "NoisyGradientStep":
        return NoisyGradientStep(model, data.x, data.y, self, generator)

    def levels(self, mechanism: SkellamMechanism, contributors: int, coalition: int) -> dict[str, Release]:
        """One round's release for a record (``training.privacy.accounting``)."""
        return {
            "record": release_of(
                mechanism, sample_rate=self.sample_rate, contributors=contributors, coalition=coalition
            )
        }

    def read_sum(self, total: np.ndarray, contributors: int, parameter_count: int) -> np.ndarray:
        """The released vector a decrypted sum stands for: the mean gradient."""
        return mean_gradient(total, contributors, mechanism=self.mechanism(parameter_count), settings=self)

    def after_release(self, statistics: np.ndarray, contributors: int, parameter_count: int) -> "DopamineSettings":
        """Every round has the same settings."""
        return self

    def round_state(self) -> dict[str, float]:
        return {}

    def with_round_state(self, state: dict[str, float]) -> "DopamineSettings":
        if state:
            raise ValueError(f"Dopamine has no round state, got {sorted(state)}")
        return self

    def update_rule(self, model: nn.Module) -> MomentumUpdate:
        return MomentumUpdate(model, learning_rate=self.learning_rate, momentum=self.momentum)

    @classmethod
    def from_flags(cls, values: Any, *, quorum: int) -> "DopamineSettings":
        """The settings of a new run from its flags (``FLAGS``, and the launcher's ``--expected-batch-size``)."""
        if getattr(values, "expected_batch_size", None) is None:
            raise ValueError("--expected-batch-size is required for a new Dopamine run")
        return cls(
            sample_rate=values.sample_rate,
            noise_multiplier=values.noise_multiplier,
            max_grad_norm=values.max_grad_norm,
            quorum=quorum,
            expected_batch_size=values.expected_batch_size,
            learning_rate=values.lr,
            momentum=values.momentum,
        )

    def to_dict(self) -> dict:
        return {"method": self.METHOD, **asdict(self)}

    @classmethod
    def from_dict(cls, values: dict) -> "DopamineSettings":
        return from_typed_dict(cls, values, "Dopamine settings", extra={"method": cls.METHOD})


class NoisyGradientStep:
    """Lines 7-12 of Algorithm 1 at one hospital: its integer share ``s_k`` for the model's current weights."""

    def __init__(
        self,
        model: nn.Module,
        x: np.ndarray,
        y: np.ndarray,
        settings: DopamineSettings,
        generator: np.random.Generator | None = None,
    ) -> None:
        if len(y) == 0:
            raise ValueError("a hospital needs at least one record")
        self._generator = require_cryptographic(secure_generator() if generator is None else generator)
        self.settings = settings
        self._gradients = ClippedGradients(model, x, y, settings.max_grad_norm)
        self.mechanism = settings.mechanism(self._gradients.dimension)

    def __call__(self) -> tuple[np.ndarray, int]:
        """``(s_k, |D_k^t|)``. The batch size stays at the hospital (it is not protected by DP)."""
        indices = np.flatnonzero(self._generator.random(self._gradients.records) < self.settings.sample_rate)
        share = np.zeros(self.mechanism.dimension, dtype=np.int64)
        for examples in self._gradients.batches(indices):
            share += self.mechanism.round_examples(examples, self._generator)
        return share + self.mechanism.noise_share(self._generator), len(indices)


def mean_gradient(
    total: np.ndarray, contributors: int, *, mechanism: SkellamMechanism, settings: DopamineSettings
) -> np.ndarray:
    """The mean gradient a decrypted sum of ``contributors`` shares stands for: ``sum / (gamma B K_c)``."""
    scale = mechanism.scale * settings.expected_batch_size * contributors
    return (np.asarray(total, dtype=np.float64) / scale).astype("<f4")
