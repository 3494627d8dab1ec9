"""A hospital's votes on the server's public queries, and its noisy vote vector.

- **AE-DPFL** (the voting paper's Algorithm 1): the hospital trains a teacher on its own records
  (``train_classifier``, without DP: the privacy comes from the noise on the votes) and votes the
  teacher's prediction, one-hot, on each query, or abstains where the teacher is unsure.
- **kNN-DPFL** (Algorithm 2): the hospital votes the label counts of the ``k`` records nearest to
  each query in a feature space ``phi`` that no private record shapes. ``PcaFeatures`` is the
  default ``phi``: a PCA fit on the public pool. Any callable from inputs to feature rows that
  computes each row alone can take its place. Distances are exact, and ties go to the record
  listed first, a fixed order: what the record-level sensitivity in ``training.voting.vote_privacy``
  needs.

``noise_share`` draws the hospital's Skellam share of a round's noise as a pool, which it sends beside its
votes, from a ChaCha20 generator keyed by the OS (``training.privacy.secure_random``).
``train_student`` is the server's side: a model on the labelled queries and the rest of the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from consilium.training.data.datasets import Split
from consilium.training.models.build import build_model
from consilium.training.models.spec import ModelSpec
from consilium.training.privacy.secure_random import require_cryptographic
from consilium.training.privacy.skellam import SkellamMechanism
from consilium.training.voting.vote_privacy import MAX_FEATURE_DIMENSIONS, NoisePool

__all__ = [
    "FeatureMap",
    "PcaFeatures",
    "knn_votes",
    "noise_share",
    "split_public_pool",
    "teacher_votes",
    "train_classifier",
    "train_student",
]

FeatureMap = Callable[[np.ndarray], np.ndarray]
_TEACHER_BATCH = 64
_CONSTANT_LEARNING_RATE = 1e-3  # Adam's default
_PEAK_LEARNING_RATE = 3e-3  # of a one-cycle schedule
_MIN_CYCLE_STEPS = 20
_PSEUDO_LABEL_CONFIDENCE = 0.8
_PSEUDO_LABEL_ROUNDS = 5
_JITTER_SHIFT = 0.07
_JITTER_RADIANS = math.radians(10)
_JITTER_SCALE = 0.1
# Exact kNN (``_on_grid``, ``PcaFeatures.__call__``): bounds and grids under which float64 and int64 are exact.
_FEATURE_BOUND = 2.0**8
_GRID_STEPS_PER_UNIT = 2.0**12
_INPUT_STEPS_PER_UNIT = 2.0**12
_WEIGHT_STEPS_PER_UNIT = 2.0**16
_MAX_PCA_INPUTS = 2**17
_QUERY_CHUNK = 256
_MAX_NOISE_DRAWS = 8  # each misses with probability below 2^-39: eight misses mean the bounds are wrong


def split_public_pool(records: Split, fraction: float, *, seed: int) -> tuple[Split, Split]:
    """``(public pool, test)``: a random ``fraction`` of ``records`` for the server to label, the rest to test on.

    As in the voting paper, which takes 30% of the MNIST test set as the public pool. Which records
    are public is no secret, so a seed may fix the split."""
    if not 0 < fraction < 1:
        raise ValueError(f"the public pool's fraction must be in (0, 1), got {fraction}")
    order = np.random.default_rng(seed).permutation(len(records))
    cut = round(fraction * len(records))
    return records.subset(np.sort(order[:cut])), records.subset(np.sort(order[cut:]))


def train_classifier(
    spec: ModelSpec,
    data: Split,
    *,
    epochs: int,
    seed: int | None = None,
    jitter: bool = False,
    one_cycle: bool = False,
) -> nn.Module:
    """A model trained on ``data`` with Adam, ``epochs`` passes in shuffled batches of 64: a
    hospital's teacher, or the server's student on the labelled queries. With ``jitter`` (images
    only) every batch is seen through a fresh random small affine map (``_jittered``).

    Adam's rate is constant, or with ``one_cycle`` follows one cycle (Smith and Topin, 2019;
    ``torch``'s ``OneCycleLR``): up to ``_PEAK_LEARNING_RATE`` over the first 30% of the steps,
    then down to almost nothing, while Adam's first beta moves the other way. A cycle of fewer than
    ``_MIN_CYCLE_STEPS`` steps would spend most of them far from its peak, so such a short
    training keeps the constant rate.

    Its initialisation, shuffling and jitter protect nothing (the noise on the votes does), so a seed
    may fix them for reproducible runs; without one they are drawn afresh."""
    if len(data) == 0:
        raise ValueError("a model needs at least one record to train on")
    if jitter and not spec.takes_images:
        raise ValueError(f"jitter moves images of (channels, height, width), not inputs of shape {spec.input_shape}")
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    model = build_model(spec, seed=seed)  # a seed fixes this model's initialisation, not the process's later draws
    optimizer = torch.optim.Adam(model.parameters(), lr=_CONSTANT_LEARNING_RATE)
    x, y = torch.as_tensor(data.x), torch.as_tensor(data.y)
    steps = epochs * math.ceil(len(y) / _TEACHER_BATCH)
    schedule = (
        torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=_PEAK_LEARNING_RATE, total_steps=steps)
        if one_cycle and steps >= _MIN_CYCLE_STEPS
        else None
    )
    model.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=generator).split(_TEACHER_BATCH):
            optimizer.zero_grad()
            inputs = _jittered(x[batch], generator) if jitter else x[batch]
            nn.functional.cross_entropy(model(inputs), y[batch]).backward()
            optimizer.step()
            if schedule is not None:
                schedule.step()
    model.eval()
    return model


def train_student(spec: ModelSpec, labelled: Split, unlabelled: np.ndarray, *, epochs: int) -> nn.Module:
    """The server's student: trained on the labelled queries, then retrained from scratch, five
    times, with its latest predictions of probability at least 0.8 on the rest of the public pool
    as further labels (pseudo-labelling, Lee 2013). Images are jittered, and every training follows
    one cycle of learning rates (``train_classifier``). The schedule, the 0.8 and the five rounds
    scored highest on held-out validation records, on label sets drawn as the MNIST runs draw them
    (docs/how-to/private-voting.md, "How the student was chosen"; ``tests/support/student_choice.py``).

    Only public records and released labels go in, so the student costs no privacy."""
    jitter = spec.takes_images
    student = train_classifier(spec, labelled, epochs=epochs, jitter=jitter, one_cycle=True)
    for _ in range(_PSEUDO_LABEL_ROUNDS if len(unlabelled) else 0):
        with torch.no_grad():
            probabilities = torch.softmax(student(torch.as_tensor(unlabelled)), dim=1)
        confidence, guesses = probabilities.max(dim=1)
        sure = (confidence >= _PSEUDO_LABEL_CONFIDENCE).numpy()
        if not sure.any():
            break
        both = Split(
            np.concatenate([labelled.x, unlabelled[sure]]), np.concatenate([labelled.y, guesses.numpy()[sure]])
        )
        # About twice the first pass's steps: more records, fewer passes over each.
        student = train_classifier(
            spec, both, epochs=max(3, 2 * round(epochs * len(labelled) / len(both))), jitter=jitter, one_cycle=True
        )
    return student


def _jittered(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Each image moved by its own random affine map: shifted up to 7% of its size each way (2 of
    MNIST's 28 pixels), turned up to 10 degrees and scaled by 0.9 to 1.1, borders repeated."""
    count = len(images)

    def uniform(bound: float) -> torch.Tensor:
        return (2 * torch.rand(count, generator=generator) - 1) * bound

    angle, scale = uniform(_JITTER_RADIANS), 1 + uniform(_JITTER_SCALE)
    cos, sin = scale * torch.cos(angle), scale * torch.sin(angle)
    # affine_grid's coordinates run from -1 to 1 across the image: a shift of 2 s is s of its size.
    shift_x, shift_y = uniform(2 * _JITTER_SHIFT), uniform(2 * _JITTER_SHIFT)
    theta = torch.stack([torch.stack([cos, -sin, shift_x], dim=1), torch.stack([sin, cos, shift_y], dim=1)], dim=1)
    grid = nn.functional.affine_grid(theta, list(images.shape), align_corners=False)
    return nn.functional.grid_sample(images, grid, align_corners=False, padding_mode="border")


