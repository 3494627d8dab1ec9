"""Per-example gradients clipped to L2 norm ``C``: the part of DP-SGD that every private method shares.

Opacus's ``GradSampleModule`` computes the per-example gradients and nothing else of Opacus runs:
sampling and noise belong to each method (Dopamine's integer shares, the Gaussian DP-SGD of the
baselines), drawn from ``training.privacy.secure_random``.
"""

from __future__ import annotations

import warnings
from typing import Iterator

import numpy as np
import torch
from torch import nn

from consilium.training.models.compute_device import compute_device, on_device

__all__ = ["ClippedGradients"]

_BATCH_BYTES = 1 << 29


class ClippedGradients:
    """Each chosen record's loss gradient at the model's current weights, clipped to norm ``max_grad_norm``."""

    def __init__(self, model: nn.Module, x: np.ndarray, y: np.ndarray, max_grad_norm: float) -> None:
        # Imported here, not at the top: Opacus costs a process about 1.4 s of CPU to load, which parties
        # that never train (a tallier, a voting server) skip.
        from opacus import GradSampleModule
        from opacus.validators import ModuleValidator

        errors = ModuleValidator.validate(model, strict=False)
        if errors:
            raise ValueError(f"model is not compatible with per-example gradients: {errors[0]}")
        # Copies: a caller changing its arrays later must not change what is trained on.
        self._x = torch.tensor(x, device=compute_device())
        self._y = torch.tensor(y, device=compute_device())
        self._max_grad_norm = max_grad_norm
        self._model = model
        self._device_model = on_device(model)  # the model itself on the CPU, else a copy on the device
        self._module = GradSampleModule(self._device_model, loss_reduction="sum")
        self._parameters = [p for p in self._module.parameters() if p.requires_grad]
        self.dimension = sum(p.numel() for p in self._parameters)
        self.records = len(self._y)

    def batches(self, indices: np.ndarray) -> Iterator[np.ndarray]:
        """The chosen records' clipped gradients, as (rows, d) float64 arrays of a few rows at a time, each
        row of norm below ``C``: a batch's gradients at once would not fit in memory at 11M parameters
        (200 records' took 17 GB), so at most ``_BATCH_BYTES`` of them are held."""
        rows = max(1, _BATCH_BYTES // (8 * self.dimension))
        for start in range(0, len(indices), rows):
            yield self._clipped(indices[start : start + rows])

    def _clipped(self, indices: np.ndarray) -> np.ndarray:
        indices = torch.as_tensor(indices, device=compute_device())
        on_device(self._model, self._device_model)  # the current weights
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
        return examples.cpu().numpy()
