"""The public signs and places with which a voter's noise enters the totals (``tallier.ballot_checks``): uniform,
a true permutation, fresh for every seed and voter, so that a hospital can aim neither its noise's sign nor its
place."""

import numpy as np
from consilium.crypto.mpc_field import MpcField
from consilium.tallier.ballot_checks import noise_placement
from scipy import stats

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
