"""How every party moves the global model by a released vector, identically, and carries the state.

A secure round releases one vector per round: Dopamine's mean noisy gradient, or DP-FedAvg's
mean noisy update ``u`` (which is read as the descent direction ``g = -u``). The server and every
hospital apply the same rule to the same float32 vector, so their models stay equal; a party that
joins later takes the model and the rule's ``state()`` from the server.

- ``MomentumUpdate``: ``m <- beta m + g``, ``w <- w - lr m``. Dopamine's lines 13-14, the
  baselines' DP-SGD step, and FedAvg's server step (``beta = 0`` and ``lr = 1``: ``w <- w + u``).
- ``FedAdamUpdate`` (Reddi et al. 2021, Algorithm 2, no bias correction)::

      m <- b1 m + (1 - b1) g,   s <- b2 s + (1 - b2) g^2,   w <- w - lr m / (sqrt(s) + tau)

Both keep their state in float32, so what travels in a Welcome or a checkpoint is exact.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

__all__ = ["MAX_LEARNING_RATE", "FedAdamUpdate", "MomentumUpdate", "UpdateRule"]

# Settings that name a learning rate come from the server; one above this overflows torch's float
# step (from about 1e38), and no run wants one near it.
MAX_LEARNING_RATE = 100.0


class _Flat:
    """A model's parameters seen as one flat float32 vector."""

    def __init__(self, model: nn.Module) -> None:
        self.parameters = list(model.parameters())
        self.sizes = [p.numel() for p in self.parameters]
        self.dimension = sum(self.sizes)

    def vector(self, values: np.ndarray, what: str, count: int = 1) -> torch.Tensor:
        tensor = torch.as_tensor(np.asarray(values, dtype=np.float32))
        if tensor.shape != (count * self.dimension,):
            raise ValueError(f"expected {what} of {count * self.dimension} values, got shape {tuple(tensor.shape)}")
        return tensor

    def parts(self, vector: torch.Tensor) -> list[torch.Tensor]:
        return [part.view_as(p) for p, part in zip(self.parameters, vector.split(self.sizes))]


class MomentumUpdate:
    """``m <- beta m + g``, ``w <- w - lr m`` for a flat descent direction ``g``."""

    def __init__(self, model: nn.Module, *, learning_rate: float, momentum: float) -> None:
        self._flat = _Flat(model)
        self._optimizer = torch.optim.SGD(self._flat.parameters, lr=learning_rate, momentum=momentum)

    def apply(self, direction: np.ndarray) -> None:
        for parameter, values in zip(
            self._flat.parameters, self._flat.parts(self._flat.vector(direction, "a gradient"))
        ):
            parameter.grad = values.clone()
        self._optimizer.step()

    def state(self) -> np.ndarray:
        """``m`` as float32, zeros before the first step (where SGD's lazily created buffer starts)."""
        buffers = [self._optimizer.state.get(p, {}).get("momentum_buffer") for p in self._flat.parameters]
        return np.concatenate(
            [
                (torch.zeros_like(p) if b is None else b).detach().reshape(-1).numpy()
                for p, b in zip(self._flat.parameters, buffers)
            ]
        ).astype("<f4")

    def load_state(self, values: np.ndarray) -> None:
        """Continue from ``m = values``, e.g. a checkpoint's; the next step is ``m <- beta m + g``."""
        for parameter, part in zip(self._flat.parameters, self._flat.parts(self._flat.vector(values, "a momentum"))):
            self._optimizer.state[parameter]["momentum_buffer"] = part.clone()


class FedAdamUpdate:
    """FedAdam's server step on a flat descent direction ``g``; its state is ``m`` then ``s``."""

    def __init__(
        self, model: nn.Module, *, learning_rate: float, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3
    ) -> None:
        self._flat = _Flat(model)
        self._lr, self._beta1, self._beta2, self._tau = learning_rate, beta1, beta2, tau
        self._first = torch.zeros(self._flat.dimension)
        self._second = torch.zeros(self._flat.dimension)

    def apply(self, direction: np.ndarray) -> None:
        g = self._flat.vector(direction, "a gradient")
        self._first = self._beta1 * self._first + (1 - self._beta1) * g
        self._second = self._beta2 * self._second + (1 - self._beta2) * g * g
        step = self._lr * self._first / (self._second.sqrt() + self._tau)
        with torch.no_grad():
            for parameter, values in zip(self._flat.parameters, self._flat.parts(step)):
                parameter -= values

    def state(self) -> np.ndarray:
        return torch.cat([self._first, self._second]).numpy().astype("<f4")

    def load_state(self, values: np.ndarray) -> None:
        first, second = self._flat.vector(values, "FedAdam's moments", count=2).split(self._flat.dimension)
        if (second < 0).any():  # its square root scales every step
            raise ValueError("FedAdam's second moment must be non-negative")
        self._first, self._second = first.clone(), second.clone()


UpdateRule = MomentumUpdate | FedAdamUpdate
