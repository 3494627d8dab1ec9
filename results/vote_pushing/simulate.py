"""What one hospital that pushes a class can still do to the labels, staying inside every check of its ballot.

The three hospitals' real votes on the built-in digits' public pool (kNN-DPFL: k = 30 on the public PCA of 30
dimensions; AE-DPFL: each hospital's teacher, 30 epochs), as a default run casts them, hospital-3 playing one
strategy; then many draws of every hospital's noise and of the round's seed, from which
``tallier.ballot_checks.noise_placement`` (imported, not copied) signs and places each hospital's noise, at the run's defaults (3 hospitals, quorum 3, 90 queries a round;
kNN-DPFL sigma 15, AE-DPFL sigma 1). The noise's range and energy cap are the run's own
(``VotingSettings.noise_range``, ``VotingSettings.energy_cap``). Strategies of hospital-3:

- ``honest``: its own votes, honest noise;
- ``class``: every vote for class 3, honest noise: its influence through its votes alone;
- ``aimed``: every vote for class 3, and noise of ``sqrt(E_max / Q)`` on class 3's count of every query
  (the largest the cap allows there), which the talliers then sign and place at random;
- ``aimed, unplaced``: the same ballot were the talliers not to sign and place the noise (the design without it);
- ``shaped a``: every vote for class 3 (or, ``honest, shaped a``, its own votes), and ``E_max / a^2``
  noise values of size ``a``, the rest 0: how the size of its noise, the one thing it still chooses,
  moves the labels, for sizes from 1 to ``R``;
- ``ones at the honest mean``: every vote for class 3, and as many values of 1 as an honest share's mean energy
  (``2 mu Q C``): the same noise energy as honest noise, in another shape;
- ``shape-checked``: every vote for class 3, and the most energy in values of 2 and 1 that would pass, besides
  the energy cap, a cap on how many values are not 0 and one on how many are above 1, each at its honest
  2^-40 tail (``count_cap``): what checks of the noise's shape, which the talliers do not make, would leave.

Last, AE-DPFL again with the same 180 queries in one round, whose cap lies closer to the honest energy's mean
(the tail of a sum of more values); and with a design that is not built: each hospital sends 4 (or 8) times the
round's ``Q C`` noise values, checked over them all, of which the talliers place a random ``Q C``.

Printed: the share of labels that are class 3 and the label accuracy, each a mean over the draws with its
standard error. Run: ``python results/vote_pushing/simulate.py`` (about 6 minutes on 2 cores).
"""

import math
import secrets

import numpy as np
from scipy import optimize, special
from consilium.crypto.mpc_field import MpcField
from consilium.tallier.ballot_checks import noise_placement
from consilium.training.data.datasets import load_dataset
from consilium.training.data.partition import partition
from consilium.training.models.build import describe_model, input_statistics
from consilium.training.voting.vote_privacy import VotingSettings
from consilium.training.voting.votes import PcaFeatures, knn_votes, split_public_pool, teacher_votes, train_classifier

DRAWS, PUSHED = 2000, 3
rng = np.random.default_rng()


def count_cap(mu: float, radius: int, count: int, above: int) -> int:
    """The least ``c`` for which Chernoff's bound proves that fewer than ``c`` of ``count`` honest ``Sk(mu)`` values
    (in ``[-R, R]``) have ``|n| > above`` but with probability below 2^-40: what a check of that count would allow."""
    values = np.arange(-radius, radius + 1)
    log_pmf = np.log(special.ive(np.abs(values), 2 * mu))
    p = float(np.exp(special.logsumexp(log_pmf[np.abs(values) > above]) - special.logsumexp(log_pmf)))
    bound = optimize.minimize_scalar(
        lambda log_rate: (
            (count * math.log1p(p * math.expm1(math.exp(log_rate))) + 40 * math.log(2)) / math.exp(log_rate)
        ),
        bounds=(math.log(1e-6), math.log(1e3)),
        method="bounded",
    ).fun
    return math.ceil(bound)


def real_votes(method: str, queries: int) -> tuple[list[np.ndarray], np.ndarray]:
    dataset = load_dataset("digits")
    pool, _ = split_public_pool(dataset.validation, 0.5, seed=0)
    truth = pool.y[:queries]
    queries = pool.x[:queries]
    parts = partition(dataset.train.y, 3, "iid", seed=0)
    if method == "knn-dpfl":
        features = PcaFeatures.fit(pool.x, 30)
        return [knn_votes(features, dataset.train.subset(p), queries, neighbours=30, classes=10) for p in parts], truth
    mean, std = input_statistics(pool.x)
    spec = describe_model("mlp", dataset.input_shape, 10, input_mean=mean, input_std=std, classes=dataset.classes)
    teachers = [train_classifier(spec, dataset.train.subset(p), epochs=30) for p in parts]
    return [teacher_votes(t, queries, 10, min_confidence=0.0) for t in teachers], truth


