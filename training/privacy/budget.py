"""A party's privacy budget: the most epsilon it lets its ledger reach, in the view it protects against and every
view before it (``training.privacy.accounting``)."""

from __future__ import annotations

from dataclasses import dataclass

from consilium.training.privacy.accounting import DEFAULT_BUDGET_VIEW, Release
from consilium.training.privacy.ledger import PrivacyLedger, view_index

__all__ = ["BUDGET_REFUSAL", "PrivacyBudget"]

BUDGET_REFUSAL = "privacy budget: "  # how a refusal for a spent budget begins, which a server reports as one


@dataclass(frozen=True)
class PrivacyBudget:
    """At most ``epsilon`` at ``delta`` in ``view`` (``training.privacy.accounting``) and every view before it."""

    epsilon: float
    delta: float
    view: str = DEFAULT_BUDGET_VIEW

    def __post_init__(self) -> None:
        view_index(self.view)

    def refusal(self, ledger: PrivacyLedger, charge: Release, round_number: int) -> str:
        """Why a hospital must not take part in the round, or "" if it may (Dopamine's Algorithm 1, line 17)."""
        projected, view = ledger.worst_epsilon(self.delta, up_to=self.view, extra=charge)
        if projected <= self.epsilon:
            return ""
        return (
            f"{BUDGET_REFUSAL}round {round_number} would bring epsilon against the {view.replace('_', ' ')} "
            f"to {projected:.3f} > {self.epsilon:g} at delta {self.delta:g}"
        )
