"""The methods that train over the secure round, and what the protocol asks of each.

A method's settings are a frozen dataclass that the server announces in the run configuration
(``to_dict`` names the method; ``settings_from_dict`` reads it back). From them every party derives
the same things, so the protocol needs nothing else of a method:

- ``quorum``: contributions a round needs before its sum may be decrypted;
- ``mechanism(d)``: the Skellam mechanism of one hospital's share (``training.skellam``), and
  ``rows_per_share``, the mean number of rounded rows in a share (it sizes the plain modulus);
- ``local_step(model, data)``: a hospital's step, returning ``(share, rows)``;
- ``levels(mechanism, contributors)``: one round's release at each level the method protects
  (``LEVELS``; a hospital's ledger is charged at the first);
- ``direction(total, contributors, mechanism)``: the vector a decrypted sum stands for, and
  ``update_rule(model)``, which every party applies to it (``training.update_rules``).
"""

from __future__ import annotations

from training.accounting import Release
from training.dopamine import DopamineSettings
from training.dp_fedavg import DpFedAvgSettings
from training.skellam import SkellamMechanism

__all__ = ["METHODS", "TrainingSettings", "ledger_release", "settings_from_dict"]

TrainingSettings = DopamineSettings | DpFedAvgSettings
METHODS: dict[str, type[DopamineSettings] | type[DpFedAvgSettings]] = {
    settings.METHOD: settings for settings in (DopamineSettings, DpFedAvgSettings)
}


def settings_from_dict(values: dict) -> TrainingSettings:
    """The settings ``to_dict`` wrote, or ``ValueError`` naming what is wrong."""
    if not isinstance(values, dict) or values.get("method") not in METHODS:
        method = values.get("method") if isinstance(values, dict) else None
        raise ValueError(f"unknown training method {method!r}; choose one of {', '.join(METHODS)}")
    return METHODS[values["method"]].from_dict(values)


def ledger_release(settings: TrainingSettings, mechanism: SkellamMechanism, contributors: int) -> Release:
    """What one round of ``contributors`` shares costs in a ledger: its release at the method's first level."""
    return settings.levels(mechanism, contributors)[settings.LEVELS[0]]
