import math

import numpy as np
import pytest
import torch

from training.accounting import aggregate_noise_multiplier
from training.datasets import load_dataset
from training.dopamine import DopamineSettings, MomentumUpdate, NoisyGradientStep, encoding_range
from training.models import ModelSpec, build_model, get_flat_parameters, input_statistics, set_flat_parameters

SETTINGS = dict(max_grad_norm=1.5, quorum=3, expected_batch_size=12.0, learning_rate=0.1, momentum=0.9)


def _model(hidden=(8,)):
    return build_model(ModelSpec("mlp", (30,), 2, hidden))


def _data(n=200, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 30)).astype(np.float32) * 5, rng.integers(0, 2, n)


def test_an_empty_batch_still_carries_exactly_its_noise_share():
    """With q ~ 0 every batch is empty: g_k is pure noise of std sigma C / (sqrt(K_min) B)."""
    settings = DopamineSettings(sample_rate=1e-12, noise_multiplier=2.0, **SETTINGS)
    step = NoisyGradientStep(_model(), *_data(), settings)
    noise = np.concatenate([step()[0] for _ in range(40)])
    expected = 2.0 * 1.5 / (math.sqrt(3) * 12.0)
    assert noise.size > 10_000
    assert abs(np.mean(noise)) < 0.05 * expected
    assert np.std(noise) == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("contributors", [3, 5])
def test_the_sum_of_shares_has_the_noise_the_accountant_assumes(contributors):
    settings = DopamineSettings(sample_rate=1e-12, noise_multiplier=1.3, **SETTINGS)
    steps = [NoisyGradientStep(_model(), *_data(seed=k), settings) for k in range(contributors)]
    sums = np.concatenate([sum(step()[0] for step in steps) for _ in range(30)])
    multiplier = aggregate_noise_multiplier(1.3, contributors, quorum=3)
    assert np.std(sums) * 12.0 / 1.5 == pytest.approx(multiplier, rel=0.05)


def test_without_noise_the_step_is_the_clipped_sum_divided_by_the_expected_batch_size():
    settings = DopamineSettings(sample_rate=1.0, noise_multiplier=0.0, **SETTINGS)
    x, y = _data(n=20)
    model = _model()
    reference = _model()
    set_flat_parameters(reference, get_flat_parameters(model))
    gradient, batch = NoisyGradientStep(model, x, y, settings)()
    assert batch == 20
    expected = torch.zeros(sum(p.numel() for p in reference.parameters()))
    for xi, yi in zip(torch.as_tensor(x), torch.as_tensor(y)):
        reference.zero_grad()
        torch.nn.functional.cross_entropy(reference(xi[None]), yi[None], reduction="sum").backward()
        g = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        expected += g * min(1.0, 1.5 / float(g.norm()))
    assert np.allclose(gradient, (expected / 12.0).numpy(), atol=1e-5)


def test_momentum_is_applied_to_the_mean_as_in_algorithm_1():
    settings = DopamineSettings(sample_rate=0.5, noise_multiplier=1.0, **SETTINGS)
    model = _model()
    w0 = get_flat_parameters(model)
    update = MomentumUpdate(model, settings)
    g1, g2 = np.random.default_rng(0).normal(size=(2, w0.size)).astype(np.float32)
    update.apply(g1)
    update.apply(g2)
    expected = w0 - 0.1 * g1 - 0.1 * (0.9 * g1 + g2)
    assert np.allclose(get_flat_parameters(model), expected, atol=1e-6)
    with pytest.raises(ValueError, match="expected a gradient of"):
        update.apply(g1[:-1])


def test_real_training_stays_within_the_encoding_range_and_learns():
    data = load_dataset("breast_cancer")
    mean, std = input_statistics(data.validation.x)
    model = build_model(ModelSpec("mlp", data.input_shape, 2, (16,), mean, std))
    settings = DopamineSettings(
        sample_rate=0.1, noise_multiplier=2.0, max_grad_norm=1.0, quorum=1,
        expected_batch_size=0.1 * len(data.train), learning_rate=0.05, momentum=0.9,
    )  # fmt: skip
    encoding = encoding_range(settings)
    step, update = NoisyGradientStep(model, data.train.x, data.train.y, settings), MomentumUpdate(model, settings)
    largest = 0.0
    for _ in range(60):
        gradient, _ = step()
        largest = max(largest, float(np.abs(gradient).max()))
        update.apply(gradient)
    assert largest < encoding.bound
    predictions = model(torch.as_tensor(data.validation.x)).argmax(1).numpy()
    assert np.mean(predictions == data.validation.y) > 0.85


def test_encoding_range_follows_the_noise_and_clipping():
    settings = DopamineSettings(sample_rate=0.1, noise_multiplier=2.0, **SETTINGS)
    encoding = encoding_range(settings)
    share_std = 2.0 * 1.5 / (math.sqrt(3) * 12.0)
    assert encoding.precision == pytest.approx(share_std / 64)
    assert encoding.bound == pytest.approx(1.5 * (1 + 4 / math.sqrt(12.0)) + 6 * share_std)
    noiseless = encoding_range(DopamineSettings(sample_rate=0.1, noise_multiplier=0.0, **SETTINGS))
    assert noiseless.precision == pytest.approx(noiseless.bound / 2**16)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="sample_rate"):
        DopamineSettings(sample_rate=0.0, noise_multiplier=1.0, **SETTINGS)
    with pytest.raises(ValueError, match="exactly"):
        DopamineSettings.from_dict({"sample_rate": 0.1})
    with pytest.raises(ValueError, match="per-example"):
        NoisyGradientStep(torch.nn.Sequential(torch.nn.BatchNorm1d(30), torch.nn.Linear(30, 2)), *_data(), DopamineSettings(sample_rate=0.1, noise_multiplier=1.0, **SETTINGS))
