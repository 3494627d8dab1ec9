"""One-time keys on real SEAL: sums decrypt from any tau releases, nothing else does, a key encrypts once."""

import itertools

import numpy as np
import pytest

from consilium.crypto import key_shares, one_time_keys as otk
from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.bfv_parameters import select_bfv_parameters
from consilium.crypto.linear_hash import LinearHash

LENGTH = 3000


@pytest.fixture(scope="module")
def context():
    return PublicContext(select_bfv_parameters(max_contributors=5, vector_length=LENGTH, sum_bound=2**12))


def _slots(context, values):
    params = context.params
    slots = np.zeros(params.chunk_count * params.poly_modulus_degree, dtype=np.int64)
    data = params.digits.to_slots(values)
    slots[: data.size] = data
    return slots


def _round(context, hospitals=3, threshold=2, run="run-a", round_number=1):
    """Each hospital's values, unpacked upload and dealt shares, under this round's public polynomials."""
    public = otk.public_polynomials(context.params, run=run, round_number=round_number)
    rng = np.random.default_rng()
    values, uploads, shares = [], [], []
    for _ in range(hospitals):
        values.append(rng.integers(-1000, 1000, size=LENGTH))
        key = otk.OneTimeKey(context, threshold=threshold, parties=hospitals)
        uploads.append(otk.unpack_ring(context, key.encrypt(_slots(context, values[-1]), public), "upload"))
        shares.append(key.dealing.shares)
    return public, values, uploads, shares


def _decrypted(context, total, key, public):
    slots = otk.decrypt_sum(context, total, key, public)
    data_slots = context.params.digits.slots_for(LENGTH)
    otk.check_zero_slots(context, slots, data_slots)
    return context.params.digits.from_slots(slots[:data_slots], LENGTH)


def test_the_sum_decrypts_exactly_from_any_threshold_of_releases(context):
    q = context.params.ciphertext_modulus
    public, values, uploads, shares = _round(context, hospitals=4, threshold=3)
    total = otk.sum_uploads(context, uploads)
    releases = {j + 1: key_shares.release([dealt[j] for dealt in shares], q).share for j in range(4)}
    for subset in itertools.combinations(releases, 3):
        key = key_shares.rebuild({j: releases[j] for j in subset}, 3, q)
        np.testing.assert_array_equal(_decrypted(context, total, key, public), sum(values))


def test_an_upload_is_c0_alone(context):
    """One polynomial of ``ceil(log2 q)`` bits a coefficient for each ciphertext: ``a`` never travels."""
    public = otk.public_polynomials(context.params, run="run-a", round_number=1)
    key = otk.OneTimeKey(context, threshold=2, parties=3)
    upload = key.encrypt(_slots(context, np.zeros(LENGTH, dtype=np.int64)), public)
    size = context.params.poly_modulus_degree * context.params.ciphertext_modulus.bit_length() // 8
    assert len(upload) == context.params.chunk_count and all(
        len(chunk) == otk.key_share_bytes(context.params) == size for chunk in upload
    )


def test_a_key_encrypts_one_upload(context):
    public = otk.public_polynomials(context.params, run="run-a", round_number=1)
    key = otk.OneTimeKey(context, threshold=2, parties=3)
    key.encrypt(_slots(context, np.ones(LENGTH, dtype=np.int64)), public)
    with pytest.raises(BfvError, match="encrypts one upload"):
        key.encrypt(_slots(context, np.ones(LENGTH, dtype=np.int64)), public)
    # Two keys are two independent draws: the same values encrypt to unrelated uploads.
    first, second = (
        otk.OneTimeKey(context, threshold=2, parties=3).encrypt(
            _slots(context, np.ones(LENGTH, dtype=np.int64)), public
        )
        for _ in "ab"
    )
    assert first != second


def test_the_coalition_s_keys_open_the_honest_sum_and_no_single_upload(context):
    """Hospital 3 with the server: it knows its own key and values and the uploads; the sum's key
    less its own decrypts hospitals 1 and 2 together, and neither upload alone."""
    q = context.params.ciphertext_modulus
    public, values, uploads, shares = _round(context)
    releases = {j + 1: key_shares.release([dealt[j] for dealt in shares], q).share for j in range(3)}
    sum_key = key_shares.rebuild({1: releases[1], 2: releases[2]}, 2, q)
    own_key = key_shares.rebuild(
        {1: shares[2][0].share, 2: shares[2][1].share}, 2, q
    )  # hospital 3's own key, from its dealing
    honest_key = ((sum_key.astype(object) - own_key.astype(object)) % q).astype(np.uint64)
    honest = otk.sum_uploads(context, uploads[:2])
    np.testing.assert_array_equal(_decrypted(context, honest, honest_key, public), values[0] + values[1])
    for upload in uploads[:2]:
        with pytest.raises(BfvError, match="zero slots"):
            _decrypted(context, upload, honest_key, public)
        with pytest.raises(BfvError, match="zero slots"):  # its one share of the other's key, as if a key
            _decrypted(context, upload, shares[0][2].share, public)


