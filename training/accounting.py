"""Privacy accounting: what each observer of a released sum faces, and a durable ledger of releases.

**Adjacency.** Epsilon is for record-level DP under add/remove adjacency: two datasets are
neighbours when one is the other plus one record. That is the adjacency Poisson sampling is
analysed for, and it needs the divisor ``B`` to be a public constant, not a count of records.

**Views.** The released sum of ``K_c`` Skellam shares (``training.skellam``) is ``Sk(K_c mu)``
noise on a query of sensitivity ``Delta_2``. What protects a record depends on who looks:

- ``server``: knows no share, faces ``Sk(K_c mu)``;
- ``peer_hospital``: a fellow contributor subtracts its own share, ``Sk((K_c - 1) mu)``;
- ``collusion``: every other contributor pools its share, leaving only the record's own
  hospital's share ``Sk(mu)``, i.e. noise multiplier ``sigma / sqrt(K_min)``. The server colluding
  with any one hospital is this view too: every hospital holds the BFV key, so together they can
  decrypt each update on its own.

A hospital's budget binds on the worst of ``BUDGET_VIEWS`` (the server and a peer, the threat
model's parties); the collusion view is reported, since the threat model excludes collusion.

The releases a party took part in are kept in its ledger (``training.ledger``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from training.rdp import ORDERS, poisson_subsampled_rdp, skellam_rdp
from training.skellam import SkellamMechanism

__all__ = ["ACCOUNTANT", "BUDGET_VIEWS", "VIEWS", "Release", "release_of"]

ACCOUNTANT = (
    "RDP of the Skellam mechanism (Agarwal et al. 2021, Thm 3.5) amplified by Poisson subsampling with the "
    "binomial bound, for adding and removing a record (training/rdp.py), at integer orders 2-256, converted "
    "with Opacus's RDP-to-DP bound"
)
VIEWS = ("server", "peer_hospital", "collusion")
BUDGET_VIEWS = ("server", "peer_hospital")


@dataclass(frozen=True)
class Release:
    """One released sum of Skellam shares under Poisson sampling, as each view sees it."""

    sample_rate: float
    l2_sensitivity: float
    l1_sensitivity: float
    mu: tuple[tuple[str, float], ...]  # (view, Skellam parameter) for each view

    def rdp(self, view: str) -> np.ndarray:
        mu = dict(self.mu).get(view)
        if mu is None:
            return np.full(len(ORDERS), np.inf)
        base = skellam_rdp(ORDERS, l2_sensitivity=self.l2_sensitivity, l1_sensitivity=self.l1_sensitivity, mu=mu)
        return poisson_subsampled_rdp(ORDERS, self.sample_rate, base)

    def to_record(self) -> dict:
        return {
            "mechanism": "skellam",
            "sample_rate": self.sample_rate,
            "l2_sensitivity": self.l2_sensitivity,
            "l1_sensitivity": self.l1_sensitivity,
            "mu": dict(self.mu),
        }

    @classmethod
    def from_record(cls, record: dict) -> "Release":
        mu = record["mu"]
        if set(mu) != set(VIEWS) or record["mechanism"] != "skellam":
            raise ValueError("a Skellam release needs mu for every view")
        release = cls(
            sample_rate=float(record["sample_rate"]),
            l2_sensitivity=float(record["l2_sensitivity"]),
            l1_sensitivity=float(record["l1_sensitivity"]),
            mu=tuple((view, float(mu[view])) for view in VIEWS),
        )
        values = (release.l2_sensitivity, release.l1_sensitivity, *dict(release.mu).values())
        if not (0 < release.sample_rate <= 1 and all(math.isfinite(v) and v >= 0 for v in values)):
            raise ValueError("a release needs a sample rate in (0, 1] and finite, non-negative parameters")
        return release


def release_of(mechanism: SkellamMechanism, *, sample_rate: float, contributors: int, group_size: int = 1) -> Release:
    """The release of a sum of ``contributors`` shares, for each view.

    ``group_size`` rows of a share moving together (a hospital's ``v`` sub-clients in DP-FedAvg) move
    it by up to ``group_size`` times each sensitivity (the triangle inequality, in L2 and in L1).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    known = {"server": 0, "peer_hospital": min(1, contributors - 1), "collusion": contributors - 1}
    return Release(
        sample_rate=sample_rate,
        l2_sensitivity=group_size * mechanism.l2_sensitivity,
        l1_sensitivity=group_size * mechanism.l1_sensitivity,
        mu=tuple((view, mechanism.mu(contributors, known[view])) for view in VIEWS),
    )
