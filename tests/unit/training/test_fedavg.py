"""DP-FedAvg's local and server halves do what Eq. (1) and Reddi et al.'s FedAdam say."""

import numpy as np
import pytest
import torch
from torch import nn

from consilium.training.data.datasets import Split
from consilium.training.methods.fedavg import FedAvgError, LocalTraining, clip_update, local_update, split_subclients
from consilium.training.models.build import build_model, get_flat_parameters
from consilium.training.models.spec import ModelSpec
from consilium.training.privacy.secure_random import secure_generator


def test_subclients_are_disjoint_cover_the_records_and_each_record_joins_one_independently():
    """Each record's sub-client is uniform and independent of the others' (what keeps one record's
    cost one sub-client's). Three records in two sub-clients: two given records share one half the
    time (a balanced 2 + 1 split: a third of the time), and a sub-client is sometimes empty."""
    generator, draws = secure_generator(), 2000
    together = empty = 0
    for _ in range(draws):
        parts = split_subclients(3, 2, generator)
        assert sorted(np.concatenate(parts).tolist()) == [0, 1, 2]
        together += any({0, 1} <= set(part.tolist()) for part in parts)
        empty += any(len(part) == 0 for part in parts)
    assert abs(together - draws / 2) <= 6 * np.sqrt(draws / 4)
    assert abs(empty - draws / 4) <= 6 * np.sqrt(draws * 3 / 16)


@pytest.mark.parametrize("subclients, message", [(0, "at least one"), (24, "more sub-clients than records")])
def test_impossible_splits_are_refused(subclients, message):
    with pytest.raises(FedAvgError, match=message):
        split_subclients(23, subclients, secure_generator())


def test_one_full_batch_sgd_epoch_moves_the_model_by_minus_lr_times_the_gradient():
    model = build_model(ModelSpec("mlp", (4,), 3, (5,)))
    rng = np.random.default_rng(0)
    data = Split(rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 3, 8))
    loss = nn.functional.cross_entropy(model(torch.as_tensor(data.x)), torch.as_tensor(data.y))
    gradient = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))]).numpy()
    before = get_flat_parameters(model)
    update = local_update(model, data, LocalTraining(epochs=1, batch_size=8, learning_rate=0.1), secure_generator())
    np.testing.assert_allclose(update, -0.1 * gradient, atol=1e-6)
    np.testing.assert_array_equal(get_flat_parameters(model), before)  # the global model is left alone


def test_clipping_bounds_the_norm_and_keeps_the_direction():
    update = np.array([3.0, 4.0], dtype=np.float32)
    clipped, norm = clip_update(update, 1.0)
    assert norm == 5.0 and np.allclose(clipped, [0.6, 0.8])
    small, _ = clip_update(update, 10.0)
    np.testing.assert_array_equal(small, update)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: LocalTraining(optimizer="lbfgs"), "unknown local optimizer 'lbfgs'"),
        (lambda: LocalTraining(epochs=0), "epochs >= 1"),
    ],
)
def test_unknown_optimizers_and_bad_settings_are_refused(build, message):
    with pytest.raises(FedAvgError, match=message):
        build()
