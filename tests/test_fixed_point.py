import numpy as np
import pytest

from crypto.fixed_point import FixedPointCodec


def test_round_trip_is_within_half_a_step():
    codec = FixedPointCodec(scale=1000.0, max_level=5000)
    values = np.random.default_rng(0).uniform(-5, 5, 10_000)
    encoded = codec.encode(values)
    assert encoded.clamped == 0
    assert encoded.levels.dtype == np.int64
    assert np.max(np.abs(codec.decode(encoded.levels) - values)) <= 0.5 / 1000 + 1e-12


def test_values_beyond_the_bound_are_clamped_and_counted():
    codec = FixedPointCodec(scale=10.0, max_level=20)
    encoded = codec.encode(np.array([-7.0, -2.0, 0.0, 1.96, 2.0, 3.0, 1e9]))
    assert encoded.levels.tolist() == [-20, -20, 0, 20, 20, 20, 20]
    assert encoded.clamped == 3


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused(bad):
    with pytest.raises(ValueError, match="NaN or infinite"):
        FixedPointCodec(scale=10.0, max_level=20).encode(np.array([0.0, bad]))
