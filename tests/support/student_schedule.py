"""The voting student's learning-rate schedule, chosen on validation records: constant against one cycle.

A developer's tool beside the tests (not installed, not collected)::

    .venv/bin/python tests/support/student_schedule.py --students 3 --out /tmp/student_schedule

It draws a label set as ``consilium-reproduce-voting``'s kNN-DPFL run does, in the clear: the public
pool and test split of the run (``split_public_pool``), three hospitals' kNN counts (k = 400, 30 PCA
dimensions), noise of sigma 148 on each total and the label threshold 840. The noise is Gaussian,
rounded, where the run's is the sum of the hospitals' Skellam shares: at this variance the two laws
are close, and no privacy rests on this script. Ten thousand of MNIST's training records are held
out of the hospitals' data as validation records (the hospitals hold 50,000, so fewer labels are
released than in the run); students of each schedule are trained alternately
on the same labels (``train_student``), and their accuracy on the validation records chooses. Test
accuracy is printed beside it, and not used to choose.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch

import consilium.training.voting.votes as voting
from consilium.training.data.datasets import Split, load_dataset
from consilium.training.models.build import describe_model, input_statistics

_VALIDATION = 10_000
_HOSPITALS, _NEIGHBOURS, _DIMENSIONS = 3, 400, 30
_SIGMA, _THRESHOLD = 148.0, 840


def _label_set(data, pool: Split, validation_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The released queries' indices in the pool and their labels."""
    hospitals = np.setdiff1d(np.arange(len(data.train)), validation_indices)
    features = voting.PcaFeatures.fit(pool.x, _DIMENSIONS)
    counts = sum(
        voting.knn_votes(features, data.train.subset(part), pool.x, neighbours=_NEIGHBOURS, classes=data.num_classes)
        for part in np.array_split(np.random.default_rng(0).permutation(hospitals), _HOSPITALS)
    )
    noisy = counts + np.round(np.random.default_rng().normal(0.0, _SIGMA, counts.shape)).astype(np.int64)
    released = np.flatnonzero(noisy.max(axis=1) >= _THRESHOLD)
    return released, noisy[released].argmax(axis=1)


@torch.no_grad()
def _accuracy(model: torch.nn.Module, split: Split) -> float:
    return float((model(torch.as_tensor(split.x)).argmax(dim=1).numpy() == split.y).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[3] / "shared/data/mnist.npz"))
    parser.add_argument("--seed", type=int, default=0, help="the public pool's split, as the run's --seed")
    parser.add_argument("--students", type=int, default=3, help="students of each schedule")
    parser.add_argument("--epochs", type=int, default=30, help="the run's --student-epochs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    data = load_dataset(args.data)
    pool, test = voting.split_public_pool(data.validation, 0.3, seed=args.seed)
    held_out = np.sort(np.random.default_rng(args.seed).permutation(len(data.train))[:_VALIDATION])
    validation = data.train.subset(held_out)
    mean, std = input_statistics(pool.x)
    spec = describe_model("cnn", data.input_shape, data.num_classes, input_mean=mean, input_std=std)
    released, labels = _label_set(data, pool, held_out)
    print(f"{len(released)} labels released, {np.mean(labels == pool.y[released]):.3f} right", flush=True)
    unlabelled = pool.x[np.setdiff1d(np.arange(len(pool)), released)]

    scores: dict[str, list[dict]] = {"constant": [], "one cycle": []}
    original = voting.train_classifier
    for _ in range(args.students):
        for schedule in scores:

            def train(*positional, one_cycle: bool = False, _cycle=schedule == "one cycle", **named):
                return original(*positional, one_cycle=_cycle, **named)

            voting.train_classifier = train
            student = voting.train_student(spec, Split(pool.x[released], labels), unlabelled, epochs=args.epochs)
            voting.train_classifier = original
            scores[schedule].append({"validation": _accuracy(student, validation), "test": _accuracy(student, test)})
            print(f"{schedule}: {scores[schedule][-1]}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "student_schedule.json").write_text(json.dumps({"labels": len(released), "students": scores}, indent=1))
    for schedule, runs in scores.items():
        validation_scores = [run["validation"] for run in runs]
        print(
            f"{schedule}: validation {statistics.mean(validation_scores):.4f} "
            f"(± {statistics.stdev(validation_scores) if len(runs) > 1 else 0:.4f}), "
            f"test {statistics.mean(run['test'] for run in runs):.4f}"
        )


if __name__ == "__main__":
    main()
