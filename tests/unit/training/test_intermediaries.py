"""The adaptive split follows Eq. (2)-(3) of Jiang et al., from quantities the server may see."""

import math

import numpy as np
import pytest

from consilium.training.methods.intermediaries import expected_noise_norm, next_subclient_count


@pytest.mark.parametrize("dimension", [1, 10, 5000])
def test_the_expected_noise_norm_is_the_mean_norm_of_gaussian_noise(dimension):
    samples = np.linalg.norm(np.random.default_rng(0).normal(0, 0.7, size=(4000, dimension)), axis=1)
    assert expected_noise_norm(0.7, dimension) == pytest.approx(samples.mean(), rel=0.03)


def test_the_split_moves_the_ratio_xi_over_phi_to_one_over_n():
    # At v = 2 with N = 6: xi_v = ||zeta|| / S, phi_v = sum_norms / S for any S.
    noise, norms, clipped_sum = 12.0, 18.0, 30.0
    xi_v, phi_v = noise / clipped_sum, norms / clipped_sum
    xi, phi = 2 * xi_v, phi_v / 2  # Eq. (3) read backwards
    v = next_subclient_count(2, hospitals=6, noise_norm=noise, update_norm_sum=norms, most=100)
    assert v == math.sqrt(6 * xi / phi) == 4
    assert (xi / v) / (phi * v) == pytest.approx(1 / 6)  # the new ratio, by Eq. (3), is 1/N


def test_the_split_stays_within_what_the_hospitals_allow():
    assert next_subclient_count(4, hospitals=6, noise_norm=1e6, update_norm_sum=1.0, most=9) == 9
    assert next_subclient_count(4, hospitals=6, noise_norm=1e-9, update_norm_sum=1.0, most=9) == 1
    assert next_subclient_count(4, hospitals=6, noise_norm=1.0, update_norm_sum=-3.0, most=9) == 9