def test_a_wrong_release_fails_the_zero_slots(context):
    q = context.params.ciphertext_modulus
    public, _, uploads, shares = _round(context)
    releases = {j + 1: key_shares.release([dealt[j] for dealt in shares], q).share for j in range(3)}
    releases[2] = releases[2].copy()
    releases[2][5] = (int(releases[2][5]) + 1) % q
    with pytest.raises(BfvError, match="zero slots"):
        _decrypted(
            context,
            otk.sum_uploads(context, uploads),
            key_shares.rebuild({1: releases[1], 2: releases[2]}, 2, q),
            public,
        )


def test_a_sum_shifted_by_the_server_decrypts_shifted_and_only_the_hashes_catch_it(context):
    """Adding Delta x needs no key: the zero slots cannot see it, the contributors' linear hashes do."""
    params, q = context.params, context.params.ciphertext_modulus
    public, values, uploads, shares = _round(context)
    total = otk.sum_uploads(context, uploads)
    shifted = total.copy()
    shifted[0, 7] = (int(shifted[0, 7]) + q // params.plain_modulus) % q
    releases = {j + 1: key_shares.release([dealt[j] for dealt in shares], q).share for j in range(2)}
    key = key_shares.rebuild(releases, 2, q)
    assert not np.array_equal(_decrypted(context, shifted, key, public), sum(values))
    hashes = LinearHash(bytes(32), modulus=q, label=b"upload")
    signed = [hashes.products(upload) for upload in uploads]
    expected = [sum(column) % q for column in zip(*signed)]
    assert hashes.products(total) == expected
    assert hashes.products(shifted) != expected


def test_public_polynomials_are_fixed_by_run_round_and_ciphertext(context):
    params = context.params
    a = otk.public_polynomials(params, run="run-a", round_number=3)
    assert a.shape == (params.chunk_count, params.poly_modulus_degree) and int(a.max()) < params.ciphertext_modulus
    np.testing.assert_array_equal(a, otk.public_polynomials(params, run="run-a", round_number=3))
    for other in (
        otk.public_polynomials(params, run="run-a", round_number=4),
        otk.public_polynomials(params, run="run-b", round_number=3),
    ):
        assert not np.array_equal(a, other)
    # A value's top bit set about half the time: uniform below q, not squeezed.
    assert 0.3 < np.mean(a >= np.uint64(params.ciphertext_modulus // 2)) < 0.7


def test_malformed_polynomials_and_thresholds_are_refused(context):
    size = otk.key_share_bytes(context.params)
    with pytest.raises(BfvError, match=f"must be {size} bytes"):
        otk.unpack_ring(context, [bytes(size - 1)], "release")
    with pytest.raises(BfvError, match="at or above the ciphertext modulus"):
        otk.unpack_ring(context, [b"\xff" * size], "release")
    for threshold, parties in ((1, 3), (4, 3)):
        with pytest.raises(BfvError, match="cannot be dealt"):
            otk.OneTimeKey(context, threshold=threshold, parties=parties)


def test_slots_that_wrap_modulo_t_sum_exactly(context):
    """SEAL scales by round(q m / t), where a plaintext's wrap vanishes modulo q: a sum of K slots of
    t - 1 decrypts to K (t - 1) mod t (with floor(q / t), the wrap would leave -(q mod t) per coefficient)."""
    params = context.params
    q, t, hospitals = params.ciphertext_modulus, params.plain_modulus, 5
    public = otk.public_polynomials(params, run="run-a", round_number=2)
    slots = np.zeros(params.chunk_count * params.poly_modulus_degree, dtype=np.int64)
    slots[: params.digits.slots_for(LENGTH)] = t - 1
    keys = [otk.OneTimeKey(context, threshold=2, parties=hospitals) for _ in range(hospitals)]
    total = otk.sum_uploads(context, [otk.unpack_ring(context, key.encrypt(slots, public), "upload") for key in keys])
    releases = {j + 1: key_shares.release([key.dealing.shares[j] for key in keys], q).share for j in range(2)}
    decrypted = otk.decrypt_sum(context, total, key_shares.rebuild(releases, 2, q), public)
    assert set(decrypted[: params.digits.slots_for(LENGTH)].tolist()) == {hospitals * (t - 1) % t}
