"""How many sub-clients ("intermediaries") each hospital should be split into (Jiang et al., Sec. 2.2).

Eq. (2) measures a round by its noise level and its diversity::

    xi = ||zeta|| / ||sum_i clip(Delta_i)||,      phi = sum_i ||Delta_i|| / ||sum_i clip(Delta_i)||

where ``zeta ~ N(0, sigma^2 I)`` is the noise's effect on the averaged model, ``sigma = z C / N``
for ``N`` clients (Eq. 1). Eq. (3) says how they move with the split: ``xi_v = xi / v`` and
``phi_v = v phi``. The paper chooses ``v = sqrt(N xi / phi)`` for ``N`` hospitals (the ratio
``xi_v / phi_v`` then lies at ``1/N``), re-estimated each round from the last. Measured at the
current split ``v``, Eq. (3) gives ``xi / phi = v^2 xi_v / phi_v``, so::

    v_next = v sqrt(N xi_v / phi_v) = v sqrt(N ||zeta_v|| / sum_i ||Delta_i||)

with ``zeta_v`` the noise on the mean of the ``N v`` sub-clients' updates. The norm of the clipped
sum cancels. What is left is all the server may use:

- ``||zeta_v||`` is not observed but its expectation is public:
  ``E||zeta|| = sigma sqrt(2) Gamma((d+1)/2) / Gamma(d/2)`` for ``N(0, sigma^2 I_d)``;
- ``sum_i ||Delta_i||`` comes from a securely summed and noised slot beside the update (so it is
  part of the accounted release; ``training.methods.dp_fedavg``). It sums clipped norms, which have a
  bound to noise them by, and it is an estimate: it may even come out negative.

In DP-FedAvg each row carries that slot, its own norm weighted by ``alpha`` (``NORM_SLOT_WEIGHT``)::

    row_i = (clip(Delta_i, C), alpha ||clip(Delta_i, C)||),    ||row_i|| <= C sqrt(1 + alpha^2)

so the mechanism is calibrated to that norm and the slot's sum is released with the update, under
the same noise and the same accounting (the update's noise grows by ``sqrt(1 + alpha^2)``, 3% at
``alpha = 1/4``). The released vector is the mean update's direction followed by
``S = slot / (gamma alpha)``, a noisy estimate of ``sum_i ||clip(Delta_i)||`` (the paper's
``sum_i ||Delta_i||``, of clipped updates: an unclipped norm has no bound to noise it by). From it
and from public values alone (the contributors ``K_c`` and the noise's expected norm, which the
mechanism fixes) every party computes the next round's ``v`` alike
(``DpFedAvgSettings.after_release``), and every contributor's endorsement of the round's aggregate
names the ``v`` it trained with (``crypto.endorsement``), so parties that disagree on ``v`` are
caught before a sum is used.
"""

from __future__ import annotations

import math

__all__ = ["NORM_SLOT_WEIGHT", "expected_noise_norm", "next_subclient_count"]

# alpha: the slot's noise, in units of sum_i ||clip(Delta_i)||, is 1/alpha times the update's. v
# follows the square root of that estimate, so a rough one serves; the update pays sqrt(1 + alpha^2).
NORM_SLOT_WEIGHT = 0.25


def expected_noise_norm(sigma: float, dimension: int) -> float:
    """``E||zeta||`` for ``zeta ~ N(0, sigma^2 I_dimension)`` (the chi distribution's mean, times sigma)."""
    return sigma * math.sqrt(2.0) * math.exp(math.lgamma((dimension + 1) / 2) - math.lgamma(dimension / 2))


def next_subclient_count(current: int, *, hospitals: int, noise_norm: float, update_norm_sum: float, most: int) -> int:
    """``v`` for the next round, rounded and kept within ``[1, most]`` (``most``: what the smallest hospital allows).

    A non-positive ``update_norm_sum`` (the noise swamped it) reads as updates too small to measure:
    as much splitting as allowed.
    """
    if current < 1 or hospitals < 1 or most < 1 or noise_norm < 0:
        raise ValueError(
            f"need v >= 1, hospitals >= 1, most >= 1 and a noise norm >= 0; got {current}, {hospitals}, {most}, {noise_norm}"
        )
    if update_norm_sum <= 0:
        return most
    return max(1, min(most, round(current * math.sqrt(hospitals * noise_norm / update_norm_sum))))
