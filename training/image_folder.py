"""A party's own images on disk: ``train/<class>/*.png`` (or ``.jpg``, ...), and ``val/`` and ``test/`` alike.

Classes are the folder names under ``train/``, in sorted order; a class a party has no records of
still needs its folder, empty, so that every party numbers the classes alike (``val/`` and
``test/`` may leave classes out, not add them). Every image is read with Pillow, made
``channels`` deep (1: grayscale, 3: RGB; by default 3 if any image has colour, else 1), resized to
``size`` (height, width) where given, and scaled to [0, 1]; without ``size``, every image must
have the same size. Standardising the inputs is the model's (``training.models``), with the
server's statistics. A file that is not a readable image is an error naming it, not a record lost.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from training.datasets import DatasetError, Split

__all__ = ["IMAGE_SUFFIXES", "load_image_folder"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff")
_MAX_IMAGES = 1 << 20
_COLOUR_MODES = {1: "L", 3: "RGB"}


def load_image_folder(root: Path, *, size: tuple[int, int] | None, channels: int | None) -> dict:
    """The folder's splits as ``{"name": ..., "train": Split, "val": Split, "test": Split}`` (those present)."""
    if not (root / "train").is_dir():
        raise DatasetError(
            f"{root} has no train/ folder: an image folder is train/<class>/*.png, with optional val/ and test/"
        )
    classes = tuple(sorted(folder.name for folder in (root / "train").iterdir() if folder.is_dir()))
    if len(classes) < 2:
        raise DatasetError(f"{root / 'train'} needs a folder for each of at least 2 classes, found {len(classes)}")
    files = {name: _files(root / name, classes) for name in ("train", "val", "test") if (root / name).is_dir()}
    if channels is not None and channels not in _COLOUR_MODES:
        raise DatasetError(f"images are 1 (grayscale) or 3 (RGB) channels deep, not {channels}")
    images = {name: [_open(path) for path, _ in pairs] for name, pairs in files.items()}
    if channels is None:
        channels = (
            3
            if any(image.mode not in ("1", "L", "LA", "I", "I;16", "F") for i in images.values() for image in i)
            else 1
        )
    if size is None:
        sizes = {image.size: path for name, pairs in files.items() for (path, _), image in zip(pairs, images[name])}
        if len(sizes) > 1:
            (first, a), (second, b) = list(sizes.items())[:2]
            raise DatasetError(
                f"images of different sizes in {root} ({a} is {first[0]}x{first[1]}, {b} is {second[0]}x{second[1]}): "
                "give --image-size to resize them all"
            )
    splits: dict = {"name": root.name}
    for name, pairs in files.items():
        if not pairs and name != "train":
            raise DatasetError(f"{root / name} holds no images")
        arrays = [_array(image, channels, size) for image in images[name]]
        x = np.stack(arrays).astype(np.float32) / 255.0 if arrays else np.zeros((0, channels, 1, 1), np.float32)
        splits[name] = Split(x, np.array([label for _, label in pairs], dtype=np.int64), classes)
    return splits


def _files(folder: Path, classes: tuple[str, ...]) -> list[tuple[Path, int]]:
    """Each image file under ``folder/<class>/`` with its class's index; a class folder ``train/`` lacks is refused."""
    unknown = sorted(d.name for d in folder.iterdir() if d.is_dir() and d.name not in classes)
    if unknown:
        raise DatasetError(f"{folder} has classes train/ does not: {', '.join(unknown)}")
    pairs = []
    for index, name in enumerate(classes):
        if (folder / name).is_dir():
            pairs += [
                (path, index) for path in sorted((folder / name).iterdir()) if path.suffix.lower() in IMAGE_SUFFIXES
            ]
        if len(pairs) > _MAX_IMAGES:
            raise DatasetError(f"{folder} holds more than {_MAX_IMAGES:,} images")
    return pairs


def _open(path: Path):
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
            return image.copy()
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise DatasetError(f"cannot read the image {path}: {error}") from None


def _array(image, channels: int, size: tuple[int, int] | None) -> np.ndarray:
    from PIL import Image

    image = image.convert(_COLOUR_MODES[channels])
    if size is not None and image.size != (size[1], size[0]):
        image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    array = np.asarray(image, dtype=np.uint8)
    return array[None] if channels == 1 else np.transpose(array, (2, 0, 1))
