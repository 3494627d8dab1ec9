"""Renyi DP of the Poisson-subsampled Skellam mechanism, and its conversion to (epsilon, delta).

**The mechanism.** Adding ``Sk(mu)`` noise to each coordinate of an integer vector whose
sensitivity is ``Delta_2`` (L2) and ``Delta_1`` (L1) is ``(alpha, eps(alpha))``-RDP with
(Agarwal, Kairouz and Liu 2021, Theorem 3.5)::

    eps(alpha) = alpha Delta_2^2 / (4 mu) + min( ((2 alpha - 1) Delta_2^2 + 6 Delta_1) / (16 mu^2),
                                                 3 Delta_1 / (4 mu) )

The first term is the Gaussian mechanism's ``alpha / (2 z^2)`` at the same variance
(``2 mu = z^2 Delta_2^2``); the second vanishes as ``mu`` grows.

**Poisson subsampling.** If each record is in the batch with probability ``q``, the accountant
charges, at every integer ``alpha >= 2``::

    exp((alpha - 1) eps_q(alpha)) = sum_{j=0..alpha} C(alpha, j) (1-q)^(alpha-j) q^j exp((j - 1) eps(j))

(the ``j = 0, 1`` terms are ``(1-q)^(alpha-1) (1 + (alpha-1) q)``). Write ``P`` for the output
without the record, ``Q`` with it, ``M = (1-q) P + q Q``, and ``r = Q/P`` (Skellam noise has full
support, so ``E_P[r] = 1``). The sum is an upper bound on both directions of add/remove adjacency:

- *Removal*, ``D_alpha(M || P)``: ``E_P[(1 - q + q r)^alpha]`` expands binomially into
  ``E_P[r^j] = exp((j-1) D_j(Q || P))``, each at most ``exp((j-1) eps(j))``.
- *Addition*, ``D_alpha(P || M)``, is ``E_P[(1 - q + q r)^(1-alpha)]``. For every ``r > 0``::

      (1 - q + q r)^(1-alpha) <= lam (1 - q + q r)^alpha + (1 - lam) r (1 - q + q/r)^alpha + c (r - 1)

  with ``lam = 3 (1-q) / (3 + 2 (alpha-2) q)`` and ``c`` the constant that makes the slopes meet at
  ``r = 1``. Taking ``E_P``: the first term is the removal sum; the second expands into
  ``E_P[r^(1-j)] = exp((j-1) D_j(P || Q))``, also at most ``exp((j-1) eps(j))``: for one shift ``v``
  of the noise, ``D_j(N || N + v) = D_j(N - v || N)`` and the bound depends on ``v`` only through its
  norms; the outputs with and without the record are mixtures over the rounding of every record
  (the same for both but the record's own), and ``exp((j-1) D_j)`` is jointly convex. The last term
  is zero. So the addition direction costs at most the same sum.
  ``lam`` is the one weight for which both sides agree to third order at ``r = 1`` (their fourth
  derivatives then differ by ``4 alpha (alpha-1) (2 alpha-1) q^3 (1-q) > 0``). The inequality is
  proven for every order the accountant uses, 2-256, and every ``q`` in ``(0, 1)``: with
  ``q = 1/(1+w)`` and multiplied by a positive factor it becomes a polynomial in ``r`` and ``w`` with
  integer coefficients, divisible by ``(r-1)^4`` with a quotient whose coefficients are all
  non-negative (``tests/unit/training/test_accounting.py`` computes the certificate, and finds negative
  coefficients for a wrong weight: removal alone does not bound addition pair by pair).

For the Gaussian this sum is exactly the sampled Gaussian RDP that Opacus computes (Mironov,
Talwar and Zhang 2019), which the tests check. Zhu and Wang (2019) prove a bound for any
mechanism with a factor 3 on the terms ``j >= 3``; it would raise the default run's epsilon
against the server from 2.14 to 3.56. RDP adds up over rounds, and ``rdp_to_epsilon`` takes the best order with
the conversion of Balle, Barthe, Gaboardi, Hsu and Sato (2020, Proposition 12), as Opacus does:
``epsilon = rdp(alpha) + log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1)``. It is
written here, not imported, so that a party that only counts (the server, a tallier) does not load
Opacus and torch with it (``tests/unit/training/test_accounting.py`` checks it against Opacus's).
"""

