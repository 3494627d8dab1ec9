"""The run's flags: which method reads which, their defaults, and the run configuration they make.

Every method declares the flags it reads beside its settings (``training.methods.flags``): the training
methods (``training.methods.registry``), the voting methods (``training.voting.vote_privacy``) and the baselines
(``training.methods.baselines``). This module joins those declarations into the tables the launchers build
their argument groups from (``scripts._cli``) and that a run specification (``orchestration.spec``)
is checked against. A flag given for a method that does not read it is refused, never ignored.

The values are read from any object with one attribute per flag (an ``argparse.Namespace``, or a
``RunSpec``'s ``values()``); a flag left out is ``None`` until its method's default fills it in.
"""

from __future__ import annotations

import secrets
from typing import Any

from consilium.protocol.run.config import INSECURE_PLAINTEXT, SECURE_AGGREGATION, RunConfig

from consilium.protocol.run.rules import ConfigError
from consilium.training.methods.baselines import BASELINE_DEFAULTS, BASELINE_FLAGS, BASELINES
from consilium.training.data.datasets import Dataset, Split
from consilium.training.methods.flags import Flag, positive_int, probability, widths
from consilium.training.methods.registry import METHODS as TRAINING_METHODS
from consilium.training.models.build import describe_model, input_statistics
from consilium.training.models.spec import BUILT_IN_MODELS, ModelSpec, takes_images
from consilium.training.voting.vote_privacy import REVEAL_MODES, VOTING_DEFAULTS, VOTING_FLAGS, VOTING_METHODS

__all__ = [
    "COMMON_FLAGS",
    "FEDERATION_METHODS",
    "FLAG_READERS",
    "METHODS",
    "METHOD_DEFAULTS",
    "METHOD_FLAGS",
    "build_run_config",
    "chosen_aggregation",
    "model_spec",
    "resolve_data_defaults",
    "resolve_run_arguments",
    "run_argv",
    "shown",
]

METHODS = (*TRAINING_METHODS, *VOTING_METHODS)  # what a server can run
FEDERATION_METHODS = (*METHODS, *BASELINES)  # and what a local federation also runs, in one process

METHOD_FLAGS: dict[str, tuple[Flag, ...]] = {
    **{name: settings.FLAGS for name, settings in TRAINING_METHODS.items()},
    **VOTING_FLAGS,
    **BASELINE_FLAGS,
}
FLAG_READERS: dict[str, list[str]] = {}  # a method flag's destination -> the methods that read it
for _method, _flags in METHOD_FLAGS.items():
    for _flag in _flags:
        FLAG_READERS.setdefault(_flag.destination, []).append(_method)
METHOD_DEFAULTS: dict[str, dict] = {
    **{name: settings.DEFAULTS for name, settings in TRAINING_METHODS.items()},
    **VOTING_DEFAULTS,
    **BASELINE_DEFAULTS,
}
# The run's settings every method has, shared by consilium-server and consilium-federation (which
# passes them on to the server it launches). A default of None depends on the method.
COMMON_FLAGS = (
    Flag(
        "--method",
        str,
        "dopamine",
        f"how the hospitals learn together: {', '.join(METHODS)}; consilium-federation also runs the baselines "
        f"{', '.join(BASELINES)} in one process",
    ),
    Flag("--rounds", positive_int, None, "rounds: DP-SGD steps, FedAvg rounds, query batches or a baseline's epochs"),
    Flag("--delta", probability, 1e-5, "delta at which epsilon is reported"),
    Flag(
        "--model",
        str,
        None,
        f"the model: one built in, {', '.join(BUILT_IN_MODELS)} (default: cnn for images, mlp for other data), or a "
        "function of your own code, package.module:function or path/to/file.py:function, given the input shape and "
        "the number of classes",
    ),
    Flag("--fix-model", bool, False, "apply Opacus's fixes to a model of your own (GroupNorm for BatchNorm)"),
    Flag("--hidden", widths, (48,), "MLP hidden widths, comma-separated (empty for a linear model)"),
    Flag(
        "--quorum",
        positive_int,
        None,
        "K_min: contributions a round needs (default: all hospitals; private voting among 11 or more: all but one)",
    ),
)


def resolve_run_arguments(values: Any, methods: tuple[str, ...] = METHODS) -> None:
    """Check ``method`` (one of ``methods``) and ``reveal``, refuse the flags it does not read, and
    fill in the defaults that depend on the method (``ConfigError``)."""
    if values.method not in methods:
        raise ConfigError(f"unknown method {values.method!r}; choose from {', '.join(methods)}")
    if values.reveal is not None and values.reveal not in REVEAL_MODES:
        raise ConfigError(f"unknown reveal mode {values.reveal!r}; choose from {', '.join(REVEAL_MODES)}")
    for name, methods_reading in FLAG_READERS.items():
        if values.method not in methods_reading and getattr(values, name, None) is not None:
            raise ConfigError(
                f"--{name.replace('_', '-')} is for {', '.join(methods_reading)} runs, not {values.method}"
            )
    for flag in METHOD_FLAGS[values.method]:
        if getattr(values, flag.destination, None) is None and flag.default is not None:
            setattr(values, flag.destination, flag.default)
    for name, value in METHOD_DEFAULTS[values.method].items():
        if hasattr(values, name) and getattr(values, name) is None:
            setattr(values, name, value)


def resolve_data_defaults(values: Any, input_shape: tuple[int, ...]) -> None:
    """Fill in the model that depends on the data: the CNN for images, the MLP for other data."""
    if values.model is None:
        values.model = "cnn" if takes_images(input_shape) else "mlp"


def run_argv(values: Any) -> list[str]:
    """The run flags given, as the command line of consilium-server."""
    argv = []
    for flag in [*COMMON_FLAGS, *_all_method_flags()]:
        value = getattr(values, flag.destination)
        if value is True:
            argv.append(flag.name)
        elif value is not None and value is not False:
            argv += [flag.name, shown(value)]
    return argv


def chosen_aggregation(values: Any) -> str:
    """The aggregation this process's operator chose: ``--insecure-plaintext-benchmark``, or secure by default."""
    return INSECURE_PLAINTEXT if values.insecure_plaintext_benchmark else SECURE_AGGREGATION


def build_run_config(values: Any, hospitals: tuple[str, ...], dataset: Dataset) -> RunConfig:
    """A new run's configuration from the resolved run flags, or ``ConfigError``."""
    try:
        return RunConfig(
            run_id=secrets.token_hex(8),
            dataset=dataset.name,
            hospitals=hospitals,
            rounds=values.rounds,
            delta=values.delta,
            model=model_spec(values, dataset, dataset.validation),
            training=TRAINING_METHODS[values.method].from_flags(values, quorum=values.quorum or len(hospitals)),
            aggregation=chosen_aggregation(values),
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None


def model_spec(values: Any, dataset: Dataset, public: Split) -> ModelSpec:
    """The model of ``model``, ``hidden`` and ``fix_model``, standardising inputs with statistics of ``public``
    records (``ValueError``; ``training.models.build.ModelError`` for a model of one's own that cannot be trained)."""
    mean, std = input_statistics(public.x)
    return describe_model(
        values.model,
        dataset.input_shape,
        dataset.num_classes,
        hidden=values.hidden,
        input_mean=mean,
        input_std=std,
        fix=values.fix_model,
        classes=dataset.classes,
    )


def shown(value: Any) -> str:
    """A flag's value as typed: widths comma-separated."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _all_method_flags() -> list[Flag]:
    """Every method's flags, each name once."""
    return list({flag.name: flag for flags in METHOD_FLAGS.values() for flag in flags}.values())
