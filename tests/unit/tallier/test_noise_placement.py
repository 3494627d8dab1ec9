"""The public signs and places with which a voter's noise enters the totals (``tallier.ballot_checks``): uniform,
a true permutation, fresh for every seed and voter, so that a hospital can aim neither its noise's sign nor its
place."""

import numpy as np
from consilium.crypto.mpc_field import MpcField
from consilium.protocol.voting.ballots import BallotLayout
from consilium.tallier.ballot_checks import noise_placement, pool_placement
from consilium.training.privacy.secure_random import secure_generator
from consilium.training.voting.vote_privacy import VotingSettings
from consilium.training.voting.votes import noise_share
from scipy import special, stats
from tally_inputs import layout_for

P = MpcField.for_bound(10_000).modulus


def test_the_places_are_a_permutation_with_as_few_fixed_points_as_a_uniform_one_and_the_signs_are_balanced():
    signs, places = noise_placement(2**40 + 12345, "hospital-1", 10_000, P)
    assert np.array_equal(np.sort(places), np.arange(10_000))
    assert np.sum(places == np.arange(10_000)) < 20  # Poisson(1) for a uniform permutation; 20 or more: 1e-19
    assert set(np.unique(signs)) == {-1, 1} and abs(signs.mean()) < 6 / np.sqrt(10_000)


def test_each_place_is_equally_likely_and_voters_and_seeds_are_placed_apart():
    where = [noise_placement(seed, "hospital-1", 10, P)[1][0] for seed in range(2000)]
    assert stats.chisquare(np.bincount(where, minlength=10)).pvalue > 1e-6
    first, second = noise_placement(7, "hospital-1", 1000, P), noise_placement(7, "hospital-2", 1000, P)
    assert not np.array_equal(first[1], second[1]) and not np.array_equal(first[0], second[0])
    again = noise_placement(8, "hospital-1", 1000, P)
    assert not np.array_equal(first[1], again[1])
    assert all(np.array_equal(a, b) for a, b in zip(first, noise_placement(7, "hospital-1", 1000, P)))


def test_each_value_sent_lands_in_the_round_with_frequency_1_over_m_and_an_honest_pool_lands_as_skellam():
    """A pool of ``M N`` values of which the talliers place ``N`` (``pool_placement``): each value sent lands in the
    round's ``N`` totals with probability ``1 / M``, whatever its slot, so no order of the values sent lands more
    of them; an honest pool's placed values have ``Sk(mu)``'s frequency of 0 and its variance, and so do the
    values placed in totals of each position, as a tallier sees them with the seed known."""
    layout = layout_for(6, 5, 1, noise_range=30, pool_factor=4)  # N = 30 totals, M N = 120 slots
    landed = np.zeros(layout.pool_values)
    for seed in range(1, 3001):
        signs, slots = pool_placement(seed, "hospital-1", layout, P)
        assert len(set(slots)) == layout.totals and np.all(np.abs(signs) == 1)  # each value at most once
        np.add.at(landed, slots, 1)
    assert np.allclose(landed / 3000, 1 / 4, atol=6 * np.sqrt(0.25 * 0.75 / 3000))  # six standard errors
    assert stats.chisquare(landed).pvalue > 1e-6
    settings = VotingSettings(method="ae-dpfl", noise_std=1.0, quorum=3)
    mechanism = settings.mechanism(queries=90, classes=10, level="record")
    layout = BallotLayout.for_round(settings, queries=90, classes=10, abstains=False)
    assert layout.pool_factor > 1
    placed = np.stack(
        [
            signs * noise_share(mechanism, layout.noise_pool, generator=secure_generator())[slots]
            for signs, slots in (pool_placement(seed, "hospital-1", layout, P) for seed in range(1, 301))
        ]
    )  # (seeds, totals)
    mu = settings.share_mu
    zero, variance = np.exp(-2 * mu) * special.i0(2 * mu), 2 * mu  # Sk(mu)'s P(0) and variance
    error = np.sqrt(zero * (1 - zero) / placed.size)
    assert abs(np.mean(placed == 0) - zero) < 6 * error and abs(placed.var() / variance - 1) < 0.05
    assert abs(placed.mean()) < 6 * np.sqrt(variance / placed.size)
    # Knowing the seed tells a tallier nothing of which totals a hospital's noise leaves at 0: the first and the
    # last slots of the pool land as often at 0 as any (were only its nonzero values sent, the rest would be).
    low, high = [], []
    for seed in range(1, 301):
        noise = noise_share(mechanism, layout.noise_pool, generator=secure_generator())
        _, slots = pool_placement(seed, "hospital-1", layout, P)
        low.extend(noise[slots[slots < layout.pool_values // 4]] == 0)
        high.extend(noise[slots[slots >= 3 * layout.pool_values // 4]] == 0)
    for sample in (low, high):
        assert abs(np.mean(sample) - zero) < 6 * np.sqrt(zero * (1 - zero) / len(sample))
