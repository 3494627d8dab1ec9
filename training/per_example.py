"""Per-example gradients clipped to L2 norm ``C``: the part of DP-SGD that every private method shares.

Opacus's ``GradSampleModule`` computes the per-example gradients and nothing else of Opacus runs:
sampling and noise belong to each method (Dopamine's integer shares, the Gaussian DP-SGD of the
baselines), drawn from ``training.secure_random``.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from opacus import GradSampleModule
from opacus.validators import ModuleValidator
from torch import nn

__all__ = ["ClippedGradients"]


class ClippedGradients:
    """Each chosen record's loss gradient at the model's current weights, clipped to norm ``max_grad_norm``."""

    def __init__(self, model: nn.Module, x: np.ndarray, y: np.ndarray, max_grad_norm: float) -> None:
        errors = ModuleValidator.validate(model, strict=False)
        if errors:
            raise ValueError(f"model is not compatible with per-example gradients: {errors[0]}")
        # Copies: a caller changing its arrays later must not change what is trained on.
        self._x = torch.tensor(x)
        self._y = torch.tensor(y)
        self._max_grad_norm = max_grad_norm
        self._module = GradSampleModule(model, loss_reduction="sum")
        self._parameters = [p for p in self._module.parameters() if p.requires_grad]
        self.dimension = sum(p.numel() for p in self._parameters)
        self.records = len(self._y)

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """The rows of a (len(indices), d) float64 array, each of norm below ``C``."""
        if len(indices) == 0:
            return np.zeros((0, self.dimension))
        indices = torch.as_tensor(indices)
        self._module.train()
        self._module.zero_grad(set_to_none=True)  # also drops the previous step's per-example gradients
        loss = nn.functional.cross_entropy(self._module(self._x[indices]), self._y[indices], reduction="sum")
        with warnings.catch_warnings():
            # Opacus's hooks fire on outputs because the inputs need no gradient; that is expected.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss.backward()
        examples = torch.cat([p.grad_sample.reshape(len(indices), -1) for p in self._parameters], dim=1).double()
        norms = examples.norm(dim=1, keepdim=True)
        # Opacus's own clipping factor, C / (norm + 1e-6) capped at 1: the norm stays strictly below C.
        examples *= (self._max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        return examples.numpy()
