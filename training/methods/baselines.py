"""The baselines a private method is compared with, on the same data, model and budget (one process).

- ``central`` (C): minibatch SGD on the pooled records of every hospital; no privacy.
- ``central-dp`` (CDP): Gaussian DP-SGD on the pooled records (``training.methods.dp_sgd``), record-level
  epsilon as a trusted curator would report it; each step divides by q times the data set's
  published training size, a public figure, never by the count of records the curator holds.
- ``fedavg`` (F): FedAvg over the hospitals (``training.methods.fedavg``: local training from the global
  model, the mean of the updates weighted by records); no privacy.
- ``fedavg-local-dp`` (FPDP): each hospital runs full-noise DP-SGD on its own records, trusting
  no one (dividing by that public figure over the number of hospitals, as Dopamine's B), and the
  server averages the updates with equal weights (a hospital's count of records is private); each
  hospital's record-level epsilon is its own.

Every baseline trains ``rounds`` rounds (an epoch of the pooled data, or a FedAvg round of
``local_epochs``), keeps the parameters of the round with the best validation accuracy, and
reports accuracy and AUC on the test split (``training.models.evaluation``).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
from torch import nn

from consilium.training.data.datasets import Dataset, Split
from consilium.training.methods.dopamine import DopamineSettings
from consilium.training.methods.dp_fedavg import DpFedAvgSettings
from consilium.training.methods.flags import Flag
from consilium.training.methods.dp_sgd import GaussianDpSgd, dp_sgd_epsilon, noise_multiplier_for
from consilium.training.models.evaluation import Selection, evaluate
from consilium.training.methods.fedavg import LocalTraining, local_update
from consilium.training.models.build import build_model, get_flat_parameters, set_flat_parameters
from consilium.training.models.spec import ModelSpec
from consilium.training.privacy.secure_random import secure_generator

__all__ = ["BASELINES", "BASELINE_DEFAULTS", "BASELINE_FLAGS", "DP_BASELINES", "BaselineSettings", "run_baseline"]

BASELINES = ("central", "central-dp", "fedavg", "fedavg-local-dp")
DP_BASELINES = ("central-dp", "fedavg-local-dp")

# Each baseline reads what its private counterpart does: DP-SGD's flags for central-dp and
# fedavg-local-dp, the sub-clients' local training for central and fedavg.
_DP_SGD = tuple(flag for flag in DopamineSettings.FLAGS if flag.name != "--noise-multiplier")
_LOCAL = {flag.name: flag for flag in DpFedAvgSettings.FLAGS}
_ACCOUNTANT = Flag(
    "--accountant",
    str,
    "prv",
    "Opacus's accountant that sets sigma for --epsilon-budget, prv or rdp (the secure round's is Skellam RDP)",
)
BASELINE_FLAGS = {
    "central": (_LOCAL["--local-batch-size"], _LOCAL["--local-lr"]),
    "central-dp": (*_DP_SGD, _ACCOUNTANT),
    "fedavg": (_LOCAL["--local-epochs"], _LOCAL["--local-batch-size"], _LOCAL["--local-lr"]),
    "fedavg-local-dp": (_LOCAL["--local-epochs"], *_DP_SGD, _ACCOUNTANT),
}
BASELINE_DEFAULTS = {
    name: {"rounds": 20, **({"epsilon_budget": 3.0} if name in DP_BASELINES else {})} for name in BASELINES
}


@dataclass(frozen=True)
class BaselineSettings:
    rounds: int = 20
    learning_rate: float = 0.05
    batch_size: int = 32  # central and fedavg; DP-SGD divides by a public expected batch (_public_batch_size)
    local_epochs: int = 1
    epsilon: float = 3.0  # record-level, for the DP baselines
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    sample_rate: float = 0.05
    momentum: float = 0.0
    accountant: str = "prv"  # Opacus's, for the DP baselines: "prv", or "rdp" to compare with an RDP-accounted method


def run_baseline(
    name: str,
    dataset: Dataset,
    parts: list[np.ndarray],
    spec: ModelSpec,
    settings: BaselineSettings,
    *,
    model_seed: int | None = None,
    selection: Selection = Selection(),
) -> dict:
    """Train baseline ``name`` with the hospitals' records ``parts`` (indices into ``dataset.train``), from
    the initial model ``model_seed`` draws (``training.models.build.build_model``; None: PyTorch's own draw).

    The report has a record per round (validation accuracy, epsilon so far) and ``final``: the
    round selected on validation (the earliest of ties) among its candidates
    (``training.models.evaluation.Selection``), its test scores, and the epsilon of the whole run, which
    every round was trained under.
    """
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
    started = time.monotonic()
    model = build_model(spec, seed=model_seed)
    hospitals = [dataset.train.subset(part) for part in parts]
    pooled = dataset.train.subset(np.concatenate(parts))
    rounds = {"central": _central, "central-dp": _central_dp, "fedavg": _fedavg, "fedavg-local-dp": _fedavg_local_dp}[
        name
    ]
    published = len(dataset.train)  # the data set's published training size: public, as Dopamine's B takes it
    records, best, epsilon, candidates = _train_and_select(
        model, rounds(model, pooled, hospitals, settings, published), dataset, settings, selection
    )
    set_flat_parameters(model, best[1])
    return {
        "method": name,
        "settings": asdict(settings),
        "rounds": records,
        "final": {
            "selection": {"every": selection.every, "on": selection.on, "candidates": candidates},
            "selected": _selected_round(model, dataset, records, best[0]),
            "epsilon": epsilon,  # per record, of the released model; None without DP
            "delta": settings.delta if epsilon is not None else None,
            "accountant": f"Gaussian {settings.accountant.upper()} (Opacus)" if epsilon is not None else None,
        },
        "wall_seconds": time.monotonic() - started,
    }


def _train_and_select(
    model: nn.Module,
    rounds: Iterable[tuple[np.ndarray, float | None]],
    dataset: Dataset,
    settings: BaselineSettings,
    selection: Selection,
) -> tuple[list[dict], tuple[int, np.ndarray, float] | None, float | None, int]:
    """Train through ``rounds``, scoring each on validation: the rounds' records, the best candidate round (its
    number, parameters and score; the earliest of ties), the last round's epsilon and the number of candidates."""
    records, best, epsilon, candidates = [], None, None, 0
    for number, (parameters, epsilon) in enumerate(rounds, start=1):
        validation = evaluate(model, dataset.validation, num_classes=dataset.num_classes)
        records.append(
            {
                "round": number,
                "validation_accuracy": validation["accuracy"],
                "validation_auc": validation["auc"],
                "epsilon": epsilon,
            }
        )
        if selection.candidate(number, settings.rounds):
            candidates += 1
            score = selection.score(validation["accuracy"], validation["auc"])
            if best is None or score > best[2]:
                best = (number, parameters, score)
    return records, best, epsilon, candidates


