"""A party's own images on disk: ``train/<class>/*.png`` (or ``.jpg``, ...), and ``val/`` and ``test/`` alike.

Classes are the folder names under ``train/`` (hidden ones left out), in sorted order; a class a
party has no records of still needs its folder, empty, so that every party numbers the classes
alike (``val/`` and ``test/`` may leave classes out, not add them). Every image is read with
Pillow, made ``channels`` deep (1: grayscale, 3: RGB; by default 3 if any image has colour, else
1), resized to ``size`` (height, width) where given, and scaled to [0, 1] by its own depth: 8-bit
images by 255, 16-bit ones (common in medical imaging) by 65535. Float and 32-bit images are
refused rather than guessed at. Without ``size`` every image must have the same size. Standardising
the inputs is the model's (``training.models.build``), with the server's statistics.

Images are checked from their headers first (mode and size, nothing decoded), then decoded one at a
time into the split's array, so that memory holds the result and one image. A file that is not a
readable image is an error naming it, not a record lost.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from consilium.training.data.splits import DatasetError, Split

__all__ = ["IMAGE_SUFFIXES", "load_image_folder"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff")
_MAX_IMAGES = 1 << 20
_MAX_CLASS_NAME = 128
_GRAY_MODES = {"1": 255, "L": 255, "LA": 255, "I;16": 65535, "I;16B": 65535, "I;16L": 65535, "I;16N": 65535}
_REFUSED_MODES = ("I", "F")  # 32-bit integers and floats: no depth to scale by


def load_image_folder(root: Path, *, size: tuple[int, int] | None, channels: int | None) -> dict:
    """The folder's splits as ``{"name": ..., "train": Split, "val": Split, "test": Split}`` (those present)."""
    if not (root / "train").is_dir():
        raise DatasetError(
            f"{root} has no train/ folder: an image folder is train/<class>/*.png, with optional val/ and test/"
        )
    classes = _classes(root / "train")
    files = {name: _files(root / name, classes) for name in ("train", "val", "test") if (root / name).is_dir()}
    if channels is not None and channels not in (1, 3):
        raise DatasetError(f"images are 1 (grayscale) or 3 (RGB) channels deep, not {channels}")
    headers = {path: _header(path) for pairs in files.values() for path, _ in pairs}
    if channels is None:
        channels = 3 if any(mode not in _GRAY_MODES for mode, _ in headers.values()) else 1
    if size is None:
        sizes = {image_size: path for path, (_, image_size) in headers.items()}
        if len(sizes) > 1:
            (first, a), (second, b) = list(sizes.items())[:2]
            raise DatasetError(
                f"images of different sizes in {root} ({a} is {first[0]}x{first[1]}, {b} is {second[0]}x{second[1]}): "
                "give --image-size to resize them all"
            )
        width, height = next(iter(sizes), (1, 1))
        size = (height, width)
    splits: dict = {"name": root.name}
    for name, pairs in files.items():
        if not pairs and name != "train":
            raise DatasetError(f"{root / name} holds no images")
        x = np.empty((len(pairs), channels, *size), dtype=np.float32)
        for index, (path, _) in enumerate(pairs):
            x[index] = _pixels(path, channels, size)
        splits[name] = Split(x, np.array([label for _, label in pairs], dtype=np.int64), classes)
    return splits


def _classes(train: Path) -> tuple[str, ...]:
    classes = tuple(sorted(d.name for d in train.iterdir() if d.is_dir() and not d.name.startswith(".")))
    if len(classes) < 2:
        raise DatasetError(f"{train} needs a folder for each of at least 2 classes, found {len(classes)}")
    for name in classes:
        if len(name) > _MAX_CLASS_NAME or not name.isprintable():
            raise DatasetError(
                f"the class folder {train / name!r} needs a printable name of at most {_MAX_CLASS_NAME} characters"
            )
    return classes


def _files(folder: Path, classes: tuple[str, ...]) -> list[tuple[Path, int]]:
    """Each image file under ``folder/<class>/`` with its class's index; a class folder ``train/`` lacks is refused."""
    unknown = sorted(
        d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name not in classes
    )
    if unknown:
        raise DatasetError(f"{folder} has classes train/ does not: {', '.join(unknown)}")
    pairs = []
    for index, name in enumerate(classes):
        if (folder / name).is_dir():
            pairs += [
                (path, index)
                for path in sorted((folder / name).iterdir())
                if path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith(".") and path.is_file()
            ]  # regular files only: a pipe named *.png would block the read
        if len(pairs) > _MAX_IMAGES:
            raise DatasetError(f"{folder} holds more than {_MAX_IMAGES:,} images")
    return pairs


def _header(path: Path) -> tuple[str, tuple[int, int]]:
    """An image's mode and (width, height), read from its header alone."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            mode, image_size = image.mode, image.size
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise DatasetError(f"cannot read the image {path}: {error}") from None
    if mode in _REFUSED_MODES:
        raise DatasetError(f"the image {path} is {mode} (32-bit or float): save it as an 8- or 16-bit image")
    return mode, image_size


def _pixels(path: Path, channels: int, size: tuple[int, int]) -> np.ndarray:
    """One image as a (channels, height, width) float32 array in [0, 1]."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            depth = _GRAY_MODES.get(image.mode, 255)
            if depth == 65535:  # 16 bits, grayscale: kept whole as 32-bit integers, not clipped to 8
                image = image.convert("I")
            else:
                image = image.convert("L" if channels == 1 else "RGB")
            if image.size != (size[1], size[0]):
                image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
            array = np.asarray(image, dtype=np.float32) / depth
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise DatasetError(f"cannot read the image {path}: {error}") from None
    if array.ndim == 2:
        return np.broadcast_to(array, (channels, *array.shape))
    return np.transpose(array, (2, 0, 1))
