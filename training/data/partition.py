"""Splitting one labelled dataset among hospitals, to simulate a federation.

- ``iid``: a uniform random split into near-equal parts.
- ``label_skew``: each part sees only ``classes_per_part`` classes (the voting paper gives each of
  100 agents 6 of the 10 digits, in varied combinations). Part by part, each takes the classes
  the fewest parts have so far, ties broken at random: every class is as widely held as any other
  (MNIST, 100 parts of 6: 75 to 83 distinct sets for seeds 0 to 2). Each class's examples are shared evenly among its parts.
- ``dirichlet``: each class is shared among the parts in proportions drawn from
  ``Dirichlet(alpha, ..., alpha)``; smaller ``alpha`` is more skewed.

Every part is non-empty and the parts are disjoint; each is returned as sorted indices.
"""

from __future__ import annotations

import numpy as np

from consilium.errors import ConsiliumError

__all__ = ["PARTITION_SCHEMES", "PartitionError", "partition"]

PARTITION_SCHEMES = ("iid", "label_skew", "dirichlet")
_DIRICHLET_ATTEMPTS = 100


class PartitionError(ConsiliumError, ValueError):
    """A partition that cannot be made as asked."""


def partition(
    labels: np.ndarray,
    num_parts: int,
    scheme: str = "iid",
    *,
    seed: int = 0,
    classes_per_part: int | None = None,
    alpha: float = 0.5,
) -> list[np.ndarray]:
    labels = np.asarray(labels)
    if num_parts < 1:
        raise PartitionError(f"num_parts must be at least 1, got {num_parts}")
    if len(labels) < num_parts:
        raise PartitionError(f"cannot split {len(labels)} examples into {num_parts} non-empty parts")
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = np.array_split(rng.permutation(len(labels)), num_parts)
    elif scheme == "label_skew":
        parts = _label_skew(labels, num_parts, classes_per_part, rng)
    elif scheme == "dirichlet":
        parts = _dirichlet(labels, num_parts, alpha, rng)
    else:
        raise PartitionError(f"unknown partition scheme {scheme!r}; choose from {', '.join(PARTITION_SCHEMES)}")
    return [np.sort(part) for part in parts]


def _label_skew(labels: np.ndarray, num_parts: int, classes_per_part: int | None, rng) -> list[np.ndarray]:
    classes = np.unique(labels)
    if classes_per_part is None or not 1 <= classes_per_part <= len(classes):
        raise PartitionError(f"label_skew needs classes_per_part between 1 and {len(classes)}")
    owners: dict[int, list[int]] = {int(c): [] for c in classes}
    for part in range(num_parts):
        tie_breaks = rng.random(len(classes))
        fewest_first = sorted(owners, key=lambda c: (len(owners[c]), tie_breaks[np.searchsorted(classes, c)]))
        for label in fewest_first[:classes_per_part]:
            owners[label].append(part)
    unowned = [c for c, parts in owners.items() if not parts]
    if unowned:
        raise PartitionError(f"{num_parts} parts of {classes_per_part} classes leave classes {unowned} to no one")
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_parts)]
    for label, parts in owners.items():
        members = rng.permutation(np.flatnonzero(labels == label))
        for part, share in zip(parts, np.array_split(members, len(parts))):
            pieces[part].append(share)
    result = [np.concatenate(p) for p in pieces]
    if any(len(p) == 0 for p in result):
        raise PartitionError("some parts would be empty; use fewer parts or more classes per part")
    return result


def _dirichlet(labels: np.ndarray, num_parts: int, alpha: float, rng) -> list[np.ndarray]:
    if not alpha > 0:
        raise PartitionError(f"alpha must be positive, got {alpha}")
    for _ in range(_DIRICHLET_ATTEMPTS):
        pieces: list[list[np.ndarray]] = [[] for _ in range(num_parts)]
        for label in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == label))
            cuts = (np.cumsum(rng.dirichlet([alpha] * num_parts))[:-1] * len(members)).astype(int)
            for part, share in enumerate(np.split(members, cuts)):
                pieces[part].append(share)
        result = [np.concatenate(p) for p in pieces]
        if all(len(p) > 0 for p in result):
            return result
    raise PartitionError(
        f"Dirichlet(alpha={alpha}) left a part empty in {_DIRICHLET_ATTEMPTS} draws; raise alpha or use fewer parts"
    )