from __future__ import annotations

import numpy as np
from scipy.special import gammaln, logsumexp

__all__ = ["ORDERS", "gaussian_rdp", "poisson_subsampled_rdp", "rdp_to_epsilon", "skellam_rdp"]

# Integer orders: the subsampling bound is a binomial expansion.
ORDERS = np.arange(2, 257)


def skellam_rdp(orders: np.ndarray, *, l2_sensitivity: float, l1_sensitivity: float, mu: float) -> np.ndarray:
    """RDP of ``Sk(mu)`` noise on a query of the given sensitivities, at each order."""
    alpha = np.asarray(orders, dtype=np.float64)
    if mu <= 0:
        return np.full(alpha.shape, np.inf)
    l2_squared = l2_sensitivity**2
    correction = np.minimum(
        ((2 * alpha - 1) * l2_squared + 6 * l1_sensitivity) / (16 * mu * mu), 3 * l1_sensitivity / (4 * mu)
    )
    return alpha * l2_squared / (4 * mu) + correction


def gaussian_rdp(orders: np.ndarray, *, noise_multiplier: float) -> np.ndarray:
    """RDP of the Gaussian mechanism with noise multiplier ``z``: ``alpha / (2 z^2)``."""
    alpha = np.asarray(orders, dtype=np.float64)
    if noise_multiplier <= 0:
        return np.full(alpha.shape, np.inf)
    return alpha / (2 * noise_multiplier**2)


def poisson_subsampled_rdp(orders: np.ndarray, sample_rate: float, base_rdp: np.ndarray) -> np.ndarray:
    """The subsampling bound above, for integer ``orders`` ``2..A``; ``base_rdp[i]`` is ``eps(orders[i])``."""
    orders = np.asarray(orders)
    if not np.array_equal(orders, np.arange(2, 2 + len(orders))):
        raise ValueError("orders must be the consecutive integers from 2")
    base = np.asarray(base_rdp, dtype=np.float64)
    if sample_rate == 1.0 or np.any(np.isinf(base)):
        return base if sample_rate == 1.0 else np.full(base.shape, np.inf)
    q = sample_rate
    # The binomial weights sum to 1, so the sum is 1 + sum_{j>=2} C(alpha,j) (1-q)^(alpha-j) q^j
    # (exp((j-1) eps(j)) - 1): every term is non-negative, which keeps full precision at tiny q.
    excess = (orders - 1) * base  # (j - 1) eps(j) for j = 2, 3, ...
    with np.errstate(divide="ignore", over="ignore"):
        log_expm1 = np.where(excess > 30, excess + np.log1p(-np.exp(-excess)), np.log(np.expm1(excess)))
    result = np.empty(len(orders))
    for index, alpha in enumerate(orders):
        j = np.arange(2, alpha + 1)
        log_binomial = gammaln(alpha + 1) - gammaln(j + 1) - gammaln(alpha - j + 1)
        terms = log_binomial + (alpha - j) * np.log1p(-q) + j * np.log(q) + log_expm1[: alpha - 1]
        result[index] = np.logaddexp(0.0, logsumexp(terms)) / (alpha - 1)
    return result


def rdp_to_epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float) -> float:
    """The smallest epsilon at ``delta`` over the orders (Balle et al. 2020's conversion)."""
    alpha = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    epsilon = rdp + np.log1p(-1 / alpha) - (np.log(delta) + np.log(alpha)) / (alpha - 1)
    return float(np.where(np.isnan(epsilon), np.inf, epsilon).min())
