"""Datasets: built-in real ones that work offline, and ``.npz`` files given by path.

- ``breast_cancer``: scikit-learn's Wisconsin diagnostic breast cancer, 569 patients, 30 features,
  2 classes. ``digits``: scikit-learn's 1797 8x8 handwritten digits, 64 features, 10 classes.
  Both are split 80/20 into train and validation, stratified, by ``split_seed``; every party of a
  federation must use the same seed so that the hospitals' data and the server's validation set
  are disjoint.
- MedMNIST format (``train_images``, ``train_labels``, ``val_images``, ``val_labels``, and
  ``test_images``, ``test_labels`` when present) and Keras MNIST format (``x_train``, ``y_train``,
  ``x_test``, ``y_test``; the test split serves as validation, so there is no separate test
  split). Images become float32 in [0, 1], shaped (channels, height, width).

Models are selected on ``validation``; ``test``, where a dataset has one, is for the final report
only (MedMNIST's protocol).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["BUILTIN_DATASETS", "Dataset", "DatasetError", "Split", "load_dataset"]

BUILTIN_DATASETS = ("breast_cancer", "digits")
_VALIDATION_FRACTION = 0.2


class DatasetError(ValueError):
    """A dataset that cannot be found or read."""


@dataclass(frozen=True)
class Split:
    x: np.ndarray  # float32, (n, *input_shape)
    y: np.ndarray  # int64, (n,)

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, indices: np.ndarray) -> "Split":
        return Split(self.x[indices], self.y[indices])


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


def load_dataset(source: str, *, split_seed: int = 0) -> Dataset:
    """A built-in dataset by name, or a MedMNIST- or Keras-format ``.npz`` file by path."""
    if source in BUILTIN_DATASETS:
        return _load_builtin(source, split_seed)
    return _load_npz(Path(source))


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
