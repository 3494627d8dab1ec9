import numpy as np
import pytest
import tenseal as ts

from crypto.bfv import BfvError, CiphertextSum, PublicContext, SecretContext, max_ciphertext_bytes
from crypto.bfv_parameters import select_bfv_parameters
from crypto.fixed_point import FixedPointCodec


@pytest.fixture(scope="module")
def secret(small_params):
    return SecretContext.generate(small_params)


@pytest.fixture(scope="module")
def public(secret, small_params):
    return PublicContext(secret.public_bytes(), small_params)


def _sum_of(public, secret, vectors):
    total = CiphertextSum(public)
    for vector in vectors:
        total.add(secret.encrypt(vector).chunks)
    return secret.decrypt_sum(total.to_chunks())


@pytest.mark.parametrize("contributors", [2, 10, "max"])
def test_encrypted_sum_equals_the_plaintext_sum(secret, public, small_params, contributors):
    count = small_params.max_contributors if contributors == "max" else contributors
    rng = np.random.default_rng(count)
    bound = small_params.value_bound
    vectors = rng.uniform(-bound, bound, size=(count, small_params.vector_length))
    decrypted = _sum_of(public, secret, vectors)
    codec = FixedPointCodec(scale=small_params.scale, max_level=small_params.max_level)
    exact = codec.decode(sum(codec.encode(v).levels for v in vectors))
    assert decrypted.contributors == count
    assert np.array_equal(decrypted.total, exact)  # exactly the sum of the encodings
    assert np.max(np.abs(decrypted.total - vectors.sum(axis=0))) <= count / (2 * small_params.scale) + 1e-9


@pytest.mark.parametrize("sign", [1, -1])
def test_the_clamp_bound_summed_max_contributors_times_does_not_wrap(secret, public, small_params, sign):
    """Adds one ciphertext to itself: its noise adds up coherently, the worst case for decryption."""
    vector = np.full(small_params.vector_length, sign * 10 * small_params.value_bound)  # clamps to the bound
    encrypted = secret.encrypt(vector)
    assert encrypted.clamped == small_params.vector_length
    total = CiphertextSum(public)
    for _ in range(small_params.max_contributors):
        total.add(encrypted.chunks)
    decrypted = secret.decrypt_sum(total.to_chunks())
    expected_levels = sign * small_params.max_level * small_params.max_contributors
    assert decrypted.contributors == small_params.max_contributors
    assert np.all(np.rint(decrypted.total * small_params.scale) == expected_levels)


def test_a_sum_refuses_more_than_max_contributors(secret, public, small_params):
    chunks = secret.encrypt(np.zeros(small_params.vector_length)).chunks
    total = CiphertextSum(public)
    for _ in range(small_params.max_contributors):
        total.add(chunks)
    with pytest.raises(BfvError, match="most these parameters allow"):
        total.add(chunks)


def test_the_aggregator_can_neither_decrypt_nor_encrypt(secret, public, small_params):
    chunks = secret.encrypt(np.ones(small_params.vector_length)).chunks
    vector = public.load_chunks(chunks)[0]
    with pytest.raises(ValueError, match="secret"):
        vector.decrypt()
    server_context = ts.context_from(secret.public_bytes())
    assert not server_context.has_secret_key()
    with pytest.raises(ValueError):
        ts.bfv_vector(server_context, [1, 2, 3])


def test_the_aggregator_refuses_a_context_carrying_the_secret_key(secret, small_params):
    with pytest.raises(BfvError, match="must never hold it"):
        PublicContext(secret.to_bytes(), small_params)


def test_contexts_of_other_parameters_are_refused(secret):
    other = select_bfv_parameters(max_contributors=500, vector_length=300, value_bound=4.0, precision=1e-3)
    with pytest.raises(BfvError, match="does not match the agreed parameters"):
        PublicContext(secret.public_bytes(), other)
    with pytest.raises(BfvError, match="not a TenSEAL context"):
        PublicContext(b"not a context", other)


def test_ciphertexts_from_another_context_or_garbage_are_rejected_without_changing_the_sum(secret, public, small_params):
    other_params = select_bfv_parameters(max_contributors=500, vector_length=300, value_bound=4.0, precision=1e-3)
    foreign = SecretContext.generate(other_params).encrypt(np.ones(300)).chunks
    good = secret.encrypt(np.ones(small_params.vector_length)).chunks
    total = CiphertextSum(public)
    total.add(good)
    bad_inputs = [
        foreign,
        [b"garbage" * 100] * small_params.chunk_count,
        good + good,  # wrong number of ciphertexts
        [b"\x00" * (max_ciphertext_bytes(small_params) + 1)] * small_params.chunk_count,
        ["text"] * small_params.chunk_count,
    ]
    for chunks in bad_inputs:
        with pytest.raises(BfvError):
            total.add(chunks)
    assert total.contributions == 1
    decrypted = secret.decrypt_sum(total.to_chunks())
    assert decrypted.contributors == 1
    assert np.allclose(decrypted.total, 1.0)


def test_a_sum_made_under_another_key_is_detected(secret, small_params):
    """Same parameters, different secret key: the server cannot tell, the count slot can."""
    impostor = SecretContext.generate(small_params)
    chunks = impostor.encrypt(np.ones(small_params.vector_length)).chunks
    try:
        decrypted = secret.decrypt_sum(chunks)
    except BfvError:
        return
    assert decrypted.contributors != 1  # the hospital compares this with the server's claim


def test_secret_context_round_trip_keeps_the_key(secret, small_params):
    copy = SecretContext.from_bytes(secret.to_bytes(), small_params)
    chunks = secret.encrypt(np.full(small_params.vector_length, 0.5)).chunks
    assert np.allclose(copy.decrypt_sum(chunks).total, 0.5)
    with pytest.raises(BfvError, match="no secret key"):
        SecretContext.from_bytes(secret.public_bytes(), small_params)


@pytest.mark.parametrize("contributors", [3, 10, 100])
@pytest.mark.parametrize("length", [1586, 2047])
def test_an_encrypted_update_is_at_most_three_times_its_float32_size(contributors, length):
    """The design's budget: at most 3x float32 on the wire at K_max <= 100 (TenSEAL's defaults give 5.4x)."""
    params = select_bfv_parameters(max_contributors=contributors, vector_length=length, value_bound=2.5, precision=1.25e-3)
    encrypted = SecretContext.generate(params).encrypt(np.random.default_rng(0).uniform(-2.5, 2.5, length))
    assert sum(len(c) for c in encrypted.chunks) <= 3 * 4 * length
