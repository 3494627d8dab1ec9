"""Gaussian DP-SGD (Abadi et al. 2016) on one dataset: the record-level baselines' optimizer.

Each step samples every record independently with probability ``q`` (Poisson), clips each sampled
record's gradient to ``C`` (``training.methods.per_example``), adds ``N(0, sigma^2 C^2 I)`` and divides
by an expected batch size ``B`` fixed from public figures (q times the data set's published
training size, say), never from ``n``, the count of records the optimizer holds: under add/remove
adjacency ``n`` is private, and a divisor ``q n`` would show it in the scale of every step (the
sampled size is private too). It then takes an SGD step with momentum. Sampling and noise draw
from ``training.privacy.secure_random``.

The accountant is Opacus's PRV (RDP as the option) over ``(sigma, q, steps)``;
``noise_multiplier_for`` finds the smallest ``sigma`` (to Opacus's tolerance) for a target epsilon.
"""

from __future__ import annotations

import warnings

import numpy as np
from torch import nn

from consilium.training.data.datasets import Split
from consilium.training.methods.update_rules import MomentumUpdate
from consilium.training.methods.per_example import ClippedGradients
from consilium.training.privacy.secure_random import require_cryptographic, secure_generator

__all__ = ["GAUSSIAN_ACCOUNTANTS", "GaussianDpSgd", "dp_sgd_epsilon", "gaussian_accountant", "noise_multiplier_for"]

GAUSSIAN_ACCOUNTANTS = ("prv", "rdp")


def gaussian_accountant(name: str):
    """A fresh Opacus accountant for subsampled Gaussian steps: PRV (the default) or RDP."""
    from opacus.accountants import (
        PRVAccountant,
        RDPAccountant,
    )  # here, not at the top: Opacus costs a process about 1.4 s of CPU to load, which parties that never train skip

    if name not in GAUSSIAN_ACCOUNTANTS:
        raise ValueError(f"unknown accountant {name!r}; choose one of {', '.join(GAUSSIAN_ACCOUNTANTS)}")
    return PRVAccountant() if name == "prv" else RDPAccountant()


def noise_multiplier_for(
    epsilon: float, delta: float, *, sample_rate: float, steps: int, accountant: str = "prv"
) -> float:
    """The noise multiplier that spends ``epsilon`` at ``delta`` over ``steps`` steps at rate ``sample_rate``."""
    # Imported here, not at the top: Opacus costs a process about 1.4 s of CPU to load, which parties
    # that never train (a tallier, a voting server) skip.
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the (largest|smallest) alpha")
        return float(
            get_noise_multiplier(
                target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate, steps=steps, accountant=accountant
            )
        )


def dp_sgd_epsilon(
    delta: float, *, noise_multiplier: float, sample_rate: float, steps: int, accountant: str = "prv"
) -> float:
    composed = gaussian_accountant(accountant)
    composed.history = [(noise_multiplier, sample_rate, steps)]
    return float(composed.get_epsilon(delta))


class GaussianDpSgd:
    """DP-SGD steps on ``model`` over ``data``; ``steps_taken`` is what the accountant composes."""

    def __init__(
        self,
        model: nn.Module,
        data: Split,
        *,
        sample_rate: float,
        expected_batch_size: float,
        noise_multiplier: float,
        max_grad_norm: float,
        learning_rate: float,
        momentum: float = 0.0,
        generator: np.random.Generator | None = None,
    ) -> None:
        if len(data) == 0:
            raise ValueError("DP-SGD needs at least one record")
        if not expected_batch_size > 0:
            raise ValueError(f"the expected batch size must be positive, got {expected_batch_size}")
        self._generator = require_cryptographic(secure_generator() if generator is None else generator)
        self._gradients = ClippedGradients(model, data.x, data.y, max_grad_norm)
        self._update = MomentumUpdate(model, learning_rate=learning_rate, momentum=momentum)
        self._sample_rate = sample_rate
        self._noise_std = noise_multiplier * max_grad_norm
        self._divisor = expected_batch_size  # public: never len(data)
        self.steps_taken = 0

    def step(self) -> None:
        indices = np.flatnonzero(self._generator.random(self._gradients.records) < self._sample_rate)
        total = np.zeros(self._gradients.dimension)
        for examples in self._gradients.batches(indices):
            total += examples.sum(axis=0)
        total += self._generator.normal(0.0, self._noise_std, self._gradients.dimension)
        self._update.apply(total / self._divisor)
        self.steps_taken += 1