@torch.no_grad()
def teacher_votes(teacher: nn.Module, queries: np.ndarray, classes: int, *, min_confidence: float = 0.0) -> np.ndarray:
    """One-hot predictions of ``teacher`` on ``queries``: a ``(Q, C)`` integer array. A query whose
    top softmax probability is below ``min_confidence`` gets no vote (a row of zeros).

    Abstaining costs no privacy: a hospital's votes on a query are still one one-hot or none, so
    the sensitivity at both levels is unchanged (``training.voting.vote_privacy``). It keeps teachers that
    never saw a class (the voting paper gives each hospital 6 of 10 digits) from outvoting those that did."""
    teacher.eval()
    probabilities = torch.softmax(teacher(torch.as_tensor(queries)), dim=1)
    confidence, predictions = probabilities.max(dim=1)
    return np.eye(classes, dtype=np.int64)[predictions.numpy()] * (confidence >= min_confidence).numpy()[:, None]


@dataclass(frozen=True)
class PcaFeatures:
    """``phi(x)``: the projection of flattened ``x`` on the top principal components of the public pool."""

    mean: np.ndarray
    components: np.ndarray  # (dimensions, features)

    @classmethod
    def fit(cls, public_pool: np.ndarray, dimensions: int) -> "PcaFeatures":
        flat = public_pool.reshape(len(public_pool), -1).astype(np.float64)
        if not 1 <= dimensions <= min(flat.shape):
            raise ValueError(
                f"PCA on {flat.shape[0]} records of {flat.shape[1]} features cannot keep {dimensions} dimensions"
            )
        mean = flat.mean(axis=0)
        _, _, rows = np.linalg.svd(flat - mean, full_matrices=False)
        return cls(mean=mean, components=rows[:dimensions])

    def __post_init__(self) -> None:
        if (
            self.components.ndim != 2
            or self.mean.shape != (self.components.shape[1],)
            or self.components.shape[1] > _MAX_PCA_INPUTS
        ):
            raise ValueError(
                f"a PCA needs a mean per input and at most {_MAX_PCA_INPUTS} inputs, got {self.components.shape}"
            )

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Each row's projection, computed exactly on grids of ``2^-12`` (inputs, centred, clipped to
        ``[-2^8, 2^8]``) and ``2^-16`` (components, unit vectors: clipped to ``[-1, 1]``) in integers,
        which numpy multiplies without BLAS: a row's features do not depend on the other rows of the
        batch (BLAS's floating-point sums do, by its blocking), as kNN's sensitivity needs. Every
        product is at most 2^36 and a row's sum, below 2^17 inputs, stays below 2^53."""
        centred = np.clip(x.reshape(len(x), -1).astype(np.float64) - self.mean, -_FEATURE_BOUND, _FEATURE_BOUND)
        inputs = np.round(centred * _INPUT_STEPS_PER_UNIT).astype(np.int64)
        weights = np.round(np.clip(self.components, -1, 1) * _WEIGHT_STEPS_PER_UNIT).astype(np.int64)
        return (inputs @ weights.T).astype(np.float64) / (_INPUT_STEPS_PER_UNIT * _WEIGHT_STEPS_PER_UNIT)

    def to_bytes(self) -> bytes:
        """The mean, then the components row by row: float64, little-endian."""
        return np.concatenate([self.mean, self.components.reshape(-1)]).astype("<f8").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, *, features: int, dimensions: int) -> "PcaFeatures":
        """``ValueError`` unless ``data`` holds ``features (1 + dimensions)`` finite float64 values."""
        expected = 8 * features * (1 + dimensions)
        if len(data) != expected:
            raise ValueError(
                f"a PCA of {dimensions} dimensions over {features} features has {expected} bytes, got {len(data)}"
            )
        values = np.frombuffer(data, dtype="<f8").astype(np.float64)
        if not np.all(np.isfinite(values)):
            raise ValueError("a PCA with values that are not finite")
        return cls(mean=values[:features], components=values[features:].reshape(dimensions, features))


