"""DP-FedAvg over intermediaries (Jiang et al., Eq. 1), the parts a hospital and the server compute.

Each hospital splits its records into ``v`` disjoint sub-clients ("intermediaries"). In round
``t`` every sub-client ``i`` trains locally from the global model ``theta_t`` and reports its
update ``Delta_i = theta_i - theta_t`` clipped to L2 norm ``C``; the federation releases::

    theta_{t+1} = theta_t + ServerOpt( (1/N) (sum_i clip(Delta_i, C) + N(0, z^2 C^2 I)) )

over the ``N`` sub-clients of the round. A sub-client moves the sum by at most ``C``; a hospital,
whose ``v`` sub-clients all move together, by up to ``v C``: the same release is DP with noise
multiplier ``z`` for a sub-client and ``z / v`` for a hospital (``training.privacy.accounting``).

This module holds the local half (``split_subclients``, ``local_update``, ``clip_update``), which
the baselines share. The secure round's share, noise and accounting are ``training.methods.dp_fedavg``; the
server optimizers (FedAvg, and FedAdam of Reddi et al. 2021) are ``training.methods.update_rules``.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from consilium.errors import ConsiliumError
from consilium.training.data.datasets import Split
from consilium.training.models.build import get_flat_parameters, parameter_count

__all__ = ["LOCAL_OPTIMIZERS", "FedAvgError", "LocalTraining", "clip_update", "local_update", "split_subclients"]

LOCAL_OPTIMIZERS = ("sgd", "adam")


class FedAvgError(ConsiliumError, ValueError):
    """Settings or a split that DP-FedAvg cannot run with."""


@dataclass(frozen=True)
class LocalTraining:
    """How each sub-client trains from the global model before its update is clipped."""

    epochs: int = 1
    batch_size: int = 32
    learning_rate: float = 0.05
    optimizer: str = "sgd"

    def __post_init__(self) -> None:
        if self.optimizer not in LOCAL_OPTIMIZERS:
            raise FedAvgError(
                f"unknown local optimizer {self.optimizer!r}; choose one of {', '.join(LOCAL_OPTIMIZERS)}"
            )
        if self.epochs < 1 or self.batch_size < 1 or not self.learning_rate > 0:
            raise FedAvgError(
                f"local training needs epochs >= 1, batch size >= 1 and a positive learning rate, got {self}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


def split_subclients(records: int, subclients: int, generator: np.random.Generator) -> list[np.ndarray]:
    """``subclients`` disjoint sets of record indices covering ``range(records)``, each record in one drawn uniformly.

    Each record's sub-client is drawn independently of the others', so with or without a record the
    others' split has the same law: adding or removing one record changes only the sub-client it
    joins. A balanced split would not (a part that must keep its size takes a record from another,
    and two sub-clients change). A sub-client may come out empty; its update is then zero.
    """
    if subclients < 1:
        raise FedAvgError(f"a hospital needs at least one sub-client, got v = {subclients}")
    if subclients > records:
        raise FedAvgError(f"v = {subclients} sub-clients from {records} records: more sub-clients than records")
    joins = generator.integers(0, subclients, records)
    return [np.flatnonzero(joins == part) for part in range(subclients)]


def local_update(model: nn.Module, data: Split, settings: LocalTraining, generator: np.random.Generator) -> np.ndarray:
    """``theta_i - theta_t`` (float32) after ``settings.epochs`` of training a copy of ``model`` on ``data``; zero for no data."""
    if (
        len(data) == 0
    ):  # an empty sub-client (training.methods.fedavg.split_subclients): not even a step on an empty batch
        return np.zeros(parameter_count(model), dtype=np.float32)
    local = copy.deepcopy(model)
    local.train()
    if settings.optimizer == "sgd":
        optimizer = torch.optim.SGD(local.parameters(), lr=settings.learning_rate)
    else:
        optimizer = torch.optim.Adam(local.parameters(), lr=settings.learning_rate)
    x, y = torch.as_tensor(data.x), torch.as_tensor(data.y)
    for _ in range(settings.epochs):
        order = torch.as_tensor(generator.permutation(len(data)))
        for batch in order.split(settings.batch_size):
            optimizer.zero_grad()
            nn.functional.cross_entropy(local(x[batch]), y[batch]).backward()
            optimizer.step()
    return get_flat_parameters(local) - get_flat_parameters(model)


def clip_update(update: np.ndarray, bound: float) -> tuple[np.ndarray, float]:
    """``update`` scaled to L2 norm at most ``bound``, and its norm before clipping."""
    norm = float(np.linalg.norm(np.asarray(update, dtype=np.float64)))
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    return (np.asarray(update, dtype=np.float64) * scale).astype(np.float32), norm
