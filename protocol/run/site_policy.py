"""A site's policy: which runs a hospital service takes, written by its own operator, never seen by the server.

A hospital service (``orchestration.hospital_service``) checks each run it is welcomed to against
this file before its ledger hears of the run (docs/explanation/site-services.md, property 1):

- ``methods``: the methods it takes part in (a Welcome's kind and method pick one of them);
- ``max_rounds``: the most rounds of one run;
- ``max_epsilon_per_run``: the most one run may spend, planned as every round released at the
  quorum, each charged what the hospital charges its ledger per round (the least noise a quorum's
  sum carries);
- ``max_epsilon_lifetime``: the most the ledger may hold over every run, with this run's plan in it.
  It is also the budget checked before every round (``PrivacyBudget``), as for any hospital;
- ``view`` and ``delta``: the view every cap binds on (and each view before it,
  ``training.privacy.accounting.VIEWS``), at this delta.

The file is read whole or refused in one line (``protocol.run.policy_file``).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

from consilium.protocol.run.policy_file import PolicyError, listed, read_policy
from consilium.protocol.wire.messages import Message, ProtocolError
from consilium.training.privacy.accounting import VIEWS, Release
from consilium.training.privacy.ledger import PrivacyLedger
from consilium.training.privacy.budget import PrivacyBudget

__all__ = ["DECLINED", "MISFIT", "POLICY_REFUSAL", "Declined", "Misfit", "Offer", "PolicyError", "SitePolicy"]

POLICY_REFUSAL = "policy: "  # how a declined run's reason begins, in the site's log
DECLINED = "declined by its site's policy"  # all the server hears of why: the caps and the ledger stay the site's

_KEYS = frozenset({"methods", "max_rounds", "view", "delta", "max_epsilon_per_run", "max_epsilon_lifetime"})


@dataclass(frozen=True)
class SitePolicy:
    methods: tuple[str, ...]
    max_rounds: int
    view: str
    delta: float
    max_epsilon_per_run: float
    max_epsilon_lifetime: float

    def __post_init__(self) -> None:
        if not self.methods or not all(isinstance(method, str) for method in self.methods):
            raise PolicyError("methods must list at least one method by name")
        if not (isinstance(self.max_rounds, int) and not isinstance(self.max_rounds, bool) and self.max_rounds > 0):
            raise PolicyError(f"max_rounds must be a positive whole number, got {self.max_rounds!r}")
        if self.view not in VIEWS:
            raise PolicyError(f"view must be one of {', '.join(VIEWS)}, got {self.view!r}")
        if not (_number(self.delta) and 0 < self.delta < 1):
            raise PolicyError(f"delta must be between 0 and 1, got {self.delta!r}")
        for name in ("max_epsilon_per_run", "max_epsilon_lifetime"):
            value = getattr(self, name)
            if not (_number(value) and 0 < value < math.inf):
                raise PolicyError(f"{name} must be a positive number, got {value!r}")
        if self.max_epsilon_per_run > self.max_epsilon_lifetime:
            raise PolicyError("max_epsilon_per_run is over max_epsilon_lifetime: no run could spend it")

    @classmethod
    def load(cls, path: Path, known_methods: tuple[str, ...]) -> SitePolicy:
        """The policy in the TOML file ``path``, whose methods must be among ``known_methods``."""
        values = read_policy(path, _KEYS)
        methods = listed(path, values, "methods", known_methods)
        try:
            return cls(**{**values, "methods": methods})
        except PolicyError as error:
            raise PolicyError(f"policy file {path}: {error}") from None

    @property
    def budget(self) -> PrivacyBudget:
        """The lifetime cap, as the budget every round is checked against."""
        return PrivacyBudget(epsilon=self.max_epsilon_lifetime, delta=self.delta, view=self.view)

    def method_refusal(self, method: str) -> str:
        """Why a run of ``method`` is declined, or "" if it may be taken."""
        if method in self.methods:
            return ""
        return f"{POLICY_REFUSAL}this site takes part in {', '.join(self.methods)} runs, not {method[:64]!r}"

    def run_refusal(self, ledger: PrivacyLedger, charge: Release, *, rounds: int, charged: int) -> str:
        """Why a run of ``rounds`` rounds, each charged ``charge``, is declined, or "" if it may be taken; ``charged``
        of its rounds are in ``ledger`` already (a run resumed), the others are planned on top of it."""
        if rounds > self.max_rounds:
            return f"{POLICY_REFUSAL}{rounds} rounds, more than the {self.max_rounds} a run may have here"
        alone, view = PrivacyLedger().worst_epsilon(self.delta, up_to=self.view, extra=charge, times=rounds)
        if alone > self.max_epsilon_per_run:
            return (
                f"{POLICY_REFUSAL}the run would spend epsilon {alone:.3f} against the {_shown(view)}, more than the "
                f"{self.max_epsilon_per_run:g} a run may spend here"
            )
        total, view = ledger.worst_epsilon(self.delta, up_to=self.view, extra=charge, times=rounds - charged)
        if total > self.max_epsilon_lifetime:
            return (
                f"{POLICY_REFUSAL}the run would bring this site's epsilon against the {_shown(view)} to {total:.3f}, "
                f"more than its lifetime {self.max_epsilon_lifetime:g}"
            )
        return ""


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _shown(view: str) -> str:
    return view.replace("_", " ")


@dataclass(frozen=True)
class Offer:
    """A run offered to a hospital service: the Welcome (training or voting) that came after the service's Hello,
    the site's policy the role checks it against before its ledger hears of the run, and the flag the
    service's SIGTERM sets (every wait of the role reads it, ``protocol.wire.channel.ServerChannel``)."""

    welcome: Message
    policy: SitePolicy
    stop: threading.Event

    def check(self, ledger: PrivacyLedger, charge: Release, *, rounds: int, run_id: str, fingerprint: str) -> None:
        """``Declined`` where a run of ``rounds`` rounds, each charged ``charge``, is outside the policy (of those
        rounds, the ones ``ledger`` charged already for ``run_id`` are not planned again), or where the ledger
        would not begin it (a run finished, a run id reused): checked on the run's configuration alone,
        before anything reads this hospital's data, so that a decline says nothing of it."""
        refusal = ledger.begin_refusal(run_id, fingerprint)
        refusal = refusal or self.policy.run_refusal(ledger, charge, rounds=rounds, charged=ledger.last_round(run_id))
        if refusal:
            raise Declined(refusal)


class Declined(ProtocolError):
    """A run outside the site's policy: the site's log says why; the server hears only ``DECLINED``."""


class Misfit(ProtocolError):
    """A run this hospital's data cannot take (a model its records do not fit, more neighbours or sub-clients
    than it has records): the reason names facts of the data, so it stays in the site's log, and the server
    hears only ``MISFIT``."""


MISFIT = "refuses the run it was welcomed to"  # all the server hears of a misfit
