import numpy as np
import pytest
import tenseal as ts

from crypto.bfv import BfvError, CiphertextSum, PublicContext, SecretContext, max_ciphertext_bytes
from crypto.bfv_parameters import select_bfv_parameters


@pytest.fixture(scope="module")
def secret(small_params):
    return SecretContext.generate(small_params)


@pytest.fixture(scope="module")
def public(secret, small_params):
    return PublicContext(secret.public_bytes(), small_params)


def _sum_of(public, secret, vectors):
    total = CiphertextSum(public)
    for vector in vectors:
        total.add(secret.encrypt(vector))
    return secret.decrypt_sum(total.to_chunks())


@pytest.mark.parametrize("contributors", [2, 10, "max"])
def test_encrypted_sum_equals_the_plaintext_sum(secret, public, small_params, contributors):
    count = small_params.max_contributors if contributors == "max" else contributors
    share = small_params.sum_bound // count
    vectors = np.random.default_rng(count).integers(-share, share, size=(count, small_params.vector_length), endpoint=True)
    decrypted = _sum_of(public, secret, vectors)
    assert decrypted.contributors == count
    assert np.array_equal(decrypted.total, vectors.sum(axis=0))


@pytest.mark.parametrize("sign", [1, -1])
def test_the_largest_sums_stay_exact_at_max_contributors(secret, public, small_params, sign):
    """K_max contributions reaching the sum bound together: nothing is clamped, nothing wraps.

    One ciphertext added to itself: its noise adds up coherently, the worst case for decryption."""
    count = small_params.max_contributors
    vector = np.full(small_params.vector_length, sign * (small_params.sum_bound // count), dtype=np.int64)
    chunks = secret.encrypt(vector)
    total = CiphertextSum(public)
    for _ in range(count):
        total.add(chunks)
    decrypted = secret.decrypt_sum(total.to_chunks())
    assert decrypted.contributors == count
    assert np.array_equal(decrypted.total, count * vector)
    assert np.max(np.abs(decrypted.total)) > small_params.sum_bound - count


def test_values_are_reduced_modulo_t_never_clamped(secret, public, small_params):
    t = small_params.plain_modulus
    vector = np.arange(small_params.vector_length, dtype=np.int64) * 7919 - 10 * t
    decrypted = _sum_of(public, secret, [vector, -vector + 3])
    assert np.array_equal(decrypted.total, np.full(small_params.vector_length, 3))
    beyond = secret.decrypt_sum(secret.encrypt(np.full(small_params.vector_length, t // 2 + 1, dtype=np.int64)))
    assert np.all(beyond.total == t // 2 + 1 - t)  # wraps into (-t/2, t/2], as a sum past the bound would


def test_only_integer_vectors_of_the_agreed_length_are_encrypted(secret, small_params):
    with pytest.raises(BfvError, match="integers"):
        secret.encrypt(np.ones(small_params.vector_length))
    with pytest.raises(BfvError, match="integers"):
        secret.encrypt(np.ones(small_params.vector_length - 1, dtype=np.int64))


def test_a_sum_refuses_more_than_max_contributors(secret, public, small_params):
    chunks = secret.encrypt(np.zeros(small_params.vector_length, dtype=np.int64))
    total = CiphertextSum(public)
    for _ in range(small_params.max_contributors):
        total.add(chunks)
    with pytest.raises(BfvError, match="most these parameters allow"):
        total.add(chunks)


def test_the_aggregator_can_neither_decrypt_nor_encrypt(secret, public, small_params):
    chunks = secret.encrypt(np.ones(small_params.vector_length, dtype=np.int64))
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
    other = select_bfv_parameters(max_contributors=500, vector_length=300, sum_bound=2_000_000)
    with pytest.raises(BfvError, match="does not match the agreed parameters"):
        PublicContext(secret.public_bytes(), other)
    with pytest.raises(BfvError, match="not a TenSEAL context"):
        PublicContext(b"not a context", other)


def test_ciphertexts_from_another_context_or_garbage_are_rejected_without_changing_the_sum(secret, public, small_params):
    other_params = select_bfv_parameters(max_contributors=500, vector_length=300, sum_bound=2_000_000)
    foreign = SecretContext.generate(other_params).encrypt(np.ones(300, dtype=np.int64))
    good = secret.encrypt(np.ones(small_params.vector_length, dtype=np.int64))
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
    assert np.all(decrypted.total == 1)


def test_a_sum_made_under_another_key_is_detected(secret, small_params):
    """Same parameters, different secret key: the server cannot tell, the count slot can."""
    impostor = SecretContext.generate(small_params)
    chunks = impostor.encrypt(np.ones(small_params.vector_length, dtype=np.int64))
    try:
        decrypted = secret.decrypt_sum(chunks)
    except BfvError:
        return
    assert decrypted.contributors != 1  # the hospital compares this with the server's claim


def test_secret_context_round_trip_keeps_the_key(secret, small_params):
    copy = SecretContext.from_bytes(secret.to_bytes(), small_params)
    chunks = secret.encrypt(np.full(small_params.vector_length, 5, dtype=np.int64))
    assert np.all(copy.decrypt_sum(chunks).total == 5)
    with pytest.raises(BfvError, match="no secret key"):
        SecretContext.from_bytes(secret.public_bytes(), small_params)


@pytest.mark.parametrize("contributors", [3, 10])
@pytest.mark.parametrize("length", [1586, 2047])
def test_an_encrypted_update_is_at_most_three_times_its_float32_size(contributors, length):
    """At most 3x float32 on the wire at K_max <= 10, with the default run's sum bound per contributor.

    (At K = 100 the sum needs a 34-bit ciphertext modulus: 5 bytes a coefficient, 3.4x.)"""
    params = select_bfv_parameters(max_contributors=contributors, vector_length=length, sum_bound=8000 * contributors)
    t = params.sum_bound // contributors
    chunks = SecretContext.generate(params).encrypt(np.random.default_rng(0).integers(-t, t, length))
    assert sum(len(c) for c in chunks) <= 3 * 4 * length
