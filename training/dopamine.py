"""Dopamine (Malekzadeh et al., Algorithm 1): one DP-SGD step per hospital per round, with Opacus.

At round t, hospital k

- (line 7) samples ``D_k^t``, each of its records independently with probability ``q``;
- (lines 9-10) computes per-example gradients and clips each to L2 norm ``C``;
- (line 12) adds its share of the Gaussian noise and divides by a constant ``B``::

      g_k = ( sum_{i in D_k^t} clip(grad_i) + N(0, sigma^2 C^2 / K_min I) ) / B

The ``g_k`` are summed under encryption. A sum of ``K_c >= K_min`` shares carries noise of variance
``K_c sigma^2 C^2 / K_min >= sigma^2 C^2``: at least central DP-SGD's noise with multiplier sigma
(``training.accounting`` turns this into epsilon). Two departures from the paper, both to keep that
guarantee true:

- The noise is split over the quorum ``K_min``, not over all ``K`` hospitals: with ``sigma^2/K``
  each, a single dropout leaves the sum under-noised. A round with fewer than ``K_min``
  contributions is never decrypted.
- ``B`` is a federation-wide constant (``q`` times the expected size of a hospital's data), not the
  sampled batch size: dividing by ``|D_k^t|`` would make the sensitivity depend on the data. An
  empty batch still contributes its noise.

Momentum (lines 13-14) is applied to the decrypted mean by every party alike,
``m <- beta m + mean_k g_k``, ``w <- w - lr m``. When every hospital contributes every round this
equals the mean of the hospitals' local momentum buffers (the paper's Appendix C, Eq. 5); keeping
the momentum of the mean instead means a hospital's ``g_k`` only ever leaves it inside a sum of at
least ``K_min`` noise shares, also when the set of contributors changes between rounds.
"""

from __future__ import annotations

import math
import secrets
import warnings
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from opacus.validators import ModuleValidator
from torch import nn

__all__ = ["DopamineSettings", "EncodingRange", "MomentumUpdate", "NoisyGradientStep", "encoding_range"]

# Headroom for the encoding range, in standard deviations: of the Poisson batch size above its mean,
# and of a hospital's noise share. Exceeding it clamps a coordinate; clamps are counted and reported.
_BATCH_SIZE_TAIL = 4.0
_NOISE_TAIL = 6.0
# Fixed-point step as a fraction of a hospital's noise standard deviation: the rounding error's
# variance is then 1 / (12 * 64^2) of the noise variance, negligible beside it.
_STEPS_PER_NOISE_STD = 64
_STEPS_WITHOUT_NOISE = 2**16


@dataclass(frozen=True)
class DopamineSettings:
    sample_rate: float  # q
    noise_multiplier: float  # sigma: noise of a quorum's sum, in units of max_grad_norm
    max_grad_norm: float  # C
    quorum: int  # K_min: contributions needed before a sum may be decrypted
    expected_batch_size: float  # B: the federation-wide divisor
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
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be positive, got {self.learning_rate}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")

    @property
    def share_noise_multiplier(self) -> float:
        """The noise multiplier of one hospital's share: sigma / sqrt(K_min)."""
        return self.noise_multiplier / math.sqrt(self.quorum)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "DopamineSettings":
        names = {f.name for f in fields(cls)}
        if set(values) != names:
            raise ValueError(f"Dopamine settings need exactly {sorted(names)}, got {sorted(values)}")
        try:
            return cls(**{name: float(values[name]) if name != "quorum" else int(values[name]) for name in names})
        except (TypeError, ValueError) as error:
            raise ValueError(f"malformed Dopamine settings: {error}") from None


@dataclass(frozen=True)
class EncodingRange:
    bound: float  # per-coordinate bound on g_k
    precision: float  # largest acceptable fixed-point step


