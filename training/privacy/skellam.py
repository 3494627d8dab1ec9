"""The distributed Skellam mechanism (Agarwal, Kairouz and Liu, NeurIPS 2021) on integer gradients.

Secure aggregation adds integers modulo ``t``, so the mechanism works on integers throughout and its
privacy is exact, with no rounding of real noise:

1. **Conditional randomized rounding, per example** (Kairouz, Liu and Steinke, ICML 2021). Each
   clipped example gradient ``g`` (``||g||_2 <= C``) is scaled by ``gamma`` and each coordinate
   rounded up with probability equal to its fractional part, so the result is unbiased. A rounding
   whose L2 norm exceeds ``Delta_2`` is drawn again. For ``x = gamma C`` and ``d`` coordinates a
   rounding meets

       ||round(gamma g)||^2 <= x^2 + d/4 + c (x + sqrt(d)/2),   c = sqrt(2 ln(1/beta)),

   with probability at least ``1 - beta``; that right-hand side is ``Delta_2^2``. With ``c = 2``
   a redraw is needed about once in seven examples. Adding or removing one record therefore moves a
   hospital's integer sum by an integer vector of L2 norm at most ``Delta_2``, and of L1 norm at
   most ``Delta_1 = min(Delta_2^2, sqrt(d) Delta_2)`` (an integer's absolute value is at most its
   square). ``gamma`` is the smallest scale at which ``Delta_2 <= 1.01 gamma C``: rounding costs
   1% of the noise.
2. **Skellam noise shares.** Each hospital adds ``Sk(mu) = Poisson(mu) - Poisson(mu)`` to every
   coordinate, with ``2 mu = sigma^2 Delta_2^2 / K_min``. Skellam variables add exactly:
   ``K_c`` shares sum to ``Sk(K_c mu)``, whose variance ``K_c sigma^2 Delta_2^2 / K_min`` is at
   least central DP-SGD's ``(sigma Delta_2)^2`` once ``K_c >= K_min``. An observer who knows ``k``
   shares faces ``Sk((K_c - k) mu)``. ``training.privacy.rdp`` turns this into Renyi DP.
3. **Reduction modulo t** is post-processing of the noisy sum, so it cannot weaken the guarantee;
   it can only corrupt a coordinate whose sum leaves the bound (and the other values sharing its
   slot, ``crypto.slot_digits``). ``sum_bound`` gives a bound on the sum and the probability that
   any coordinate exceeds it; the BFV plaintext modulus is sized from it (``protocol.run.config``), so
   nothing is ever clamped.

All draws come from ``training.privacy.secure_random``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from consilium.training.privacy.secure_random import uniform

__all__ = ["SkellamMechanism", "SumBound", "bernstein_deviation"]

_ROUNDING_TAIL = 2.0  # c = sqrt(2 ln(1/beta)): beta = e^-2, a redraw for ~13.5% of examples
_SENSITIVITY_INFLATION = 1.01  # Delta_2 <= 1.01 gamma C
_MAX_ROUNDING_DRAWS = 100
# The sum stays within its bound in every coordinate except with probability below 2^-30 per round:
# half for the batch sizes, half for the noise over all coordinates.
_WRAP_LOG_PROBABILITY = -30 * math.log(2)


@dataclass(frozen=True)
class SumBound:
    levels: int  # |sum| <= levels in every coordinate ...
    wrap_probability: float  # ... except with at most this probability per round


@dataclass(frozen=True)
class SkellamMechanism:
    dimension: int  # d
    scale: float  # gamma: integer levels per unit of gradient
    l2_sensitivity: float  # Delta_2, in levels
    l1_sensitivity: float  # Delta_1, in levels
    share_mu: float  # mu of one hospital's share: each coordinate gets Poisson(mu) - Poisson(mu)

    @classmethod
    def calibrate(
        cls, *, dimension: int, max_grad_norm: float, noise_multiplier: float, quorum: int
    ) -> "SkellamMechanism":
        """Scale, sensitivities and noise for ``d`` coordinates, clipping norm C, sigma and K_min."""
        if dimension < 1 or quorum < 1 or not max_grad_norm > 0 or not noise_multiplier >= 0:
            raise ValueError("need dimension >= 1, quorum >= 1, max_grad_norm > 0 and noise_multiplier >= 0")
        c, d = _ROUNDING_TAIL, dimension
        excess = _SENSITIVITY_INFLATION**2 - 1
        constant = d / 4 + c * math.sqrt(d) / 2
        # Smallest x = gamma C with (1.01 x)^2 >= x^2 + d/4 + c (x + sqrt(d)/2).
        x = (c + math.sqrt(c * c + 4 * excess * constant)) / (2 * excess)
        l2 = math.sqrt(x * x + c * x + constant)
        return cls(
            dimension=d,
            scale=x / max_grad_norm,
            l2_sensitivity=l2,
            l1_sensitivity=min(l2 * l2, math.sqrt(d) * l2),
            share_mu=(noise_multiplier * l2) ** 2 / (2 * quorum),
        )

    def round_examples(self, examples: np.ndarray, generator: np.random.Generator) -> np.ndarray:
        """The integer sum of the scaled, conditionally rounded rows of ``examples`` (each of norm <= C)."""
        rows = np.asarray(examples).reshape(-1, self.dimension)
        if not np.all(np.isfinite(rows)):  # before any draw: a refused batch takes nothing from the generator
            raise ValueError("the example gradients are not finite: training has diverged")
        total = np.zeros(self.dimension, dtype=np.int64)
        for row in rows:  # one row at a time: a batch's worth of float64 temporaries would be refaulted every step
            total += self._round_row(row, generator)
        return total

    def _round_row(self, row: np.ndarray, generator: np.random.Generator) -> np.ndarray:
        scaled = row.astype(np.float64) * self.scale
        if not np.all(np.isfinite(scaled)):
            raise ValueError("the example gradients overflow at this rounding scale")
        floor = np.floor(scaled)
        fraction = scaled - floor
        for _ in range(_MAX_ROUNDING_DRAWS):
            draw = floor + (uniform(generator, self.dimension) < fraction)
            if draw @ draw <= self.l2_sensitivity**2:
                return draw.astype(np.int64)
        # Each draw fails with probability below e^-2 for an example of norm <= C: 100 in a row never do.
        raise ValueError(
            f"an example of norm above the clipping bound could not be rounded within {self.l2_sensitivity:.1f}"
        )

    def noise_share(self, generator: np.random.Generator, *, values: int | None = None) -> np.ndarray:
        """One hospital's noise: ``Sk(mu)`` in every coordinate, or in each of ``values`` values (a pool of them)."""
        count = self.dimension if values is None else values
        return generator.poisson(self.share_mu, count) - generator.poisson(self.share_mu, count)

    def mu(self, contributors: int, known_shares: int = 0) -> float:
        """The Skellam parameter of a sum of ``contributors`` shares to someone who knows ``known_shares`` of them."""
        if not 0 <= known_shares <= contributors:
            raise ValueError(f"known_shares must be between 0 and {contributors}, got {known_shares}")
        return (contributors - known_shares) * self.share_mu

    def sum_bound(self, *, contributors: int, expected_batch_size: float) -> SumBound:
        """A bound on every coordinate of a sum of ``contributors`` shares, and how rarely it fails.

        The records sampled over all contributors number ``m``, a sum of Bernoulli variables with mean
        ``lambda = K B``; each adds at most ``floor(Delta_2)`` to a coordinate. The noise is
        ``Sk(K mu)``, a sum of unit jumps with variance ``2 K mu``. Bernstein's inequality bounds both
        tails: ``P(X - E X >= a) <= exp(-a^2 / (2 (v + a/3)))`` for variance ``v``.
        """
        log_half = _WRAP_LOG_PROBABILITY - math.log(2)
        batch_mean = contributors * expected_batch_size
        records = batch_mean + bernstein_deviation(batch_mean, -log_half)
        # Two-sided, and over every coordinate: per coordinate at most half / (2 d).
        noise = bernstein_deviation(2 * contributors * self.share_mu, -(log_half - math.log(2 * self.dimension)))
        levels = math.ceil(math.floor(records) * math.floor(self.l2_sensitivity) + noise)
        return SumBound(levels=levels, wrap_probability=math.exp(_WRAP_LOG_PROBABILITY))


def bernstein_deviation(variance: float, log_inverse_probability: float) -> float:
    """The ``a`` at which ``exp(-a^2 / (2 (variance + a/3)))`` equals ``exp(-log_inverse_probability)``."""
    L = log_inverse_probability
    return L / 3 + math.sqrt(L * L / 9 + 2 * L * variance)
