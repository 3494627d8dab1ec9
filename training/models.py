"""Models every party can rebuild from a small spec, all compatible with Opacus.

``ModelSpec`` travels in the run configuration; ``build_model`` turns it into a module. Inputs are
standardised inside the model with statistics the server computes on its own validation data, so
that no hospital's data shapes the preprocessing (a statistic of a hospital's data would also break
the per-example independence DP-SGD assumes).

Activations are tanh: bounded activations keep per-example gradients small, so less is lost to
clipping (Papernot et al., "Tempered Sigmoid Activations for Deep Learning with Differential
Privacy"). The CNN is Opacus's MNIST example network; it has no batch norm, which mixes examples.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

__all__ = [
    "ARCHITECTURES",
    "ModelSpec",
    "accuracy",
    "build_model",
    "get_flat_parameters",
    "input_statistics",
    "parameter_count",
    "set_flat_parameters",
    "takes_images",
]

ARCHITECTURES = ("mlp", "cnn")
_MIN_STD = 1e-6
# What a spec that arrives from elsewhere (a run configuration) may ask for, checked before any
# tensor is allocated: a hospital builds the model a server names.
MAX_WIDTH = 1 << 16  # of an input dimension, a hidden layer, the classes
MAX_INPUT_VALUES = 1 << 24
MAX_HIDDEN_LAYERS = 16
MAX_PARAMETERS = 1 << 26
_CNN_LAYERS = ((16, 8, 2, 3), (32, 4, 2, 0))  # (channels, kernel, stride, padding), each followed by MaxPool2d(2, 1)


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    input_shape: tuple[int, ...]
    num_classes: int
    hidden: tuple[int, ...] = (48,)  # hidden widths of the MLP
    input_mean: tuple[float, ...] = ()  # per feature (vectors) or per channel (images); () for none
    input_std: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r}; choose from {', '.join(ARCHITECTURES)}")
        if not 1 <= len(self.input_shape) <= 3 or not all(1 <= v <= MAX_WIDTH for v in self.input_shape):
            raise ValueError(f"an input shape has 1 to 3 dimensions of 1 to {MAX_WIDTH}, got {self.input_shape}")
        if math.prod(self.input_shape) > MAX_INPUT_VALUES:
            raise ValueError(f"an input of shape {self.input_shape} holds more than {MAX_INPUT_VALUES:,} values")
        if self.architecture == "cnn" and not self.takes_images:
            raise ValueError(f"the CNN needs (channels, height, width) inputs, got shape {self.input_shape}")
        if not 2 <= self.num_classes <= MAX_WIDTH:
            raise ValueError(f"need 2 to {MAX_WIDTH} classes, got {self.num_classes}")
        if len(self.hidden) > MAX_HIDDEN_LAYERS or not all(1 <= v <= MAX_WIDTH for v in self.hidden):
            raise ValueError(
                f"an MLP has at most {MAX_HIDDEN_LAYERS} hidden layers of 1 to {MAX_WIDTH} units, got {self.hidden}"
            )
        if len(self.input_mean) != len(self.input_std) or len(self.input_mean) not in (0, self.input_shape[0]):
            raise ValueError(
                f"input_mean and input_std need one value per {'channel' if self.takes_images else 'feature'}, or none"
            )
        if not all(math.isfinite(v) for v in self.input_mean) or not all(
            math.isfinite(v) and v > 0 for v in self.input_std
        ):
            raise ValueError("input_mean must be finite and input_std positive")
        if self.parameter_count() > MAX_PARAMETERS:
            raise ValueError(
                f"a model of {self.parameter_count():,} parameters exceeds the {MAX_PARAMETERS:,} a party builds"
            )

    def parameter_count(self) -> int:
        """How many parameters ``build_model`` makes of this spec, computed without building it."""
        if self.architecture == "mlp":
            widths = (math.prod(self.input_shape), *self.hidden, self.num_classes)
            return sum(n_in * n_out + n_out for n_in, n_out in zip(widths, widths[1:]))
        channels, height, width = self.input_shape
        count = 0
        for out_channels, kernel, stride, padding in _CNN_LAYERS:
            count += channels * out_channels * kernel * kernel + out_channels
            height, width = ((size + 2 * padding - kernel) // stride + 1 - 1 for size in (height, width))
            channels = out_channels
            if height < 1 or width < 1:
                raise ValueError(f"images of shape {self.input_shape} are too small for the CNN")
        features = channels * height * width
        return count + features * 32 + 32 + 32 * self.num_classes + self.num_classes

    @property
    def takes_images(self) -> bool:
        return takes_images(self.input_shape)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> "ModelSpec":
        lengths = {"input_shape": 3, "hidden": MAX_HIDDEN_LAYERS, "input_mean": MAX_WIDTH, "input_std": MAX_WIDTH}
        for name, most in lengths.items():  # before anything of their length is made
            if (
                not isinstance(fields, dict)
                or not isinstance(fields.get(name, []), (list, tuple))
                or len(fields.get(name, [])) > most
            ):
                raise ValueError(f"malformed model spec: {name} must be a list of at most {most} numbers")
        try:
            return cls(
                architecture=str(fields["architecture"]),
                input_shape=tuple(int(v) for v in fields["input_shape"]),
                num_classes=int(fields["num_classes"]),
                hidden=tuple(int(v) for v in fields.get("hidden", ())),
                input_mean=tuple(float(v) for v in fields.get("input_mean", ())),
                input_std=tuple(float(v) for v in fields.get("input_std", ())),
            )
        except (KeyError, TypeError, OverflowError) as error:
            raise ValueError(f"malformed model spec: {error}") from None


def takes_images(input_shape: tuple[int, ...]) -> bool:
    """Whether inputs of this shape are (channels, height, width) images."""
    return len(input_shape) == 3


def input_statistics(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Mean and standard deviation per feature (x of shape (n, d)) or per channel (n, c, h, w)."""
    axes = (0,) if x.ndim == 2 else (0, 2, 3)
    mean = x.mean(axis=axes, dtype=np.float64)
    std = np.maximum(x.std(axis=axes, dtype=np.float64), _MIN_STD)
    return tuple(map(float, mean)), tuple(map(float, std))


