"""How a model is scored, as the field reports it: accuracy and the area under the ROC curve.

AUC is computed from the model's softmax probabilities: for two classes, of the positive class
(index 1); for more, one-vs-rest per class, macro-averaged (MedMNIST's convention, and
scikit-learn's ``roc_auc_score(..., multi_class="ovr")``). A class absent from the split has no
ROC curve: the AUC is then ``None`` rather than a number that means nothing.

``Selection`` says which model a run keeps: the round that scores best on validation, on accuracy
or on AUC, among every n-th round and the last. Two choices matter in a comparison. A method
selected among 200 rounds has ten times the chances of one selected among 20 epochs to find a round
that suits a small validation split, so every method gets the same number of candidates. And on
imbalanced data, accuracy stays at the majority class's share while the model's ranking improves
(a model of validation AUC 0.94 and one of 0.43 both scored 0.742 on PneumoniaMNIST's validation
split), so a comparison that reports AUC selects on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from consilium.training.models.compute_device import compute_device, on_device
from consilium.training.data.datasets import Split

__all__ = ["SELECTION_METRICS", "Selection", "evaluate"]

SELECTION_METRICS = ("accuracy", "auc")


@dataclass(frozen=True)
class Selection:
    every: int = 1  # candidates: every n-th round, and the last
    on: str = "accuracy"  # the validation score that chooses among them: accuracy or auc

    def __post_init__(self) -> None:
        if not (type(self.every) is int and self.every >= 1):
            raise ValueError(f"a selection's every must be a whole number of at least 1, got {self.every!r}")
        if self.on not in SELECTION_METRICS:
            raise ValueError(f"a selection is on {' or '.join(SELECTION_METRICS)}, got {self.on!r}")

    def candidate(self, round_number: int, last_round: int) -> bool:
        return round_number % self.every == 0 or round_number == last_round

    def score(self, accuracy: float | None, auc: float | None) -> float:
        """A candidate's validation score; a missing one (no AUC where a class is absent) ranks last."""
        value = accuracy if self.on == "accuracy" else auc
        return float("-inf") if value is None else value


@torch.no_grad()
def evaluate(model: nn.Module, split: Split, *, num_classes: int) -> dict[str, float | None]:
    """``{"accuracy": ..., "auc": ...}`` of ``model`` on ``split``."""
    model = on_device(model)
    model.eval()
    outputs = model(torch.as_tensor(split.x, device=compute_device()))
    probabilities = torch.softmax(outputs, dim=1).cpu().numpy().astype(np.float64)
    accuracy = float(np.mean(probabilities.argmax(axis=1) == split.y))
    if len(np.unique(split.y)) < num_classes:
        return {"accuracy": accuracy, "auc": None}
    # Imported here: scikit-learn's metrics take a process about 0.9 s of CPU to load (scipy.stats), which
    # parties that never score a model (a tallier, a hospital) skip.
    from sklearn.metrics import roc_auc_score

    if num_classes == 2:
        auc = roc_auc_score(split.y, probabilities[:, 1])
    else:
        probabilities /= probabilities.sum(axis=1, keepdims=True)  # float32 softmax sums to 1 only nearly
        auc = roc_auc_score(split.y, probabilities, multi_class="ovr", average="macro", labels=list(range(num_classes)))
    return {"accuracy": accuracy, "auc": float(auc)}
