"""Where this process runs its models' forward and backward passes: the CPU, or a GPU its operator names.

A party's own choice of hardware (``--device``), never part of a run: every party computes on its
own machine, and what it sends does not depend on where. The model itself, the update rules, the
rounding and the noise stay on the CPU (the noise is drawn from ``training.privacy.secure_random``'s
ChaCha20 there); only the per-example gradients (``training.methods.per_example``) and a model's scores
(``training.models.evaluation``) are computed on the device, by a copy of the model that takes the
current weights before each use.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from consilium.errors import ConsiliumError

__all__ = ["DeviceError", "compute_device", "on_device", "use_device"]

_device = torch.device("cpu")


class DeviceError(ConsiliumError, ValueError):
    """A device this machine does not have."""


def use_device(name: str) -> None:
    """Compute on ``name`` (``cpu``, ``cuda`` or ``cuda:N``) from now on, in this process."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise DeviceError(f"--device {name!r}: {error}") from None
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise DeviceError(f"--device {name}: this machine has no such CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"--device {name}: only cpu and cuda are supported")
    global _device
    _device = device


def compute_device() -> torch.device:
    return _device


def on_device(model: nn.Module, copy_of: nn.Module | None = None) -> nn.Module:
    """``model`` itself on the CPU; elsewhere a copy of it on the device (``copy_of``, that copy made before,
    given the model's current weights)."""
    if _device.type == "cpu":
        return model
    if copy_of is None:
        return copy.deepcopy(model).to(_device)
    with torch.no_grad():
        for target, source in zip(copy_of.parameters(), model.parameters()):
            target.copy_(source, non_blocking=True)
    return copy_of
