"""One split of a data set's records, and the error a data source raises.

Apart from ``training.data.datasets`` so that the loaders it dispatches to (``training.data.image_folder``)
build splits without importing it back; elsewhere both are imported from ``training.data.datasets``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from consilium.errors import ConsiliumError

__all__ = ["DatasetError", "Split"]


class DatasetError(ConsiliumError, ValueError):
    """A dataset that cannot be found or read."""


@dataclass(frozen=True)
class Split:
    x: np.ndarray  # float32, (n, *input_shape)
    y: np.ndarray  # int64, (n,)
    classes: tuple[str, ...] = ()  # the name of each label, where the data name them

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, indices: np.ndarray) -> "Split":
        return Split(self.x[indices], self.y[indices], self.classes)

    def misfit(self, input_shape: tuple[int, ...], num_classes: int, classes: tuple[str, ...] = ()) -> str | None:
        """Why these records cannot train a model of ``input_shape`` inputs and ``num_classes`` classes
        (named ``classes``, where the run names them), if they cannot."""
        shape, top = tuple(self.x.shape[1:]), int(self.y.max(initial=0))
        if shape != tuple(input_shape) or top >= num_classes:
            return (
                f"the run's model takes {tuple(input_shape)} inputs and {num_classes} classes; these records are "
                f"{shape} with labels up to {top}"
            )
        if classes and self.classes and tuple(classes) != self.classes:
            return (
                f"the run's classes are {', '.join(classes)}; these records' are {', '.join(self.classes)} (a class "
                "with no records here still needs its folder, empty)"
            )
        return None