def build_model(spec: ModelSpec) -> nn.Module:
    layers: list[nn.Module] = []
    if spec.input_mean:
        layers.append(_Standardize(spec.input_mean, spec.input_std, len(spec.input_shape)))
    if spec.architecture == "mlp":
        layers.append(nn.Flatten())
        width = int(np.prod(spec.input_shape))
        for hidden in spec.hidden:
            layers += [nn.Linear(width, hidden), nn.Tanh()]
            width = hidden
        layers.append(nn.Linear(width, spec.num_classes))
    else:
        (first, kernel_1, stride_1, padding_1), (second, kernel_2, stride_2, padding_2) = _CNN_LAYERS
        features = nn.Sequential(
            nn.Conv2d(spec.input_shape[0], first, kernel_1, stride=stride_1, padding=padding_1),
            nn.Tanh(),
            nn.MaxPool2d(2, 1),
            nn.Conv2d(first, second, kernel_2, stride=stride_2, padding=padding_2),
            nn.Tanh(),
            nn.MaxPool2d(2, 1),
            nn.Flatten(),
        )
        with torch.no_grad():
            width = features(torch.zeros(1, *spec.input_shape)).shape[1]
        layers += [features, nn.Linear(width, 32), nn.Tanh(), nn.Linear(32, spec.num_classes)]
    return nn.Sequential(*layers)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def get_flat_parameters(model: nn.Module) -> np.ndarray:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().astype(np.float32)


def set_flat_parameters(model: nn.Module, vector: np.ndarray) -> None:
    """Copy ``vector`` into the model's parameters (never aliasing it, unlike ``vector_to_parameters``)."""
    parameters = list(model.parameters())
    sizes = [p.numel() for p in parameters]
    if np.shape(vector) != (sum(sizes),):
        raise ValueError(f"expected {sum(sizes)} parameters, got shape {np.shape(vector)}")
    values = torch.from_numpy(np.array(vector, dtype=np.float32))  # a copy: the input may be read-only
    with torch.no_grad():
        for parameter, chunk in zip(parameters, values.split(sizes)):
            parameter.copy_(chunk.view_as(parameter))


@torch.no_grad()
def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    model.eval()
    predictions = model(torch.as_tensor(x)).argmax(dim=1).numpy()
    return float(np.mean(predictions == y))


class _Standardize(nn.Module):
    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...], input_rank: int) -> None:
        super().__init__()
        shape = (-1,) if input_rank == 1 else (-1,) + (1,) * (input_rank - 1)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).reshape(shape))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).reshape(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std
