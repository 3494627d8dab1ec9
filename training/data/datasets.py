"""Datasets: built-in real ones that work offline, and a party's own, given by path or as code.

- ``breast_cancer``: scikit-learn's Wisconsin diagnostic breast cancer, 569 patients, 30 features,
  2 classes. ``digits``: scikit-learn's 1797 8x8 handwritten digits, 64 features, 10 classes.
  Both are split 80/20 into train and validation, stratified, by ``split_seed``; every party of a
  federation must use the same seed so that the hospitals' data and the server's validation set
  are disjoint.
- MedMNIST format (``train_images``, ``train_labels``, ``val_images``, ``val_labels``, and
  ``test_images``, ``test_labels`` when present) and Keras MNIST format (``x_train``, ``y_train``,
  ``x_test``, ``y_test``; the test split serves as validation, so there is no separate test
  split). Images become float32 in [0, 1], shaped (channels, height, width).
- An image folder (``training.data.image_folder``): ``train/<class>/*.png`` (or ``.jpg``, ...), and
  ``val/`` and ``test/`` alike where present; classes are named by their folders.
- A function of the party's own code, ``package.module:function`` or ``path/to/file.py:function``
  (``training.models.own_code``), called with no arguments, returning a mapping of ``train`` (required),
  ``val`` and ``test`` to ``(x, y)`` arrays or ``torch.utils.data.Dataset``s of ``(x, y)`` items,
  and optionally ``classes``, the classes' names. Images as ``uint8`` arrays are read as above;
  other ``x`` as float32, as they are.

Where a party's own data has no validation split, ``hold_out`` decides: a fifth of ``train`` is held
out by ``split_seed`` (what a server, or a simulation on shared data, needs), or every record is for
training (what a hospital with its own data needs) and the validation split is empty. Class names,
where the data have them, travel with the model (``training.models.build.ModelSpec``), so that a
hospital whose classes differ from the run's is refused instead of training on shifted labels.

Models are selected on ``validation``; ``test``, where a dataset has one, is for the final report
only (MedMNIST's protocol).
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from consilium.training.data.image_folder import load_image_folder
from consilium.training.models.own_code import is_reference, load_function, reference_name
from consilium.training.data.splits import DatasetError, Split

__all__ = ["BUILTIN_DATASETS", "Dataset", "DatasetError", "Split", "load_dataset"]

BUILTIN_DATASETS = ("breast_cancer", "digits")
_MAX_CLASSES = 1 << 16  # as a model's (training.models.build)
_VALIDATION_FRACTION = 0.2


@dataclass(frozen=True)
class Dataset:
    name: str
    train: Split
    validation: Split
    num_classes: int
    test: Split | None = None  # held out from every choice made during training

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train.x.shape[1:])

    @property
    def classes(self) -> tuple[str, ...]:
        return self.train.classes


def load_dataset(
    source: str,
    *,
    split_seed: int = 0,
    hold_out: bool = True,
    image_size: tuple[int, int] | None = None,
    image_channels: int | None = None,
) -> Dataset:
    """A built-in dataset by name; a MedMNIST- or Keras-format ``.npz`` file or an image folder by path (resized
    to ``image_size`` and made ``image_channels`` deep where given); or a data function of one's own code."""
    if source in BUILTIN_DATASETS:
        return _load_builtin(source, split_seed)
    if is_reference(source) and not Path(source).exists():
        return _load_function(source, split_seed, hold_out)
    path = Path(source)
    if path.is_dir():
        return _with_validation(load_image_folder(path, size=image_size, channels=image_channels), split_seed, hold_out)
    return _load_npz(path)