def simulate(
    method: str, sigma: float, k: int, queries: int = 90, sizes=(1, 2, 3, 5, 8, 13, 20, 30, 50), pool: int = 1
) -> None:
    """``pool`` > 1: each hospital's noise is ``pool`` times the round's ``Q C`` values, checked over them all, and
    the talliers place a random ``Q C`` of them (a design not built, tried here for what it would leave)."""
    settings = VotingSettings(method=method, noise_std=sigma, quorum=3, neighbours=k)
    radius = settings.noise_range(queries=queries * pool, classes=10)
    cap = settings.energy_cap(queries=queries * pool, classes=10)
    mu, count, sent = settings.share_mu, queries * 10, queries * 10 * pool
    modulus = MpcField.for_bound(3 * (k + radius) + 1).modulus  # the run's field at both defaults
    votes, truth = real_votes(method, queries)
    pushed = np.zeros_like(votes[2])
    pushed[:, PUSHED] = k

    def honest_noise():
        while True:
            n = rng.poisson(mu, sent) - rng.poisson(mu, sent)
            if np.abs(n).max() <= radius and n @ n <= cap:
                return n

    def aimed():
        n = np.zeros((queries, 10), dtype=np.int64)
        n[:, PUSHED] = min(radius, int(np.sqrt(cap / queries)))
        return n.reshape(-1)

    def shaped(size: int, energy: int = cap):
        def draw():
            n = np.zeros(sent, dtype=np.int64)
            n[: min(sent, energy // size**2)] = size
            return n

        return draw

    strategies = {
        "honest": (votes[2], honest_noise, True),
        "class": (pushed, honest_noise, True),
        "aimed": (pushed, aimed, True),
        "aimed, unplaced": (pushed, aimed, False),
    }
    if pool > 1:
        strategies = {"class": strategies["class"]}
    strategies["ones at the honest mean"] = (pushed, shaped(1, round(2 * mu * sent)), True)
    # Were the talliers also to cap how many values are not 0, and how many are above 1, each at its own 2^-40 tail:
    nonzero, above_one = count_cap(mu, radius, sent, 0), count_cap(mu, radius, sent, 1)
    twos = min(above_one, cap // 4)
    ones = max(0, min(nonzero - twos, cap - 4 * twos))

    def shape_checked():
        n = np.zeros(count, dtype=np.int64)
        n[:twos], n[twos : twos + ones] = 2, 1
        return n

    if pool == 1:
        strategies[f"shape-checked, {twos} of 2, {ones} of 1"] = (pushed, shape_checked, True)
    for size in sorted({*sizes, radius} - {s for s in range(radius + 1, 99)}):
        strategies[f"shaped {size}"] = (pushed, shaped(size), True)
        if pool == 1:
            strategies[f"honest, shaped {size}"] = (votes[2], shaped(size), True)
    pooled = f", the noise {pool} times the values, {count} of them placed" if pool > 1 else ""
    print(
        f"\n{method}, sigma {sigma:g}, k {k}, {queries} queries a round{pooled}: R = {radius}, E_max = {cap} (honest "
        f"mean {2 * mu * sent:.0f}, {cap / (2 * mu * sent):.2f} times); at 2^-40 at most {nonzero} values not 0 and "
        f"{above_one} above 1"
    )
    for name, (third, noise, placed) in strategies.items():
        shares, accuracies = [], []
        for _ in range(DRAWS):
            totals = (votes[0] + votes[1] + third).reshape(-1).astype(np.int64)
            seed = 1 + secrets.randbelow(modulus - 1)  # the round's seed, opened once every ballot is in
            for h, n in enumerate((honest_noise(), honest_noise(), noise())):
                if placed or h < 2:
                    signs, places = noise_placement(seed, f"hospital-{h + 1}", sent, modulus)
                    n = signs[:count] * n[places[:count]]
                totals = totals + n
            labels = totals.reshape(queries, 10).argmax(axis=1)
            shares.append(np.mean(labels == PUSHED))
            accuracies.append(np.mean(labels == truth))
        se = lambda x: np.std(x) / np.sqrt(len(x))  # noqa: E731
        print(
            f"  {name:20s} class {PUSHED}: {np.mean(shares):.3f} +- {se(shares):.3f}   "
            f"label accuracy: {np.mean(accuracies):.3f} +- {se(accuracies):.3f}"
        )


if __name__ == "__main__":
    simulate("knn-dpfl", 15.0, 30)
    simulate("ae-dpfl", 1.0, 1)
    simulate("ae-dpfl", 1.0, 1, queries=180, sizes=(1, 2, 3))  # the same queries in one round: a tighter cap
    for pool in (4, 8):
        simulate("ae-dpfl", 1.0, 1, sizes=(1, 2, 3), pool=pool)
