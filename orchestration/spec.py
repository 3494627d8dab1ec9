"""A local federation, specified: ``RunSpec``, and ``resolve``, which fills in what depends on the method and the data.

A ``RunSpec`` holds what ``consilium-federation``'s flags say, typed: the federation (hospitals,
talliers, data, partition), the run every method has (``orchestration.run_flags.COMMON_FLAGS``)
and, in ``flags``, the method's own flags by destination (``{"noise_multiplier": 2.3}``). A field
left ``None`` takes its default for the method and the data when the spec is resolved::

    spec = RunSpec(method="dp-fedavg", hospitals=4, flags={"subclients": 2})
    report = run_local_federation(spec)              # orchestration.local
    sigma = least_noise_multiplier(spec, 2.0)        # orchestration.planning
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any, Mapping

from consilium.protocol.run.rules import ConfigError
from consilium.training.methods.step_timing import DEFAULT_SEND_OFFSET_S
from consilium.orchestration.run_flags import (
    COMMON_FLAGS,
    FEDERATION_METHODS,
    FLAG_READERS,
    resolve_data_defaults,
    resolve_run_arguments,
    shown,
)
from consilium.training.privacy.accounting import DEFAULT_BUDGET_VIEW
from consilium.training.data.datasets import Dataset, load_dataset
from consilium.training.models.evaluation import Selection
from consilium.training.methods.registry import METHODS as TRAINING_METHODS
from consilium.training.voting.vote_privacy import VOTING_METHODS

__all__ = ["RunSpec", "resolve"]

_COMMON = {flag.destination: flag.default for flag in COMMON_FLAGS}


@dataclass(frozen=True)
class RunSpec:
    method: str = _COMMON["method"]
    data: str | None = (
        None  # built-in, .npz, image folder or module:function (default: digits for voting, else breast_cancer)
    )
    image_size: tuple[int, int] | None = None  # an image folder's images resized to (height, width)
    image_channels: int | None = None  # an image folder's images made 1 or 3 channels deep
    hospitals: int = 3
    rounds: int | None = None  # default: the method's
    out: Path | None = None  # default: runs/<date-time>
    seed: int = 0  # the data split, partition and initial model
    partition: str = "iid"
    classes_per_part: int | None = None  # label_skew
    alpha: float = 0.5  # dirichlet
    delta: float = _COMMON["delta"]
    model: str | None = None  # mlp, cnn or an own model's reference (default: cnn for images, mlp for other data)
    hidden: tuple[int, ...] = _COMMON["hidden"]
    fix_model: bool = _COMMON["fix_model"]  # an own model with Opacus's fixes
    quorum: int | None = None  # default: every hospital (private voting: training.voting.vote_privacy.default_quorum)
    epsilon_budget: float | None = None  # default: the method's (the target, where one is given)
    target_epsilon: float | None = None  # the noise calibrated to spend this on budget_view (orchestration.planning)
    budget_view: str = (
        DEFAULT_BUDGET_VIEW  # the view each hospital's budget binds on (training.privacy.accounting.VIEWS)
    )
    expected_batch_size: float | None = None  # Dopamine's B (default: proposed from the data set's public size)
    flags: Mapping[str, Any] = field(default_factory=dict)  # the method's own flags, by destination
    talliers: int = 3  # voting
    hospitals_per_process: int = 1  # voting: hospitals simulated in threads of one process
    round_timeout: float = 60.0
    device: str | None = None  # where the server's and hospitals' models compute (default: cpu)
    send_offset: float = DEFAULT_SEND_OFFSET_S
    select_every: int = 1  # the model kept is selected among every n-th round and the last ...
    select_on: str = "accuracy"  # ... on this validation score (training.models.evaluation.Selection)
    transcript_payloads: bool = False
    insecure_plaintext_benchmark: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.flags) - set(FLAG_READERS))
        if unknown:
            raise ConfigError(f"no method reads the flag(s) {', '.join(unknown)}")
        given = {name: value for name, value in self.flags.items() if value is not None}
        object.__setattr__(self, "flags", MappingProxyType(given))
        try:
            Selection(self.select_every, self.select_on)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if (self.select_every, self.select_on) != (1, "accuracy") and self.method in VOTING_METHODS:
            raise ConfigError("a selection is for training runs: a voting server trains its model once, at the end")
        if self.image_channels not in (None, 1, 3):
            raise ConfigError(f"image_channels must be 1 or 3, got {self.image_channels}")
        if self.image_size is not None and (
            len(self.image_size) != 2 or not all(isinstance(v, int) and 1 <= v <= 4096 for v in self.image_size)
        ):
            raise ConfigError(f"image_size must be (height, width) of 1 to 4096 pixels, got {self.image_size}")
        if self.device is not None and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be cpu or cuda (cuda:N), got {self.device!r}")
        if not isinstance(self.fix_model, bool):
            raise ConfigError(f"fix_model must be true or false, got {self.fix_model!r}")
        object.__setattr__(self, "hidden", tuple(self.hidden))
        if self.out is not None:
            object.__setattr__(self, "out", Path(self.out))

    def __reduce__(self):  # the flags' read-only view does not pickle; a plain copy does
        values = {spec_field.name: getattr(self, spec_field.name) for spec_field in fields(self)}
        return partial(RunSpec, **{**values, "flags": dict(self.flags)}), ()

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> RunSpec:
        """The spec of parsed flags (``vars`` of an ``argparse.Namespace``): fields by name, the rest method flags."""
        names = {spec_field.name for spec_field in fields(cls)} - {"flags"}
        unknown = sorted(set(values) - names - set(FLAG_READERS))
        if unknown:
            raise ConfigError(f"a run specification has no field {', '.join(unknown)}")
        given = {name: value for name, value in values.items() if name in names and value is not None}
        return cls(**given, flags={name: value for name, value in values.items() if name in FLAG_READERS})

    @property
    def voting(self) -> bool:
        return self.method in VOTING_METHODS

    def with_flags(self, **flags: Any) -> RunSpec:
        """This spec with some of the method's flags set (``None`` removes one)."""
        return replace(self, flags={**self.flags, **flags})

    def values(self) -> SimpleNamespace:
        """Every field and every method's flag as one attribute each (``None`` where not given): what
        ``orchestration.run_flags`` reads. A copy: changing it changes nothing here."""
        values = dict.fromkeys(FLAG_READERS)
        values.update((spec_field.name, getattr(self, spec_field.name)) for spec_field in fields(self))
        values.update(self.flags)
        del values["flags"]
        return SimpleNamespace(**values)

    def argv(self) -> list[str]:
        """The ``consilium-federation`` flags that make this spec: each field that differs from its default, then
        the method's flags (``--hospitals-per-process`` for ``hospitals_per_process``)."""
        argv = []
        for spec_field in fields(self):
            value = getattr(self, spec_field.name)
            if spec_field.name == "flags" or value == spec_field.default:
                continue
            flag = "--" + spec_field.name.replace("_", "-")
            argv += [flag] if value is True else [flag, shown(value)]
        return argv + [
            arg for name, value in self.flags.items() for arg in ("--" + name.replace("_", "-"), shown(value))
        ]

    def to_dict(self) -> dict:
        """The spec as JSON values: what a benchmark or a comparison records of each run."""
        values = {spec_field.name: getattr(self, spec_field.name) for spec_field in fields(self)}
        values["flags"] = dict(self.flags)
        values["out"] = None if self.out is None else str(self.out)
        return json.loads(json.dumps(values))  # tuples as lists, as they read back