def _selected_round(model: nn.Module, dataset: Dataset, records: list[dict], number: int) -> dict:
    """The selected round's validation scores, and the test scores of ``model``, which holds its parameters."""
    return {
        "round": number,
        "validation_accuracy": records[number - 1]["validation_accuracy"],
        "validation_auc": records[number - 1]["validation_auc"],
        "test": evaluate(model, dataset.test, num_classes=dataset.num_classes) if dataset.test is not None else None,
    }


def _public_batch_size(settings: BaselineSettings, published: int, holders: int) -> float:
    """The expected batch a DP baseline divides by: q times the data set's published training size,
    shared by ``holders`` (1 for the central curator, the hospitals for FedAvg with local DP), as
    Dopamine's B is proposed. Never a count of the records a party holds, which is private."""
    return settings.sample_rate * published / holders


def _central(model: nn.Module, pooled: Split, hospitals: list[Split], settings: BaselineSettings, published: int):
    generator = secure_generator()
    training = LocalTraining(epochs=1, batch_size=settings.batch_size, learning_rate=settings.learning_rate)
    for _ in range(settings.rounds):
        set_flat_parameters(model, get_flat_parameters(model) + local_update(model, pooled, training, generator))
        yield get_flat_parameters(model), None


def _central_dp(model: nn.Module, pooled: Split, hospitals: list[Split], settings: BaselineSettings, published: int):
    steps_per_round = math.ceil(1 / settings.sample_rate)
    yield from _dp_sgd_rounds(model, pooled, settings, steps_per_round, _public_batch_size(settings, published, 1))


def _dp_sgd_rounds(
    model: nn.Module, data: Split, settings: BaselineSettings, steps_per_round: int, expected_batch_size: float
):
    steps = settings.rounds * steps_per_round
    sigma = noise_multiplier_for(
        settings.epsilon, settings.delta, sample_rate=settings.sample_rate, steps=steps, accountant=settings.accountant
    )
    optimizer = GaussianDpSgd(
        model,
        data,
        sample_rate=settings.sample_rate,
        expected_batch_size=expected_batch_size,
        noise_multiplier=sigma,
        max_grad_norm=settings.max_grad_norm,
        learning_rate=settings.learning_rate,
        momentum=settings.momentum,
    )
    for _ in range(settings.rounds):
        for _ in range(steps_per_round):
            optimizer.step()
        spent = dp_sgd_epsilon(
            settings.delta,
            noise_multiplier=sigma,
            sample_rate=settings.sample_rate,
            steps=optimizer.steps_taken,
            accountant=settings.accountant,
        )
        yield get_flat_parameters(model), spent


def _fedavg(model: nn.Module, pooled: Split, hospitals: list[Split], settings: BaselineSettings, published: int):
    generator = secure_generator()
    training = LocalTraining(
        epochs=settings.local_epochs, batch_size=settings.batch_size, learning_rate=settings.learning_rate
    )
    for _ in range(settings.rounds):
        updates = [local_update(model, hospital, training, generator) for hospital in hospitals]
        set_flat_parameters(model, get_flat_parameters(model) + _weighted_by_records(updates, hospitals))
        yield get_flat_parameters(model), None


def _fedavg_local_dp(
    model: nn.Module, pooled: Split, hospitals: list[Split], settings: BaselineSettings, published: int
):
    """Each hospital keeps a DP-SGD optimizer over its own records for the whole run; its copy starts each round
    from the global model, and the server averages the copies with equal weights (a hospital's count of
    records is private, so it weighs nothing)."""
    steps_per_round = settings.local_epochs * math.ceil(1 / settings.sample_rate)
    local_models = [copy.deepcopy(model) for _ in hospitals]
    batch = _public_batch_size(settings, published, len(hospitals))
    runs = [
        _dp_sgd_rounds(local, hospital, settings, steps_per_round, batch)
        for local, hospital in zip(local_models, hospitals)
    ]
    for _ in range(settings.rounds):
        start = get_flat_parameters(model)
        for local in local_models:
            set_flat_parameters(local, start)
        results = [next(run) for run in runs]
        updates = [parameters - start for parameters, _ in results]
        set_flat_parameters(model, start + np.mean(updates, axis=0))
        yield get_flat_parameters(model), max(epsilon for _, epsilon in results)


def _weighted_by_records(updates: list[np.ndarray], hospitals: list[Split]) -> np.ndarray:
    """FedAvg's mean: each hospital's update weighted by its share of the records."""
    records = np.array([len(h) for h in hospitals], dtype=np.float64)
    return np.tensordot(records / records.sum(), updates, axes=1)
