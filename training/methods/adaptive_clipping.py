"""Adaptive clipping for DP-FedAvg (Andrew et al. 2021, "Differentially private learning with adaptive clipping").

With ``clip_rule="adaptive"`` (``training.methods.dp_fedavg``) the clipping bound ``C`` follows the
``target_quantile`` of the sub-clients' update norms. Each row carries one more coordinate, whether
its update was within this round's ``C_t``, centred and weighted by ``beta``
(``COUNT_SLOT_WEIGHT``)::

    b_i = 1[||Delta_i|| <= C_t],    slot_i = beta C_t (b_i - 1/2),    |slot_i| = beta C_t / 2

so the rows' bound becomes ``C_t sqrt(1 + beta^2 / 4)`` (with the norm slot's ``alpha^2`` inside
too when ``v`` adapts), and the slot is released, noised and accounted with the update. Every party
reads the noisy count ``B = slot / (gamma beta C_t) + v K_c / 2`` and moves alike to
(``next_clipping_bound``)::

    C_{t+1} = C_t exp(-eta_C (B / (v K_c) - target_quantile))

(the paper's geometric update, ``eta_C = clip_learning_rate``), rounded to float32 so that it
travels exactly in a Welcome or a checkpoint, within ``[2^-20, 2^20]`` (``clipping_bound``); the
fraction ``B / (v K_c)`` is first kept within ``[0, 1]``, post-processing that bounds what noise or
a hostile contributor's slot can do to one step. The count's noise has standard deviation
``1.01 z sqrt(1 + ...) sqrt(K_c / K_min) / beta`` sub-clients: ``1.13 z`` at ``beta = 1`` (``1.16 z``
when v adapts too) for a full quorum. An empty sub-client (``v`` near a hospital's record count)
counts as within ``C``. Every rounded row is
calibrated to ``C_t`` times that bound, so ``C_t`` changes only the scale ``gamma``: the
sensitivities and the noise in integer levels, which the ledgers and the plain modulus see, are
every round's, and changing ``C`` costs no privacy beyond the count's share of the release.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["COUNT_SLOT_WEIGHT", "clipping_bound", "next_clipping_bound"]

# beta: the count's noise is about z / beta sub-clients; the update pays sqrt(1 + beta^2 / 4), 12% at 1.
COUNT_SLOT_WEIGHT = 1.0
# Adaptive C stays within these powers of two, exact in float32 (as C travels), so that it stays a number.
_LEAST_CLIP, _MOST_CLIP = 2.0**-20, 2.0**20


def clipping_bound(value: float, error: type[Exception]) -> float:
    """An adaptive C as it travels, in float32, or ``error`` if it is outside ``[2^-20, 2^20]`` (NaN too)."""
    bound = float(np.float32(value)) if _LEAST_CLIP / 2 <= value <= 2 * _MOST_CLIP else math.nan  # NaN fails below
    if not _LEAST_CLIP <= bound <= _MOST_CLIP:
        raise error(f"C = {value} is not a clipping bound within [2^-20, 2^20] (adaptive clipping)")
    return bound


def next_clipping_bound(
    current: float, *, count: float, subclients: int, target_quantile: float, learning_rate: float
) -> float:
    """``C_{t+1}`` from ``C_t = current`` and the released count ``B`` of the ``subclients`` (``v K_c``)
    whose update was within it: the geometric step toward ``target_quantile`` (module docstring)."""
    # A fraction, whatever the noise (or a hostile contributor's slot) made of the count: post-processing
    # that bounds each round's step to the honest worst case, exp(eta max(q, 1 - q)).
    within = count / subclients
    within = target_quantile if math.isnan(within) else min(max(within, 0.0), 1.0)
    moved = current * math.exp(-learning_rate * (within - target_quantile))
    return min(max(float(np.float32(moved)), _LEAST_CLIP), _MOST_CLIP)