def knn_votes(features: FeatureMap, data: Split, queries: np.ndarray, *, neighbours: int, classes: int) -> np.ndarray:
    """Label counts of the ``neighbours`` records of ``data`` nearest to each query in ``features``: ``(Q, C)``."""
    # One more record than neighbours: removing any record must still leave k to vote, or the
    # record-level sensitivity (one neighbour in, one out) would not hold.
    if not 1 <= neighbours < len(data):
        raise ValueError(f"{neighbours} neighbours need more records than that; this hospital has {len(data)}")
    records, points = _on_grid(features(data.x)), _on_grid(features(queries))
    norms = (records * records).sum(axis=1)
    counts = np.zeros((len(queries), classes), dtype=np.int64)
    for first in range(0, len(points), _QUERY_CHUNK):  # a chunk at a time: distances take 8 bytes per record and query
        chunk = points[first : first + _QUERY_CHUNK]
        # Squared distances without the |query|^2 term, which does not change any query's order. Every
        # term is an integer below 2^53, so float64 computes them exactly, in any order of summation.
        distances = norms[None, :] - 2 * chunk @ records.T
        nearest = np.argsort(distances, axis=1, kind="stable")[:, :neighbours]
        np.add.at(counts, (first + np.arange(len(chunk))[:, None], data.y[nearest]), 1)
    return counts


