"""Models every party can rebuild from a small spec, all compatible with Opacus.

``ModelSpec`` travels in the run configuration; ``build_model`` turns it into a module. A model is
one of the built-in ones (``mlp``, ``cnn``) or a function of the operators' own code: ``--model
package.module:function`` or ``path/to/file.py:function`` (``training.models.own_code``), given the input
shape and the number of classes and returning a ``torch.nn.Module``. Each party loads such code
from its own installation (``use_model_code``), never because a server names it; the spec carries
the model's name, its parameter count and a digest of what it builds (``model_digest``: the names,
shapes and dtypes of its parameters and buffers), and every build is checked against that digest.
``describe_model`` makes the spec where a run is set up, after checking that DP-SGD can train the
model (Opacus's ``ModuleValidator``, per layer, so that the error names the layer); with ``fix``,
Opacus's fixes (GroupNorm for BatchNorm) are applied first, by every party alike. Inputs are
standardised inside the model with statistics the server computes on its own validation data, so
that no hospital's data shapes the preprocessing (a statistic of a hospital's data would also break
the per-example independence DP-SGD assumes).

Activations are tanh: bounded activations keep per-example gradients small, so less is lost to
clipping (Papernot et al., "Tempered Sigmoid Activations for Deep Learning with Differential
Privacy"). The CNN is Opacus's MNIST example network; it has no batch norm, which mixes examples.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict
from typing import Callable

import numpy as np
import torch
from torch import nn

from consilium.errors import ConsiliumError
from consilium.training.data.datasets import Split
from consilium.training.models.own_code import is_reference, load_function, reference_name
from consilium.training.models.spec import CNN_LAYERS, MAX_PARAMETERS, ModelSpec

__all__ = [
    "ModelError",
    "accuracy",
    "build_model",
    "check_model_for",
    "describe_model",
    "use_model_code",
    "get_flat_parameters",
    "input_statistics",
    "model_digest",
    "parameter_count",
    "set_flat_parameters",
]

_MIN_STD = 1e-6
_OWN_MODELS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {}  # by name: what this party's operator named


class ModelError(ConsiliumError, ValueError):
    """A model a party cannot build or train with DP-SGD, or whose digest differs from the run's."""


def use_model_code(reference: str) -> str:
    """Load the model function ``reference`` names from this machine, to build under its name (returned)."""
    name = reference_name(reference, flag="--model", error=ModelError)
    _OWN_MODELS[name] = load_function(reference, flag="--model", error=ModelError)
    return name


def input_statistics(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Mean and standard deviation per feature (x of shape (n, d)) or per channel (n, c, h, w)."""
    axes = (0,) if x.ndim == 2 else (0, 2, 3)
    mean = x.mean(axis=axes, dtype=np.float64)
    std = np.maximum(x.std(axis=axes, dtype=np.float64), _MIN_STD)
    return tuple(map(float, mean)), tuple(map(float, std))


def describe_model(
    model: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    hidden: tuple[int, ...] = (48,),
    input_mean: tuple[float, ...] = (),
    input_std: tuple[float, ...] = (),
    fix: bool = False,
    classes: tuple[str, ...] = (),
) -> ModelSpec:
    """The spec of ``model``: a built-in one's name, or a reference to this party's own code
    (``training.models.own_code``), which is loaded and built here to count and digest it.

    ``ModelError`` for a model that cannot be loaded or built, or that DP-SGD cannot train: the
    message names the first such layer and says whether ``fix`` would replace it.
    """
    if is_reference(model):
        name = use_model_code(model)
        core = _own_core(name, input_shape, num_classes, fix=fix)
        parameters = parameter_count(core)
        if parameters > MAX_PARAMETERS:
            raise ModelError(f"{name} has {parameters:,} parameters, more than the {MAX_PARAMETERS:,} a party builds")
        spec = ModelSpec(name, input_shape, num_classes, (), input_mean, input_std, "0" * 64, parameters, fix)
        built = nn.Sequential(*_standardize(spec), core)
    elif fix:
        raise ModelError(f"--fix-model is for a model of your own; the built-in {model} needs no fixes")
    else:
        spec = ModelSpec(model, input_shape, num_classes, hidden, input_mean, input_std)
        built = build_model(spec)
    return ModelSpec(**{**asdict(spec), "digest": model_digest(built), "classes": tuple(classes)})


def check_model_for(spec: ModelSpec, records: Split, own_model: str | None) -> None:
    """``ModelError`` where this party cannot take part in a run of ``spec``: its records do not fit the model,
    or its operator named a model of their own (``own_model``, its name) and the run trains another."""
    misfit = records.misfit(spec.input_shape, spec.num_classes, spec.classes)
    if misfit:
        raise ModelError(misfit)
    if own_model is not None and spec.architecture != own_model:
        raise ModelError(f"the run trains {spec.architecture}; this party was started with --model for {own_model}")


def build_model(spec: ModelSpec, *, seed: int | None = None) -> nn.Module:
    """The module of ``spec``, built from this party's own code; ``ModelError`` if it is not the one the spec's
    digest describes (another definition of the model, another version of a built-in one).

    An own model is first built on PyTorch's meta device (shapes, no memory) and compared there, so that
    a run whose sizes make this party's code build something large is refused before it is allocated.
    With a ``seed``, its initial weights are drawn from PyTorch's generator seeded with it, in a fork of
    the generator's state (nothing else's draws change): the initial model is public, so a fixed seed
    costs no privacy, and runs that share it start alike. No noise, sampling or rounding draws from it.
    """
    if seed is None:
        return _built(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _built(spec)


def _built(spec: ModelSpec) -> nn.Module:
    if spec.own_code:
        with torch.device("meta"):
            _check_digest(spec, _assembled(spec))
        return _assembled(spec)
    return _check_digest(spec, _assembled(spec))


def _assembled(spec: ModelSpec) -> nn.Module:
    if spec.own_code:
        return nn.Sequential(
            *_standardize(spec), _own_core(spec.architecture, spec.input_shape, spec.num_classes, fix=spec.fix)
        )
    return nn.Sequential(*_standardize(spec), *_built_in_layers(spec))


def _check_digest(spec: ModelSpec, model: nn.Module) -> nn.Module:
    """``model``, where it is what ``spec`` describes: its digest, and an own model's parameter count."""
    count, digest = parameter_count(model), model_digest(model)
    if (spec.own_code and count != spec.parameters) or (spec.digest and digest != spec.digest):
        raise ModelError(
            f"the run's model {spec.architecture} is not what this party's code builds ({count:,} parameters, digest "
            f"{digest[:12]}; the run's {spec.parameter_count():,}, {spec.digest[:12]}): another definition or version of it"
        )
    return model


