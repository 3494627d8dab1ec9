"""Accuracy and AUC are what their definitions say, computed independently here."""

import numpy as np
import torch
from torch import nn

from consilium.training.data.datasets import Split
from consilium.training.models.evaluation import evaluate


class _Logits(nn.Module):
    """A 'model' whose logits are its input: the scores are known exactly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _pairwise_auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Mann-Whitney: the chance a positive outranks a negative, ties counting half."""
    pos, neg = scores[positive], scores[~positive]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))


def test_binary_auc_is_the_chance_a_positive_outranks_a_negative():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200)
    logits = np.stack([np.zeros(200), y + rng.normal(0, 1.0, 200)], axis=1).astype(np.float32)
    scores = evaluate(_Logits(), Split(logits, y), num_classes=2)
    assert scores["accuracy"] == np.mean((logits[:, 1] > 0) == y)
    assert abs(scores["auc"] - _pairwise_auc(logits[:, 1], y == 1)) < 1e-9
    assert 0.7 < scores["auc"] < 0.9  # informative, not perfect


def test_multiclass_auc_is_the_mean_of_one_vs_rest_aucs():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, 300)
    logits = (np.eye(3)[y] + rng.normal(0, 1.0, (300, 3))).astype(np.float32)
    probabilities = torch.softmax(torch.as_tensor(logits), dim=1).numpy().astype(np.float64)
    expected = np.mean([_pairwise_auc(probabilities[:, c], y == c) for c in range(3)])
    assert abs(evaluate(_Logits(), Split(logits, y), num_classes=3)["auc"] - expected) < 1e-6


def test_a_split_missing_a_class_has_no_auc():
    logits = np.zeros((4, 3), dtype=np.float32)
    assert evaluate(_Logits(), Split(logits, np.array([0, 1, 1, 0])), num_classes=3)["auc"] is None