def encoding_range(settings: DopamineSettings) -> EncodingRange:
    """The range and precision in which a hospital's ``g_k`` must be encoded.

    A coordinate of the clipped sum is at most ``|D_k^t| C`` (all of each example's norm in it),
    and ``|D_k^t| <= B + 4 sqrt(B)`` for all but ~3e-5 of rounds; the noise share has standard
    deviation ``s = sigma C / (sqrt(K_min) B)`` after the division, and stays within 6 s. So

        bound = C (1 + 4 / sqrt(B)) + 6 s,    precision = s / 64

    (``bound / 2^16`` when there is no noise).
    """
    batch = settings.expected_batch_size
    noise_std = settings.share_noise_multiplier * settings.max_grad_norm / batch
    bound = settings.max_grad_norm * (1 + _BATCH_SIZE_TAIL / math.sqrt(batch)) + _NOISE_TAIL * noise_std
    precision = noise_std / _STEPS_PER_NOISE_STD if noise_std > 0 else bound / _STEPS_WITHOUT_NOISE
    return EncodingRange(bound=bound, precision=precision)


class NoisyGradientStep:
    """Lines 7-12 of Algorithm 1 at one hospital: returns ``g_k`` for the model's current weights."""

    def __init__(self, model: nn.Module, x: np.ndarray, y: np.ndarray, settings: DopamineSettings) -> None:
        errors = ModuleValidator.validate(model, strict=False)
        if errors:
            raise ValueError(f"model is not compatible with per-example gradients: {errors[0]}")
        if len(y) == 0:
            raise ValueError("a hospital needs at least one record")
        self._x = torch.as_tensor(x)
        self._y = torch.as_tensor(y)
        # Seeded from the OS: a hospital's sampling and noise must not be predictable by anyone.
        generator = torch.Generator().manual_seed(secrets.randbits(63))
        self._module = GradSampleModule(model, loss_reduction="sum")
        self._optimizer = DPOptimizer(
            # DPOptimizer only clips, noises and scales here (pre_step); weights move in MomentumUpdate.
            torch.optim.SGD(self._module.parameters(), lr=0.0),
            noise_multiplier=settings.share_noise_multiplier,
            max_grad_norm=settings.max_grad_norm,
            expected_batch_size=settings.expected_batch_size,
            # "mean" here means: divide the noisy sum by expected_batch_size. The loss below is a sum,
            # and the GradSampleModule is told so, so per-example gradients are not rescaled.
            loss_reduction="mean",
            generator=generator,
            secure_mode=True,
        )
        self._batches = iter(
            UniformWithReplacementSampler(
                num_samples=len(self._y), sample_rate=settings.sample_rate, generator=generator, steps=2**62
            )
        )

    def __call__(self) -> tuple[np.ndarray, int]:
        """``(g_k, |D_k^t|)``. The batch size stays at the hospital (it is not protected by DP)."""
        indices = next(self._batches)
        self._module.train()
        self._optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self._module(self._x[indices]), self._y[indices], reduction="sum")
        with warnings.catch_warnings():
            # Opacus's hooks fire on outputs because the inputs need no gradient; that is expected.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss.backward()
        self._optimizer.pre_step()
        gradient = torch.cat([p.grad.reshape(-1) for p in self._module.parameters()])
        return gradient.detach().numpy().astype(np.float32), len(indices)


class MomentumUpdate:
    """Lines 13-14 on the decrypted mean, identical at every party: ``m <- beta m + g``, ``w <- w - lr m``."""

    def __init__(self, model: nn.Module, settings: DopamineSettings) -> None:
        self._parameters = list(model.parameters())
        self._optimizer = torch.optim.SGD(self._parameters, lr=settings.learning_rate, momentum=settings.momentum)

    def apply(self, mean_gradient: np.ndarray) -> None:
        gradient = torch.as_tensor(np.asarray(mean_gradient, dtype=np.float32))
        expected = sum(p.numel() for p in self._parameters)
        if gradient.shape != (expected,):
            raise ValueError(f"expected a gradient of {expected} values, got shape {tuple(gradient.shape)}")
        for parameter, values in zip(self._parameters, gradient.split([p.numel() for p in self._parameters])):
            parameter.grad = values.view_as(parameter).clone()
        self._optimizer.step()
