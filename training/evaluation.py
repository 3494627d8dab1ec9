"""How a model is scored, as the field reports it: accuracy and the area under the ROC curve.

AUC is computed from the model's softmax probabilities: for two classes, of the positive class
(index 1); for more, one-vs-rest per class, macro-averaged (MedMNIST's convention, and
scikit-learn's ``roc_auc_score(..., multi_class="ovr")``). A class absent from the split has no
ROC curve: the AUC is then ``None`` rather than a number that means nothing.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.metrics import roc_auc_score
from torch import nn

from training.compute_device import compute_device, on_device
from training.datasets import Split

__all__ = ["evaluate"]


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
    if num_classes == 2:
        auc = roc_auc_score(split.y, probabilities[:, 1])
    else:
        probabilities /= probabilities.sum(axis=1, keepdims=True)  # float32 softmax sums to 1 only nearly
        auc = roc_auc_score(split.y, probabilities, multi_class="ovr", average="macro", labels=list(range(num_classes)))
    return {"accuracy": accuracy, "auc": float(auc)}