def _on_grid(features: np.ndarray) -> np.ndarray:
    """Features clipped to ``[-2^8, 2^8]`` and rounded to multiples of ``2^-12``, scaled to integers.

    The record-level sensitivity needs each record's distance to a query to be a function of
    that record alone. Floating-point distances are not: BLAS sums in an order that depends on the
    matrix's shape, so adding a record could reorder the others. (The feature map must compute each
    row alone too, as ``PcaFeatures`` does.) On this grid every coordinate is
    an integer of at most 2^20, and with at most 2^10 dimensions every partial sum of a distance
    stays below 2^52, where float64 is exact. (PCA coordinates of pixels in [0, 1] are at most the
    square root of the pixel count: 28 for MNIST.)"""
    if features.ndim != 2 or features.shape[1] > MAX_FEATURE_DIMENSIONS:
        raise ValueError(
            f"a feature map must give rows of at most {MAX_FEATURE_DIMENSIONS} values, got shape {features.shape}"
        )
    if not np.all(np.isfinite(features)):
        raise ValueError("the feature map gave values that are not finite")
    return np.round(np.clip(features.astype(np.float64), -_FEATURE_BOUND, _FEATURE_BOUND) * _GRID_STEPS_PER_UNIT)


def noise_share(mechanism: SkellamMechanism, pool: NoisePool, *, generator: np.random.Generator) -> np.ndarray:
    """This hospital's ``Sk(mu)`` share of the round's noise as its ballot carries it: a pool of ``M`` times the
    mechanism's ``Q C`` values, in the order drawn, drawn until every one lies in ``[-R, R]`` and their squares
    sum to at most ``E_max`` (each bound misses with probability below 2^-40:
    ``training.voting.vote_privacy.NoisePool``). The talliers place the round's values from it."""
    generator = require_cryptographic(generator)
    for _ in range(_MAX_NOISE_DRAWS):
        noise = mechanism.noise_share(generator, values=pool.factor * mechanism.dimension)
        if int(np.abs(noise).max()) <= pool.radius and int(noise @ noise) <= pool.energy_cap:
            return noise
    raise RuntimeError(f"{_MAX_NOISE_DRAWS} draws of noise all missed their bounds: the bounds do not fit the noise")
