"""Privacy accounting: what each observer of a released sum faces, and a durable ledger of releases.

**Adjacency.** Epsilon is for record-level DP under add/remove adjacency: two datasets are
neighbours when one is the other plus one record. That is the adjacency Poisson sampling is
analysed for, and it needs the divisor ``B`` to be a public constant, not a count of records.

**Views.** The released sum of ``K_c`` Skellam shares (``training.privacy.skellam``) is ``Sk(K_c mu)``
noise on a query of sensitivity ``Delta_2``. What protects a record depends on who looks:

- ``server``: knows no share, faces ``Sk(K_c mu)``;
- ``peer_hospital``: a fellow contributor subtracts its own share, ``Sk((K_c - 1) mu)``;
- ``coalition``: the server with the most hospitals the secure round tolerates, ``tau - 1`` (its
  key threshold less one) and never fewer than half the consortium (``tolerated_coalition``), who
  pool their shares:
  ``Sk((K_c - min(tau - 1, K_c - 1)) mu)``. Such a coalition reads the sum and nothing else
  (docs/explanation/secure-round.md), so this is the worst view the threat model admits. A voting
  run counts the same coalition as a secure round's default threshold, ``floor(n / 2)`` hospitals;
- ``collusion``: every other contributor pools its share, leaving only the record's own
  hospital's share ``Sk(mu)``, i.e. noise multiplier ``sigma / sqrt(K_min)``.

Each view knows at least the shares the one before it knows, so epsilon never falls along
``VIEWS``. A hospital's budget binds on the view its operator chooses (``--budget-view``, by default
``coalition``) and, to be safe against a ledger whose records do not follow that order, on every
view before it (``PrivacyLedger.worst_epsilon``).

Records written before this view existed (the shared-key round, where the server with any one
hospital could decrypt each update on its own) are read with the coalition view equal to their
collusion view: that is what such a coalition saw.

The releases a party took part in are kept in its ledger (``training.privacy.ledger``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from consilium.training.privacy.rdp import ORDERS, poisson_subsampled_rdp, skellam_rdp
from consilium.training.privacy.skellam import SkellamMechanism

__all__ = ["ACCOUNTANT", "DEFAULT_BUDGET_VIEW", "VIEWS", "Release", "release_of", "tolerated_coalition"]

ACCOUNTANT = (
    "RDP of the Skellam mechanism (Agarwal et al. 2021, Thm 3.5) amplified by Poisson subsampling with the "
    "binomial bound, for adding and removing a record (training/privacy/rdp.py), at integer orders 2-256, converted "
    "with the RDP-to-DP bound of Balle et al. (2020), as Opacus's"
)
VIEWS = ("server", "peer_hospital", "coalition", "collusion")
DEFAULT_BUDGET_VIEW = "coalition"


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
        if isinstance(mu, dict) and "coalition" not in mu and "collusion" in mu:  # written by the shared-key round
            mu = {**mu, "coalition": mu["collusion"]}
        if not isinstance(mu, dict) or set(mu) != set(VIEWS) or record["mechanism"] != "skellam":
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


def tolerated_coalition(threshold: int, consortium: int) -> int:
    """The hospitals that pool their shares with the server in the ``coalition`` view: a run's
    ``tau - 1``, and never fewer than ``floor(N / 2)`` of a consortium (roster) of ``N``. The server
    chooses which of the consortium's hospitals make up a run, and so its ``n`` and ``tau``: a run of
    a victim and two hospitals working with the server has ``tau = 2``, and those two hold every
    share (review 5, finding 6). Against such a run the charge is the collusion view's."""
    return max(threshold - 1, consortium // 2)


def release_of(
    mechanism: SkellamMechanism, *, sample_rate: float, contributors: int, coalition: int, group_size: int = 1
) -> Release:
    """The release of a sum of ``contributors`` shares, for each view.

    ``coalition`` is how many hospitals pool their shares with the server in the ``coalition`` view
    (``tau - 1``); only contributors among them remove a share, and never the record's own hospital.

    ``group_size`` rows of a share moving together (a hospital's ``v`` sub-clients in DP-FedAvg) move
    it by up to ``group_size`` times each sensitivity (the triangle inequality, in L2 and in L1).
    """
    if group_size < 1 or coalition < 1:
        raise ValueError(f"group_size and coalition must be at least 1, got {group_size} and {coalition}")
    known = {
        "server": 0,
        "peer_hospital": min(1, contributors - 1),
        "coalition": min(coalition, contributors - 1),
        "collusion": contributors - 1,
    }
    return Release(
        sample_rate=sample_rate,
        l2_sensitivity=group_size * mechanism.l2_sensitivity,
        l1_sensitivity=group_size * mechanism.l1_sensitivity,
        mu=tuple((view, mechanism.mu(contributors, known[view])) for view in VIEWS),
    )
