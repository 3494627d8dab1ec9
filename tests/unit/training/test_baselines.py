"""The baselines: DP-SGD carries the noise its accountant assumes, and each baseline trains and reports on test."""

import numpy as np
import pytest
import torch
from torch import nn

from consilium.training.models.evaluation import Selection
from consilium.training.methods.baselines import BASELINES, BaselineSettings, run_baseline
from consilium.training.data.datasets import Dataset, Split, load_dataset
from consilium.training.methods.dp_sgd import GaussianDpSgd, dp_sgd_epsilon, noise_multiplier_for
from consilium.training.models.build import input_statistics
from consilium.training.models.spec import ModelSpec
from consilium.training.data.partition import partition


def test_the_chosen_noise_multiplier_spends_the_target_epsilon():
    sigma = noise_multiplier_for(2.0, 1e-5, sample_rate=0.1, steps=200)
    assert dp_sgd_epsilon(1e-5, noise_multiplier=sigma, sample_rate=0.1, steps=200) == pytest.approx(2.0, abs=0.05)
    assert dp_sgd_epsilon(1e-5, noise_multiplier=sigma / 2, sample_rate=0.1, steps=200) > 4.0


def test_a_dp_sgd_step_with_zero_gradients_moves_by_the_accounted_noise():
    """A model whose loss has zero gradient everywhere: each step's move is the noise alone, N(0, (lr sigma C / qn)^2)."""
    model = nn.Sequential(nn.Linear(1, 2000, bias=False))
    nn.init.zeros_(model[0].weight)
    data = Split(np.zeros((50, 1), dtype=np.float32), np.zeros(50, dtype=np.int64))  # x = 0: no gradient
    step = GaussianDpSgd(
        model,
        data,
        sample_rate=0.2,
        expected_batch_size=10.0,
        noise_multiplier=1.5,
        max_grad_norm=2.0,
        learning_rate=0.1,
    )
    step.step()
    moved = model[0].weight.detach().numpy().reshape(-1)
    expected_std = 0.1 * 1.5 * 2.0 / (0.2 * 50)
    assert np.std(moved) == pytest.approx(expected_std, rel=0.06)  # 2000 draws: about 1.6% standard error


def test_a_dp_sgd_step_is_the_same_with_one_record_more():
    """The divisor is public: a record that adds no gradient (x = 0, no bias) leaves the step unchanged. With
    ``q n`` as the divisor, the step's scale would show the count of records, which is private."""
    generator = np.random.default_rng(0)
    x = generator.normal(size=(40, 5)).astype(np.float32)
    y = generator.integers(0, 3, size=40)
    moves = []
    for data in (Split(x, y), Split(np.concatenate([x, np.zeros((1, 5), np.float32)]), np.append(y, 0))):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(5, 3, bias=False))
        before = model[0].weight.detach().clone()
        GaussianDpSgd(
            model,
            data,
            sample_rate=1.0,
            expected_batch_size=8.0,
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            learning_rate=0.5,
        ).step()  # every record sampled, no noise: the move is the clipped sum over B
        moves.append((model[0].weight.detach() - before).numpy())
    assert np.abs(moves[0]).max() > 0
    np.testing.assert_allclose(moves[1], moves[0], rtol=1e-6)


@pytest.fixture(scope="module")
def small():
    digits = load_dataset("digits")
    half = len(digits.validation) // 2
    dataset = Dataset(
        "digits",
        digits.train,
        digits.validation.subset(np.arange(half)),
        10,
        test=digits.validation.subset(np.arange(half, len(digits.validation))),
    )
    mean, std = input_statistics(dataset.train.x)
    return dataset, partition(dataset.train.y, 3, seed=0), ModelSpec("mlp", (64,), 10, (16,), mean, std)


@pytest.mark.parametrize("name", BASELINES)
def test_each_baseline_trains_and_reports_on_the_test_split(small, name):
    dataset, parts, spec = small
    torch.manual_seed(0)
    result = run_baseline(
        name, dataset, parts, spec, BaselineSettings(rounds=4, epsilon=8.0, sample_rate=0.1, learning_rate=0.5)
    )
    final, selected = result["final"], result["final"]["selected"]
    assert result["method"] == name and selected["test"]["accuracy"] > 0.5  # ten classes: chance is 0.1
    assert [r["round"] for r in result["rounds"]] == [1, 2, 3, 4]
    best = max(r["validation_accuracy"] for r in result["rounds"])
    assert selected["validation_accuracy"] == best == result["rounds"][selected["round"] - 1]["validation_accuracy"]
    if name.endswith("dp"):
        assert final["epsilon"] == pytest.approx(8.0, abs=0.1)
    else:
        assert final["epsilon"] is None


def test_an_unknown_baseline_is_refused(small):
    with pytest.raises(ValueError, match="unknown baseline 'central-ldp'"):
        run_baseline("central-ldp", *small, BaselineSettings())


def test_a_baseline_selects_among_its_candidate_rounds_only(small):
    """Every second of 5 rounds: rounds 2, 4 and the last, 5, are the candidates."""
    dataset, parts, spec = small
    result = run_baseline(
        "central",
        dataset,
        parts,
        spec,
        BaselineSettings(rounds=5, learning_rate=0.5),
        model_seed=0,
        selection=Selection(every=2, on="auc"),
    )
    final = result["final"]
    candidates = [r for r in result["rounds"] if r["round"] in (2, 4, 5)]
    best = max(candidates, key=lambda r: (r["validation_auc"], -r["round"]))
    assert final["selection"] == {"every": 2, "on": "auc", "candidates": 3}
    assert (final["selected"]["round"], final["selected"]["validation_auc"]) == (best["round"], best["validation_auc"])