def _load_builtin(name: str, split_seed: int) -> Dataset:
    from sklearn.datasets import load_breast_cancer, load_digits
    from sklearn.model_selection import train_test_split

    if name == "breast_cancer":
        x, y = load_breast_cancer(return_X_y=True)
    else:
        x, y = load_digits(return_X_y=True)
        x = x / 16.0
    x_train, x_val, y_train, y_val = train_test_split(
        x, y, test_size=_VALIDATION_FRACTION, stratify=y, random_state=split_seed
    )
    return Dataset(
        name=name,
        train=_split(x_train, y_train),
        validation=_split(x_val, y_val),
        num_classes=int(np.max(y)) + 1,
    )


def _load_npz(path: Path) -> Dataset:
    if not path.is_file():
        raise DatasetError(f"no dataset file at {path} (built-in datasets: {', '.join(BUILTIN_DATASETS)})")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise DatasetError(f"cannot read {path} as an .npz archive: {error}") from None
    test = None
    if {"train_images", "train_labels", "val_images", "val_labels"} <= arrays.keys():
        train = _image_split(arrays["train_images"], arrays["train_labels"], path)
        validation = _image_split(arrays["val_images"], arrays["val_labels"], path)
        if {"test_images", "test_labels"} <= arrays.keys():
            test = _image_split(arrays["test_images"], arrays["test_labels"], path)
    elif {"x_train", "y_train", "x_test", "y_test"} <= arrays.keys():
        train = _image_split(arrays["x_train"], arrays["y_train"], path)
        validation = _image_split(arrays["x_test"], arrays["y_test"], path)
    else:
        raise DatasetError(
            f"{path} is neither MedMNIST format (train_images, train_labels, val_images, val_labels) "
            f"nor Keras MNIST format (x_train, y_train, x_test, y_test); it has {sorted(arrays)}"
        )
    num_classes = int(max(split.y.max() for split in (train, validation, test) if split is not None)) + 1
    return Dataset(name=path.stem, train=train, validation=validation, num_classes=num_classes, test=test)


def _image_split(images: np.ndarray, labels: np.ndarray, path: Path) -> Split:
    labels = np.asarray(labels).reshape(-1)
    if images.ndim == 3:
        images = images[:, None, :, :]
    elif images.ndim == 4 and images.shape[-1] in (1, 3):
        images = np.transpose(images, (0, 3, 1, 2))
    else:
        raise DatasetError(f"{path}: images of shape {images.shape} are not (n, h, w) or (n, h, w, channels)")
    if len(images) != len(labels):
        raise DatasetError(f"{path}: {len(images)} images but {len(labels)} labels")
    if len(labels) == 0 or labels.min() < 0:
        raise DatasetError(f"{path}: labels must be non-negative class indices")
    scale = 255.0 if images.dtype == np.uint8 else 1.0
    return Split(x=(images / scale).astype(np.float32), y=labels.astype(np.int64))


def _split(x: np.ndarray, y: np.ndarray) -> Split:
    return Split(x=np.asarray(x, dtype=np.float32), y=np.asarray(y, dtype=np.int64))


def _with_validation(splits: dict[str, Split], split_seed: int, hold_out: bool) -> Dataset:
    """A dataset of the splits a party's own data gave (``name``, ``train``, maybe ``val`` and ``test``)."""
    name, train = splits.pop("name"), splits["train"]
    if len(train) == 0:
        raise DatasetError(f"{name}: the train split is empty")
    validation = splits.get("val")
    validation = validation if validation is not None and len(validation) else None  # an empty one: none
    if validation is None and hold_out:
        from sklearn.model_selection import train_test_split

        counts = np.bincount(train.y)
        stratify = train.y if counts[counts > 0].min() >= 2 else None
        if len(train) < 2:
            raise DatasetError(f"{name}: one training record cannot be split into train and validation")
        kept, held = train_test_split(
            np.arange(len(train)), test_size=_VALIDATION_FRACTION, stratify=stratify, random_state=split_seed
        )
        train, validation = train.subset(np.sort(kept)), train.subset(np.sort(held))
    elif validation is None:
        validation = Split(train.x[:0], train.y[:0], train.classes)
    for split_name, split in (("val", validation), ("test", splits.get("test"))):
        if split is not None and split.x.shape[1:] != train.x.shape[1:]:
            raise DatasetError(f"{name}: {split_name} records are {split.x.shape[1:]}, train's {train.x.shape[1:]}")
        if split is not None and split_name == "test" and len(split) == 0:
            raise DatasetError(f"{name}: the test split is empty")
    classes = (
        len(train.classes)
        or int(max(s.y.max(initial=0) for s in (train, validation, splits.get("test")) if s is not None)) + 1
    )
    return Dataset(name=name, train=train, validation=validation, num_classes=classes, test=splits.get("test"))