def resolve(spec: RunSpec) -> tuple[RunSpec, Dataset]:
    """The spec with every default filled in, and its data loaded; ``ConfigError`` for what cannot run.

    The defaults depend on the method (``rounds``, ``epsilon_budget``, its flags), then on the data
    (the CNN for images), and Dopamine's ``B`` is proposed where none is given:
    q times the data set's public training size over the number of hospitals, never a hospital's
    own count (``resolve(spec)[0].expected_batch_size``; a consortium states its own).
    """
    values = spec.values()
    _check_target(spec, values)
    resolve_run_arguments(values, FEDERATION_METHODS)
    if spec.hospitals_per_process > 1 and not spec.voting:
        raise ConfigError(
            "--hospitals-per-process is for voting runs; a hospital of the secure round needs its own process"
        )
    if spec.insecure_plaintext_benchmark and spec.method not in TRAINING_METHODS:
        raise ConfigError(
            f"--insecure-plaintext-benchmark is for the secure round (dopamine, dp-fedavg), not for {spec.method}"
        )
    if values.data is None:  # votes need classes to vote on and a public pool to label: the ten digits
        values.data = "digits" if spec.voting else "breast_cancer"
    data = load_dataset(
        values.data, split_seed=spec.seed, image_size=spec.image_size, image_channels=spec.image_channels
    )
    resolve_data_defaults(values, data.input_shape)
    if spec.method == "dopamine" and values.expected_batch_size is None:
        values.expected_batch_size = round(values.sample_rate * len(data.train) / spec.hospitals, 1)
    return RunSpec.from_values(vars(values)), data


def _check_target(spec: RunSpec, values: SimpleNamespace) -> None:
    """A target epsilon is for a training method's noise, and is the budget where none is given."""
    if spec.target_epsilon is None:
        return
    if spec.method not in TRAINING_METHODS:
        raise ConfigError(f"--target-epsilon calibrates the noise of a training run, not of {spec.method}")
    if spec.flags.get("noise_multiplier") is not None:
        raise ConfigError("give --target-epsilon or --noise-multiplier, not both: the target sets the noise")
    if spec.epsilon_budget is None:
        values.epsilon_budget = spec.target_epsilon
    elif spec.epsilon_budget < spec.target_epsilon:
        raise ConfigError(
            f"--target-epsilon {spec.target_epsilon:g} is over --epsilon-budget {spec.epsilon_budget:g}: "
            "every hospital would refuse the run's last rounds"
        )
