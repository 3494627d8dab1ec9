"""What a model is, as a run configuration carries it: ``ModelSpec``, checked before anything is built.

Kept apart from ``build`` (which turns a spec into a torch module) so that a party that only reads a
run's configuration (a tallier) loads no torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from consilium.training.models.own_code import check_name, is_reference

__all__ = ["BUILT_IN_MODELS", "MAX_PARAMETERS", "ModelSpec", "takes_images"]

BUILT_IN_MODELS = ("mlp", "cnn", "resnet18")
# What a spec that arrives from elsewhere (a run configuration) may ask for, checked before any
# tensor is allocated: a hospital builds the model a server names.
MAX_WIDTH = 1 << 16  # of an input dimension, a hidden layer, the classes
MAX_INPUT_VALUES = 1 << 24
MAX_HIDDEN_LAYERS = 16
MAX_PARAMETERS = 1 << 26
CNN_LAYERS = ((16, 8, 2, 3), (32, 4, 2, 0))  # (channels, kernel, stride, padding), each followed by MaxPool2d(2, 1)
_DIGEST = re.compile(r"[0-9a-f]{64}")
_MAX_CLASS_NAME = 128


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    input_shape: tuple[int, ...]
    num_classes: int
    hidden: tuple[int, ...] = (48,)  # hidden widths of the MLP
    input_mean: tuple[float, ...] = ()  # per feature (vectors) or per channel (images); () for none
    input_std: tuple[float, ...] = ()
    digest: str = ""  # model_digest of what it builds; required of the operators' own models
    parameters: int = 0  # an own model's parameter count (a built-in one's is computed)
    fix: bool = False  # an own model with Opacus's fixes applied (GroupNorm for BatchNorm)
    classes: tuple[str, ...] = ()  # each output's class name, where the data name them

    def __post_init__(self) -> None:
        if self.architecture not in BUILT_IN_MODELS:
            if not is_reference(self.architecture):
                raise ValueError(
                    f"unknown model {self.architecture[:64]!r}; choose from {', '.join(BUILT_IN_MODELS)}, "
                    "or name your own as package.module:function or path/to/file.py:function"
                )
            check_name(self.architecture, error=ValueError)
            if not 1 <= self.parameters <= MAX_PARAMETERS or not _DIGEST.fullmatch(self.digest):
                raise ValueError(f"the model {self.architecture} needs its digest and a parameter count")
        elif self.parameters or self.fix:
            raise ValueError(f"the built-in model {self.architecture} takes no parameter count and no fixes")
        if self.digest and not _DIGEST.fullmatch(self.digest):
            raise ValueError("a model digest is 64 hexadecimal digits")
        if self.classes and (
            len(self.classes) != self.num_classes
            or not all(isinstance(c, str) and 0 < len(c) <= _MAX_CLASS_NAME and c.isprintable() for c in self.classes)
        ):
            raise ValueError(
                f"a model of {self.num_classes} classes names each in at most {_MAX_CLASS_NAME} characters"
            )
        if not 1 <= len(self.input_shape) <= 3 or not all(1 <= v <= MAX_WIDTH for v in self.input_shape):
            raise ValueError(f"an input shape has 1 to 3 dimensions of 1 to {MAX_WIDTH}, got {self.input_shape}")
        if math.prod(self.input_shape) > MAX_INPUT_VALUES:
            raise ValueError(f"an input of shape {self.input_shape} holds more than {MAX_INPUT_VALUES:,} values")
        if self.architecture in ("cnn", "resnet18") and not self.takes_images:
            shown = {"cnn": "CNN", "resnet18": "ResNet-18"}[self.architecture]
            raise ValueError(f"the {shown} needs (channels, height, width) inputs, got shape {self.input_shape}")
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
        if self.architecture not in BUILT_IN_MODELS:
            return self.parameters
        if self.architecture == "mlp":
            widths = (math.prod(self.input_shape), *self.hidden, self.num_classes)
            return sum(n_in * n_out + n_out for n_in, n_out in zip(widths, widths[1:]))
        if self.architecture == "resnet18":
            return _resnet18_parameters(self.input_shape[0], self.num_classes)
        channels, height, width = self.input_shape
        count = 0
        for out_channels, kernel, stride, padding in CNN_LAYERS:
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

    @property
    def own_code(self) -> bool:
        """Whether the model is a function of the operators' own code, not a built-in one."""
        return self.architecture not in BUILT_IN_MODELS

    def to_dict(self) -> dict:
        values = asdict(self)
        for name, empty in (("digest", ""), ("parameters", 0), ("fix", False), ("classes", ())):  # as specs were before
            if values[name] == empty:
                del values[name]
        return values

    @classmethod
    def from_dict(cls, fields: dict) -> "ModelSpec":
        lengths = {
            "input_shape": 3,
            "hidden": MAX_HIDDEN_LAYERS,
            "input_mean": MAX_WIDTH,
            "input_std": MAX_WIDTH,
            "classes": MAX_WIDTH,
        }
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
                digest=str(fields.get("digest", "")),
                parameters=int(fields.get("parameters", 0)),
                fix=_boolean(fields.get("fix", False)),
                classes=tuple(fields.get("classes", ())),
            )
        except (KeyError, TypeError, OverflowError) as error:
            raise ValueError(f"malformed model spec: {error}") from None


def takes_images(input_shape: tuple[int, ...]) -> bool:
    """Whether inputs of this shape are (channels, height, width) images."""
    return len(input_shape) == 3


def _resnet18_parameters(channels: int, num_classes: int) -> int:
    """The parameters of ``build``'s ResNet-18, counted layer by layer as it builds them (a test compares)."""
    count = 64 * channels * 9 + 2 * 64  # the 3x3 stem and its GroupNorm
    width = 64
    for out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block_in, block_stride in ((width, stride), (out, 1)):
            count += block_in * out * 9 + out * out * 9 + 4 * out  # two 3x3 convolutions, two GroupNorms
            if block_stride != 1 or block_in != out:
                count += block_in * out + 2 * out  # the projected shortcut and its GroupNorm
        width = out
    return count + width * num_classes + num_classes


def _boolean(value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"fix must be true or false, got {value!r}")
    return value