def model_digest(model: nn.Module) -> str:
    """SHA-256 of the names, shapes and dtypes of the model's parameters and buffers, in order (not their values)."""
    layout = [
        [name, list(tensor.shape), str(tensor.dtype)]
        for named in (model.named_parameters(), model.named_buffers())
        for name, tensor in named
    ]
    return hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()


def _own_core(name: str, input_shape: tuple[int, ...], num_classes: int, *, fix: bool) -> nn.Module:
    """The operators' own module, built by the function this party loaded, fixed if asked, and checked for DP-SGD."""
    if name not in _OWN_MODELS:
        raise ModelError(
            f"the run trains {name}, a model of the operators' own code: start this party with --model naming its "
            "copy of that function"
        )
    try:
        core = _OWN_MODELS[name](tuple(input_shape), num_classes)
    except Exception as error:  # the operator's own code: its failure is theirs to fix, in one line
        raise ModelError(f"the model function {name} failed: {type(error).__name__}: {error}") from None
    if not isinstance(core, nn.Module):
        raise ModelError(f"the model function {name} returned a {type(core).__name__}, not a torch.nn.Module")
    if fix:
        # Imported here, not at the top: Opacus costs a process about 1.4 s of CPU to load, which parties
        # that never train (a tallier, a voting server) skip.
        from opacus.validators import ModuleValidator

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus says what it replaced; the spec records that it did
            core = ModuleValidator.fix(core)
    _check_trainable(core, name, fixed=fix)
    return core


def _check_trainable(core: nn.Module, name: str, *, fixed: bool) -> None:
    """``ModelError`` naming the first layer DP-SGD cannot train, and the fix where Opacus has one."""
    # Imported here, not at the top: Opacus costs a process about 1.4 s of CPU to load, which parties
    # that never train (a tallier, a voting server) skip.
    from opacus.validators import ModuleValidator

    for layer_name, layer in core.named_modules():
        # A leaf alone: Opacus's validators would descend into a container's children, each checked on its own.
        errors = ModuleValidator.validate(layer, strict=False) if not list(layer.children()) else []
        if any(p.requires_grad for p in layer.parameters(recurse=False)) and list(layer.buffers(recurse=False)):
            errors = errors or [ValueError("it has trainable parameters and buffers, whose values are not private")]
        if errors:
            replaceable = any(type(error).__name__ == "ShouldReplaceModuleError" for error in errors)
            reason = str(errors[0]).split(". ")[0].rstrip(".")
            hint = (
                "; --fix-model replaces it (Opacus's ModuleValidator.fix, e.g. GroupNorm for BatchNorm)"
                if replaceable and not fixed
                else ""
            )
            raise ModelError(
                f"{name}: layer {layer_name or '(the model)'} ({type(layer).__name__}) cannot be trained with DP-SGD: "
                f"{reason}{hint}"
            )


def _standardize(spec: ModelSpec) -> list[nn.Module]:
    return [_Standardize(spec.input_mean, spec.input_std, len(spec.input_shape))] if spec.input_mean else []


def _built_in_layers(spec: ModelSpec) -> list[nn.Module]:
    if spec.architecture == "resnet18":
        return _resnet18(spec.input_shape[0], spec.num_classes)
    if spec.architecture == "mlp":
        layers: list[nn.Module] = [nn.Flatten()]
        width = int(np.prod(spec.input_shape))
        for hidden in spec.hidden:
            layers += [nn.Linear(width, hidden), nn.Tanh()]
            width = hidden
        return layers + [nn.Linear(width, spec.num_classes)]
    (first, kernel_1, stride_1, padding_1), (second, kernel_2, stride_2, padding_2) = CNN_LAYERS
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
    return [features, nn.Linear(width, 32), nn.Tanh(), nn.Linear(32, spec.num_classes)]


def _resnet18(channels: int, num_classes: int) -> list[nn.Module]:
    """ResNet-18 (He et al., 2016) as for small images, and for DP-SGD: GroupNorm of 32 groups in place of
    BatchNorm (Wu and He, 2018), a 3x3 stem without max-pooling; 11.2M parameters for 10 classes."""
    layers: list[nn.Module] = [nn.Conv2d(channels, 64, 3, padding=1, bias=False), nn.GroupNorm(32, 64), nn.ReLU()]
    width = 64
    for out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_ResidualBlock(width, out, stride), _ResidualBlock(out, out, 1)]
        width = out
    return layers + [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes)]


class _ResidualBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions, each normalised, added to the (projected) input."""

    def __init__(self, channels: int, out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(32, out)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(32, out)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(channels, out, 1, stride=stride, bias=False), nn.GroupNorm(32, out))
            if stride != 1 or channels != out
            else nn.Identity()
        )
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm2(self.conv2(self.act(self.norm1(self.conv1(x))))) + self.shortcut(x))


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
