"""What one hospital that pushes a class can still do to the labels, staying inside every check of its ballot.

The three hospitals' real votes on the built-in digits' public pool (kNN-DPFL: k = 30 on the public PCA of 30
dimensions; AE-DPFL: each hospital's teacher, 30 epochs), as a default run casts them, hospital-3 playing one
strategy; then many draws of every hospital's noise and of the round's seed, from which
``tallier.ballot_checks.noise_placement`` (imported, not copied) signs and places each hospital's noise, at the run's defaults (3 hospitals, quorum 3, 90 queries a round;
kNN-DPFL sigma 15, AE-DPFL sigma 1). The noise's range and energy cap are those of a pool of one round's values
(``VotingSettings.noise_range``, ``VotingSettings.energy_cap``): the checks before change 4 below, which
``simulate`` measures. Strategies of hospital-3:

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
(the tail of a sum of more values). Then ``pooled``: change 4 of ``docs/explanation/checked-votes.md`` as
designed, in which each hospital's noise is a pool of ``M`` times the round's values, checked over them all, of
which the talliers place a random ``Q C``, measured by the labels changed from the honest run's; the design sent
only the pool's values that are not 0 (``K`` of them), which its review found a leak: as built
(``tallier.ballot_checks.pool_placement``), every value is sent, and ``tests/end_to_end/test_vote_pushing.py``
measures it on a real federation's votes.

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


def real_votes(method: str, queries: int, seed: int | None = None) -> tuple[list[np.ndarray], np.ndarray]:
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
    seeds = [None if seed is None else 3 * seed + h for h in range(3)]
    teachers = [train_classifier(spec, dataset.train.subset(p), epochs=30, seed=s) for p, s in zip(parts, seeds)]
    return [teacher_votes(t, queries, 10, min_confidence=0.0) for t in teachers], truth


def simulate(method: str, sigma: float, k: int, queries: int = 90, sizes=(1, 2, 3, 5, 8, 13, 20, 30, 50)) -> None:
    settings = VotingSettings(method=method, noise_std=sigma, quorum=3, neighbours=k)
    radius = settings.noise_range(values=queries * 10)
    cap = settings.energy_cap(values=queries * 10)
    mu, count = settings.share_mu, queries * 10
    modulus = MpcField.for_bound(3 * (k + radius) + 1).modulus  # the run's field at both defaults
    votes, truth = real_votes(method, queries)
    pushed = np.zeros_like(votes[2])
    pushed[:, PUSHED] = k

    def honest_noise():
        while True:
            n = rng.poisson(mu, count) - rng.poisson(mu, count)
            if np.abs(n).max() <= radius and n @ n <= cap:
                return n

    def aimed():
        n = np.zeros((queries, 10), dtype=np.int64)
        n[:, PUSHED] = min(radius, int(np.sqrt(cap / queries)))
        return n.reshape(-1)

    def shaped(size: int, energy: int = cap):
        def draw():
            n = np.zeros(count, dtype=np.int64)
            n[: min(count, energy // size**2)] = size
            return n

        return draw

    strategies = {
        "honest": (votes[2], honest_noise, True),
        "class": (pushed, honest_noise, True),
        "aimed": (pushed, aimed, True),
        "aimed, unplaced": (pushed, aimed, False),
    }
    strategies["ones at the honest mean"] = (pushed, shaped(1, round(2 * mu * count)), True)
    # Were the talliers also to cap how many values are not 0, and how many are above 1, each at its own 2^-40 tail:
    nonzero, above_one = count_cap(mu, radius, count, 0), count_cap(mu, radius, count, 1)
    twos = min(above_one, cap // 4)
    ones = max(0, min(nonzero - twos, cap - 4 * twos))

    def shape_checked():
        n = np.zeros(count, dtype=np.int64)
        n[:twos], n[twos : twos + ones] = 2, 1
        return n

    strategies[f"shape-checked, {twos} of 2, {ones} of 1"] = (pushed, shape_checked, True)
    for size in sorted({*sizes, radius} - {s for s in range(radius + 1, 99)}):
        strategies[f"shaped {size}"] = (pushed, shaped(size), True)
        strategies[f"honest, shaped {size}"] = (votes[2], shaped(size), True)
    print(
        f"\n{method}, sigma {sigma:g}, k {k}, {queries} queries a round: R = {radius}, E_max = {cap} (honest mean "
        f"{2 * mu * count:.0f}, {cap / (2 * mu * count):.2f} times); at 2^-40 at most {nonzero} values not 0 and "
        f"{above_one} above 1"
    )
    for name, (third, noise, placed) in strategies.items():
        shares, accuracies = [], []
        for _ in range(DRAWS):
            totals = (votes[0] + votes[1] + third).reshape(-1).astype(np.int64)
            seed = 1 + secrets.randbelow(modulus - 1)  # the round's seed, opened once every ballot is in
            for h, n in enumerate((honest_noise(), honest_noise(), noise())):
                if placed or h < 2:
                    signs, places = noise_placement(seed, f"hospital-{h + 1}", count, modulus)
                    n = signs * n[places]
                totals = totals + n
            labels = totals.reshape(queries, 10).argmax(axis=1)
            shares.append(np.mean(labels == PUSHED))
            accuracies.append(np.mean(labels == truth))
        se = lambda x: np.std(x) / np.sqrt(len(x))  # noqa: E731
        print(
            f"  {name:20s} class {PUSHED}: {np.mean(shares):.3f} +- {se(shares):.3f}   "
            f"label accuracy: {np.mean(accuracies):.3f} +- {se(accuracies):.3f}"
        )


def pooled(
    method: str,
    sigma: float,
    k: int,
    pools: tuple[int, ...],
    sizes: tuple[int, ...],
    teacher_seeds: tuple[int, ...],
    draws: int,
) -> None:
    """Change 4 of ``docs/explanation/checked-votes.md`` (designed, not built), with issue 46's metric: the labels
    that differ from the honest run's. Each hospital draws a pool of ``M Q C`` honest values (within the pool's
    range, energy cap, and at most ``K`` not 0) and sends its ``K`` nonzero values and zeros; total ``i`` gets
    ``rho[i] n[pi(i)]`` where ``pi(i) < K``. The same votes (one set per teacher seed) under every ``M``; per draw
    an honest run on a seed and pools of its own, and another seed and honest pools shared by hospital-3 voting
    all for class 3 with its honest noise and by each attack (all for class 3, and as many values of one size as
    K and the cap allow, or the ``K``-limited mix of 2s and 1s with the most energy). Printed per ``M``: the cap
    against the honest mean, ``K / Q C``, and each attack's share of labels changed from the honest run's less the
    class vote's, in points, with its standard error over draws and seeds."""
    queries, count = 90, 900
    settings = VotingSettings(method=method, noise_std=sigma, quorum=3, neighbours=k)
    votes_by_seed = {seed: real_votes(method, queries, seed)[0] for seed in teacher_seeds}

    def label(totals):
        return totals.reshape(queries, 10).argmax(axis=1)

    for factor in pools:
        mu, slots = settings.share_mu, count * factor
        radius = settings.noise_range(values=slots)
        cap = settings.energy_cap(values=slots)
        sent = min(slots, count_cap(mu, radius, slots, 0))
        modulus = MpcField.for_bound(3 * (k + radius) + 1).modulus
        attacks = {f"{min(sent, cap // a**2)} of {a}": [a] * min(sent, cap // a**2) for a in sizes}
        twos = max(0, (cap - sent) // 3)  # the most energy K values of 2 and 1 can carry under the cap
        if 0 < twos < sent:
            attacks[f"{twos} of 2, {sent - twos} of 1"] = [2] * twos + [1] * (sent - twos)
        sent_values = {name: np.pad(np.array(v, dtype=np.int64), (0, sent - len(v))) for name, v in attacks.items()}

        def honest():
            while True:
                n = rng.poisson(mu, slots) - rng.poisson(mu, slots)
                if np.abs(n).max() <= radius and n @ n <= cap and np.count_nonzero(n) <= sent:
                    return np.concatenate([n[n != 0], np.zeros(sent - np.count_nonzero(n), dtype=np.int64)])

        excess = {name: [] for name in attacks}
        for votes in votes_by_seed.values():
            pushed = np.zeros_like(votes[2])
            pushed[:, PUSHED] = k
            flat = [v.reshape(-1).astype(np.int64) for v in (*votes, pushed)]

            def run():
                """One round's seed and its landing of each hospital's values, and each hospital's honest noise."""
                seed = 1 + secrets.randbelow(modulus - 1)
                landing = []
                for h in range(3):
                    signs, places = noise_placement(seed, f"hospital-{h + 1}", slots, modulus)
                    landing.append((np.minimum(places[:count], sent - 1), signs[:count] * (places[:count] < sent)))
                return landing, [honest()[where] * factor_ for where, factor_ in landing]

            for _ in range(draws):
                _, noise = run()  # the honest run, on noise of its own
                honest_run = label(flat[0] + flat[1] + flat[2] + sum(noise))
                landing, noise = run()  # another run: hospital-3 votes all for class 3, honestly or not
                base = flat[0] + flat[1] + flat[3] + noise[0] + noise[1]
                changed_by_class = np.mean(label(base + noise[2]) != honest_run)
                where, factor_ = landing[2]
                for name, attack in sent_values.items():
                    changed = np.mean(label(base + attack[where] * factor_) != honest_run)
                    excess[name].append(100 * (changed - changed_by_class))
        print(
            f"\n{method}, sigma {sigma:g}, {queries} queries a round, pool M = {factor}: R = {radius}, E_max = {cap} "
            f"({cap / (2 * mu * slots):.2f} times the honest mean), K = {sent} ({sent / count:.2f} Q C); labels "
            f"changed from the honest run's, beyond voting all for class {PUSHED}, in points ({len(teacher_seeds)} "
            f"teacher seeds, {draws} draws each):"
        )
        for name, points in excess.items():
            print(f"  {name:24s} {np.mean(points):+.2f} +- {np.std(points) / np.sqrt(len(points)):.2f}")


if __name__ == "__main__":
    simulate("knn-dpfl", 15.0, 30)
    simulate("ae-dpfl", 1.0, 1)
    simulate("ae-dpfl", 1.0, 1, queries=180, sizes=(1, 2, 3))  # the same queries in one round: a tighter cap
    pooled("ae-dpfl", 1.0, 1, pools=(1, 2, 4, 8, 16), sizes=(1, 2, 3, 8), teacher_seeds=(0, 1, 2), draws=400)
    pooled("knn-dpfl", 15.0, 30, pools=(1, 2), sizes=(8, 20, 50), teacher_seeds=(0,), draws=400)