def _load_function(reference: str, split_seed: int, hold_out: bool) -> Dataset:
    """The splits a data function of the party's own code returns (see the module's docstring)."""
    name = reference_name(reference, flag="--data", error=DatasetError)
    function = load_function(reference, flag="--data", error=DatasetError)
    try:
        returned = function()
    except Exception as error:  # the operator's own code: its failure is theirs to fix, in one line
        raise DatasetError(f"the data function {name} failed: {type(error).__name__}: {error}") from None
    if not isinstance(returned, Mapping) or "train" not in returned:
        raise DatasetError(f"the data function {name} must return a mapping with train (and val, test, classes)")
    unknown = set(returned) - {"train", "val", "test", "classes"}
    if unknown:
        raise DatasetError(f"the data function {name} returned unknown keys {sorted(unknown)}")
    classes = tuple(str(c) for c in returned.get("classes", ()))
    if not all(0 < len(c) <= 128 and c.isprintable() for c in classes) or len(classes) > _MAX_CLASSES:
        raise DatasetError(f"the data function {name}'s classes need printable names of at most 128 characters")
    splits = {"name": name}
    for split_name in ("train", "val", "test"):
        if split_name in returned:
            split = _function_split(returned[split_name], f"{name} {split_name}")
            if classes and split.y.max(initial=0) >= len(classes):
                raise DatasetError(f"{name} {split_name}: labels up to {split.y.max()}, but {len(classes)} classes")
            splits[split_name] = replace(split, classes=classes)
    return _with_validation(splits, split_seed, hold_out)


def _function_split(value, what: str) -> Split:
    """``(x, y)`` arrays, or a torch ``Dataset`` of ``(x, y)`` items, as a split; ``DatasetError`` naming what is off."""
    try:
        if isinstance(value, (tuple, list)) and len(value) == 2:
            x, y = (np.asarray(v) for v in value)
        else:
            items = [value[i] for i in range(len(value))]
            x = np.stack([np.asarray(item[0]) for item in items])
            y = np.array([int(item[1]) for item in items])
    except Exception as error:  # ragged records, not a sequence of (x, y) pairs: the operator's data, in one line
        raise DatasetError(f"{what}: expected (x, y) arrays or a Dataset of (x, y) items: {error}") from None
    if not 2 <= x.ndim <= 4:
        raise DatasetError(f"{what}: records of shape {x.shape[1:]}: expected features, or images")
    if y.ndim != 1 and y.size != len(y) or not np.issubdtype(y.dtype, np.integer) or len(x) != y.size:
        raise DatasetError(f"{what}: expected one integer label a record, as many as the records")
    y = y.reshape(-1)
    if len(y) and (y.min() < 0 or y.max() >= _MAX_CLASSES):
        raise DatasetError(f"{what}: labels are class indices from 0 to {_MAX_CLASSES - 1}")
    if x.dtype == np.uint8:
        return _image_split(x, y, Path(what))
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        raise DatasetError(f"{what}: records must be real numbers, not {x.dtype}")
    x = x.astype(np.float32)
    if not np.all(np.isfinite(x)):
        raise DatasetError(f"{what}: records must be finite float32 numbers")
    return _split(x, y)
