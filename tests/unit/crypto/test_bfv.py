"""BFV on SEAL: sums of one-time-key uploads are exact at the parameters' limits, and SEAL's objects
move to and from numpy's arrays exactly (``crypto.bfv``, ``crypto.one_time_keys``)."""

import secrets

import numpy as np
import pytest

from consilium.crypto import key_shares, one_time_keys
from consilium.crypto.bfv import BfvError, PublicContext, _MemoryFile, pack_words, unpack_words
from consilium.crypto.bfv_parameters import select_bfv_parameters


@pytest.fixture(scope="module")
def public(small_params):
    return PublicContext(small_params)


def _sum_of(public, vectors, round_number=1):
    """Each vector uploaded under a one-time key, the uploads added, the sum opened from two releases."""
    params, q = public.params, public.params.ciphertext_modulus
    a = one_time_keys.public_polynomials(params, run="run", round_number=round_number)
    keys, uploads = [], []
    for vector in vectors:
        slots = params.slots_of(np.asarray(vector))
        keys.append(one_time_keys.OneTimeKey(public, threshold=2, parties=3))
        uploads.append(one_time_keys.unpack_ring(public, keys[-1].encrypt(slots, a), "upload"))
    releases = {x: key_shares.release([k.dealing.shares[x - 1] for k in keys], q).share for x in (1, 2)}
    slots = one_time_keys.decrypt_sum(
        public, one_time_keys.sum_uploads(public, uploads), key_shares.rebuild(releases, 2, q), a
    )
    one_time_keys.check_zero_slots(public, slots, params.digits.slots_for(params.vector_length))
    return params.values_of(slots)


@pytest.mark.parametrize("contributors", [2, 10, "max"])
def test_a_sum_of_uploads_equals_the_plaintext_sum(public, small_params, contributors):
    count = small_params.max_contributors if contributors == "max" else contributors
    share = small_params.sum_bound // small_params.max_contributors
    vectors = np.random.default_rng().integers(-share, share, size=(count, small_params.vector_length), endpoint=True)
    np.testing.assert_array_equal(_sum_of(public, vectors), vectors.sum(axis=0))


@pytest.mark.parametrize("sign", [1, -1])
def test_the_largest_sums_stay_exact_at_max_contributors(public, small_params, sign):
    """Every coordinate at the sum bound, from the most contributors the parameters allow."""
    count, bound = small_params.max_contributors, small_params.sum_bound
    vectors = np.full((count, small_params.vector_length), sign * (bound // count), dtype=np.int64)
    vectors[0] += sign * (bound % count)
    np.testing.assert_array_equal(_sum_of(public, vectors), np.full(small_params.vector_length, sign * bound))


def test_several_values_a_slot_and_several_ciphertexts_sum_exactly():
    params = select_bfv_parameters(max_contributors=5, vector_length=12_000, sum_bound=20_000)
    assert params.values_per_slot == 3 and params.plain_modulus > 2**32
    public = PublicContext(params)
    share = params.sum_bound // 5
    vectors = np.random.default_rng(5).integers(-share, share, size=(5, params.vector_length), endpoint=True)
    vectors[:, :3] = 0
    vectors[0, :3], vectors[1, :3] = [2**40, -(2**40), 2**50], [-(2**40) + 3, 2**40 - 3, 7 - 2**50]  # far out, sums in
    total = _sum_of(public, vectors)
    assert np.array_equal(total, vectors.sum(axis=0)) and total[:3].tolist() == [3, -3, 7]
    long = select_bfv_parameters(max_contributors=3, vector_length=100_000, sum_bound=3000)
    assert long.chunk_count > 1
    vectors = np.random.default_rng(6).integers(-1000, 1000, size=(3, long.vector_length), endpoint=True)
    np.testing.assert_array_equal(_sum_of(PublicContext(long), vectors), vectors.sum(axis=0))


@pytest.mark.parametrize("bits", range(1, 61))
def test_coefficients_are_packed_to_exactly_their_bits(bits):
    coefficients = [secrets.randbits(bits) for _ in range(64)]
    packed = sum(c << (i * bits) for i, c in enumerate(coefficients)).to_bytes(8 * bits, "little")  # by hand
    words = np.array(coefficients, dtype="<u8").tobytes()
    assert pack_words(words, bits) == packed
    assert unpack_words(packed, len(coefficients), bits) == words


@pytest.mark.parametrize("nonzero", [0, 1, 1000, "all"])
def test_a_plaintext_s_coefficients_come_back_as_they_went_in(public, small_params, nonzero):
    """Slots are plaintext coefficients: SEAL saves a plaintext without its highest zero coefficients,
    which must read back as zeros, not shift or shorten the slots."""
    degree, t = small_params.poly_modulus_degree, small_params.plain_modulus
    slots = np.zeros(degree, dtype=np.int64)
    count = degree if nonzero == "all" else nonzero
    slots[:count] = np.random.default_rng().integers(1, t, size=count)
    slots[0] = t - 1 if count else 0
    with _MemoryFile() as file:
        np.testing.assert_array_equal(public.plaintext_coefficients(file, public.load_plaintext(file, slots)), slots)


def test_a_polynomial_pair_comes_back_as_it_went_in_in_either_form(public, small_params):
    q, degree = small_params.ciphertext_modulus, small_params.poly_modulus_degree
    pair = np.random.default_rng().integers(0, q, size=(2, degree)).astype(np.uint64)
    with _MemoryFile() as file:
        for ntt in (False, True):
            np.testing.assert_array_equal(
                public.ring_elements(file, public.load_ring_elements(file, pair, ntt=ntt)), pair
            )


def test_a_slot_outside_t_or_a_coefficient_outside_q_is_refused(public, small_params):
    slots = np.zeros(small_params.poly_modulus_degree, dtype=np.int64)
    slots[5] = small_params.plain_modulus
    pair = np.zeros((2, small_params.poly_modulus_degree), dtype=np.uint64)
    pair[1, 7] = small_params.ciphertext_modulus
    with _MemoryFile() as file:
        with pytest.raises(BfvError, match="not a plaintext for these parameters"):
            public.load_plaintext(file, slots)
        with pytest.raises(BfvError, match="not two polynomials of R_q"):
            public.load_ring_elements(file, pair, ntt=False)
        with pytest.raises(BfvError, match="not a polynomial of R_q in NTT form"):
            public.load_ntt_plaintext(file, pair[1])
