"""The voting student's settings, chosen on validation records: its learning-rate schedule, and its pseudo-labels.

A developer's tool beside the tests (not installed, not collected)::

    .venv/bin/python tests/support/student_choice.py --choice pseudo-labels --method ae-dpfl --out results/student_choice

It draws a label set as ``consilium-reproduce-voting``'s run of ``--method`` does, in the clear,
on the run's public pool and test split (``split_public_pool``). Ten thousand of MNIST's training
records are held out of the hospitals' data as validation records, so the hospitals hold 50,000
records and their labels are a little worse than the run's.

- kNN-DPFL: three hospitals' kNN counts (k = 400, 30 PCA dimensions), noise of sigma 148 on each
  total, and a label only where the noisy top total reaches 840.
- AE-DPFL: 100 hospitals of 6 classes each (``label_skew``), each a teacher trained for 20 epochs
  that abstains below probability 0.5, votes on 500 queries of the pool, noise of sigma 20 on each
  total, and every query labelled.

The noise is Gaussian, rounded, where the run's is the sum of the hospitals' Skellam shares: at
these variances the two laws are close, and no privacy rests on this script. Students of each
candidate are trained alternately on the same labels (``train_student``), and their mean accuracy
on the validation records chooses. Test accuracy is printed beside it, and not used to choose.
"""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

import consilium.training.voting.votes as voting
from consilium.training.data.datasets import Split, load_dataset
from consilium.training.data.partition import partition
from consilium.training.models.build import describe_model, input_statistics

_VALIDATION = 10_000
_KNN = {"hospitals": 3, "neighbours": 400, "dimensions": 30, "sigma": 148.0, "threshold": 840, "epochs": 30}
_AE = {"hospitals": 100, "classes": 6, "teacher_epochs": 20, "confidence": 0.5, "queries": 500, "sigma": 20.0}
_AE_STUDENT_EPOCHS = 60
# Each candidate: the student's module settings it changes.
_CHOICES = {
    "schedule": {"constant": {"one_cycle": False}, "one cycle": {"one_cycle": True}},
    "pseudo-labels": {
        f"{confidence} x {rounds}": {"_PSEUDO_LABEL_CONFIDENCE": confidence, "_PSEUDO_LABEL_ROUNDS": rounds}
        for confidence, rounds in ((0.9, 3), (0.8, 5), (0.7, 5))
    },
}


def _noisy(counts: np.ndarray, sigma: float) -> np.ndarray:
    return counts + np.round(np.random.default_rng().normal(0.0, sigma, counts.shape)).astype(np.int64)


def _knn_labels(data, pool: Split, hospitals: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    features = voting.PcaFeatures.fit(pool.x, _KNN["dimensions"])
    counts = sum(
        voting.knn_votes(features, data.train.subset(part), pool.x, neighbours=_KNN["neighbours"], classes=10)
        for part in np.array_split(np.random.default_rng(seed).permutation(hospitals), _KNN["hospitals"])
    )
    noisy = _noisy(counts, _KNN["sigma"])
    released = np.flatnonzero(noisy.max(axis=1) >= _KNN["threshold"])
    return released, noisy[released].argmax(axis=1)


def _ae_labels(data, pool: Split, hospitals: np.ndarray, seed: int, spec) -> tuple[np.ndarray, np.ndarray]:
    records = data.train.subset(hospitals)
    parts = partition(records.y, _AE["hospitals"], "label_skew", seed=seed, classes_per_part=_AE["classes"])
    queries = np.sort(np.random.default_rng(seed).permutation(len(pool))[: _AE["queries"]])
    counts = sum(
        voting.teacher_votes(
            voting.train_classifier(spec, records.subset(part), epochs=_AE["teacher_epochs"]),
            pool.x[queries],
            data.num_classes,
            min_confidence=_AE["confidence"],
        )
        for part in parts
    )
    return queries, _noisy(counts, _AE["sigma"]).argmax(axis=1)


@contextmanager
def _candidate(settings: dict):
    """The student's module with ``settings`` in place: a constant's value, or ``one_cycle`` for every training."""
    saved = {name: getattr(voting, name) for name in ("train_classifier", *settings) if name != "one_cycle"}
    if "one_cycle" in settings:
        original = voting.train_classifier

        def train(*positional, one_cycle: bool = False, **named):
            return original(*positional, one_cycle=settings["one_cycle"], **named)

        voting.train_classifier = train
    for name, value in settings.items():
        if name != "one_cycle":
            setattr(voting, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(voting, name, value)


@torch.no_grad()
def _accuracy(model: torch.nn.Module, split: Split) -> float:
    return float((model(torch.as_tensor(split.x)).argmax(dim=1).numpy() == split.y).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[3] / "shared/data/mnist.npz"))
    parser.add_argument("--choice", choices=list(_CHOICES), required=True)
    parser.add_argument("--method", choices=("knn-dpfl", "ae-dpfl"), default="knn-dpfl")
    parser.add_argument(
        "--seed", type=int, default=0, help="the public pool's split and the partition, as the run's --seed"
    )
    parser.add_argument("--students", type=int, default=3, help="students of each candidate")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    data = load_dataset(args.data)
    pool, test = voting.split_public_pool(data.validation, 0.3, seed=args.seed)
    held_out = np.sort(np.random.default_rng(args.seed).permutation(len(data.train))[:_VALIDATION])
    validation = data.train.subset(held_out)
    hospitals = np.setdiff1d(np.arange(len(data.train)), held_out)
    mean, std = input_statistics(pool.x)
    spec = describe_model("cnn", data.input_shape, data.num_classes, input_mean=mean, input_std=std)
    if args.method == "knn-dpfl":
        (released, labels), epochs = _knn_labels(data, pool, hospitals, args.seed), _KNN["epochs"]
    else:
        (released, labels), epochs = _ae_labels(data, pool, hospitals, args.seed, spec), _AE_STUDENT_EPOCHS
    right = float(np.mean(labels == pool.y[released]))
    print(f"{len(released)} labels released, {right:.3f} right", flush=True)
    unlabelled = pool.x[np.setdiff1d(np.arange(len(pool)), released)]

    candidates = _CHOICES[args.choice]
    scores: dict[str, list[dict]] = {name: [] for name in candidates}
    for student_number in range(args.students):
        for name in list(candidates)[:: 1 if student_number % 2 == 0 else -1]:  # alternate the order
            with _candidate(candidates[name]):
                student = voting.train_student(spec, Split(pool.x[released], labels), unlabelled, epochs=epochs)
            scores[name].append({"validation": _accuracy(student, validation), "test": _accuracy(student, test)})
            print(f"{name}: {scores[name][-1]}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"method": args.method, "seed": args.seed, "labels": len(released), "labels right": right}
    path = args.out / f"{args.choice}-{args.method}.json"
    path.write_text(json.dumps({**summary, "students": scores}, indent=1))
    for name, runs in scores.items():
        validation_scores = [run["validation"] for run in runs]
        print(
            f"{name}: validation {statistics.mean(validation_scores):.4f} "
            f"(± {statistics.stdev(validation_scores) if len(runs) > 1 else 0:.4f}), "
            f"test {statistics.mean(run['test'] for run in runs):.4f}"
        )
    print(f"written: {path}")


if __name__ == "__main__":
    main()
