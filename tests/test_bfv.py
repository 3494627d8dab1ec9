import secrets

import numpy as np
import pytest
import tenseal.sealapi as seal

import crypto.bfv

from crypto.bfv import (
    BfvError,
    CiphertextSum,
    PublicContext,
    SecretContext,
    pack_words,
    unpack_words,
    aggregate_bytes,
    upload_bytes,
)
from crypto.bfv_parameters import select_bfv_parameters

RUN = "0123abcd"


@pytest.fixture(scope="module")
def secret(small_params):
    return SecretContext.generate(small_params, run_id=RUN)


@pytest.fixture(scope="module")
def public(small_params):
    return PublicContext(small_params)


def _names(count):
    return [f"hospital-{i}" for i in range(1, count + 1)]


def _sum_of(public, secret, vectors, round_number=1):
    total = CiphertextSum(public)
    names = _names(len(vectors))
    for vector, name in zip(vectors, names):
        total.add(secret.encrypt_update(vector, round_number=round_number, hospital=name))
    return secret.decrypt_sum(total.to_chunks(), round_number=round_number, contributors=names)


@pytest.mark.parametrize("contributors", [2, 10, "max"])
def test_encrypted_sum_equals_the_plaintext_sum(secret, public, small_params, contributors):
    count = small_params.max_contributors if contributors == "max" else contributors
    share = small_params.sum_bound // count
    vectors = np.random.default_rng(count).integers(
        -share, share, size=(count, small_params.vector_length), endpoint=True
    )
    assert np.array_equal(_sum_of(public, secret, vectors), vectors.sum(axis=0))


@pytest.mark.parametrize("seeded", [True, False])
def test_a_vector_over_several_ciphertexts_sums_exactly(seeded, monkeypatch):
    """Ciphertexts are packed and unpacked in batches (here of two, so the last is short): none may
    take another's coefficients."""
    monkeypatch.setattr(crypto.bfv, "_BATCH", 2)
    params = select_bfv_parameters(max_contributors=3, vector_length=5000, sum_bound=30_000)
    assert params.chunk_count == 3
    secret, public = SecretContext.generate(params, run_id=RUN), PublicContext(params)
    vectors = np.random.default_rng(3).integers(-10_000, 10_000, size=(3, params.vector_length), endpoint=True)
    total, names = CiphertextSum(public, seeded=seeded), _names(3)
    for vector, name in zip(vectors, names):
        total.add(secret.encrypt_update(vector, round_number=1, hospital=name, seeded=seeded))
    assert np.array_equal(
        secret.decrypt_sum(total.to_chunks(), round_number=1, contributors=names), vectors.sum(axis=0)
    )


@pytest.mark.parametrize("sign", [1, -1])
def test_the_largest_sums_stay_exact_at_max_contributors(secret, public, small_params, sign):
    """K_max contributions reaching the sum bound together: nothing is clamped, nothing wraps."""
    count = small_params.max_contributors
    vector = np.full(small_params.vector_length, sign * (small_params.sum_bound // count), dtype=np.int64)
    total = _sum_of(public, secret, [vector] * count)
    assert np.array_equal(total, count * vector)
    assert np.max(np.abs(total)) > small_params.sum_bound - count


def test_values_are_reduced_modulo_t_never_clamped(secret, public, small_params):
    t = small_params.plain_modulus
    vector = np.arange(small_params.vector_length, dtype=np.int64) * 7919 - 10 * t
    assert np.array_equal(_sum_of(public, secret, [vector, -vector + 3]), np.full(small_params.vector_length, 3))
    beyond = _sum_of(public, secret, [np.full(small_params.vector_length, t // 2 + 1, dtype=np.int64)])
    assert np.all(beyond == t // 2 + 1 - t)  # wraps into (-t/2, t/2], as a sum past the bound would


def test_only_integer_vectors_of_the_agreed_length_are_encrypted(secret, small_params):
    with pytest.raises(BfvError, match="integers"):
        secret.encrypt_update(np.ones(small_params.vector_length), round_number=1, hospital="hospital-1")
    with pytest.raises(BfvError, match="integers"):
        secret.encrypt_update(
            np.ones(small_params.vector_length - 1, dtype=np.int64), round_number=1, hospital="hospital-1"
        )


def test_a_sum_refuses_more_than_max_contributors(secret, public, small_params):
    chunks = secret.encrypt_update(
        np.zeros(small_params.vector_length, dtype=np.int64), round_number=1, hospital="hospital-1"
    )
    total = CiphertextSum(public)
    for _ in range(small_params.max_contributors):
        total.add(chunks)
    with pytest.raises(BfvError, match="most these parameters allow"):
        total.add(chunks)


def test_the_aggregator_holds_no_key(public):
    keys = (seal.SecretKey, seal.PublicKey, seal.RelinKeys, seal.GaloisKeys, seal.Encryptor, seal.Decryptor)
    assert not any(isinstance(value, keys) for value in vars(public).values())


def test_uploads_are_seeded_and_packed_below_float32(secret, small_params):
    chunks = secret.encrypt_update(
        np.zeros(small_params.vector_length, dtype=np.int64), round_number=1, hospital="hospital-1"
    )
    assert [len(chunk) for chunk in chunks] == [upload_bytes(small_params)] * small_params.chunk_count
    assert upload_bytes(small_params) < aggregate_bytes(small_params) / 1.9  # the second polynomial is a seed


@pytest.mark.parametrize("bits", range(1, 61))
def test_coefficients_are_packed_to_exactly_their_bits(bits):
    coefficients = [secrets.randbits(bits) for _ in range(64)]
    packed = sum(c << (i * bits) for i, c in enumerate(coefficients)).to_bytes(
        8 * bits, "little"
    )  # a bit string, by hand
    words = np.array(coefficients, dtype="<u8").tobytes()
    assert pack_words(words, bits) == packed
    assert unpack_words(packed, len(coefficients), bits) == words


def _other_uploads(small_params):
    other_params = select_bfv_parameters(max_contributors=500, vector_length=300, sum_bound=2_000_000)
    return SecretContext.generate(other_params, run_id=RUN).encrypt_update(
        np.ones(300, dtype=np.int64), round_number=1, hospital="hospital-1"
    )


def test_malformed_uploads_are_rejected_without_changing_the_sum(secret, public, small_params):
    good = secret.encrypt_update(
        np.ones(small_params.vector_length, dtype=np.int64), round_number=1, hospital="hospital-1"
    )
    size = upload_bytes(small_params)
    total = CiphertextSum(public)
    total.add(good)
    bad_inputs = [
        _other_uploads(small_params),
        [b"garbage" * 100] * small_params.chunk_count,
        good + good,  # wrong number of ciphertexts
        [b"\xff" * size] * small_params.chunk_count,  # every coefficient above q
        [b"\x00" * (size - 65) + b"\x07" + b"\x00" * 64] * small_params.chunk_count,  # an unknown PRNG type
        [b""] * small_params.chunk_count,
        ["text"] * small_params.chunk_count,
    ]
    for chunks in bad_inputs:
        with pytest.raises(BfvError):
            total.add(chunks)
    assert total.contributions == 1
    assert np.all(secret.decrypt_sum(total.to_chunks(), round_number=1, contributors=["hospital-1"]) == 1)


def _raw_contributions(public, secret, names, round_number=1, vector=None):
    vector = np.arange(public.params.vector_length, dtype=np.int64) if vector is None else vector
    return [public.load_upload(secret.encrypt_update(vector, round_number=round_number, hospital=n))[0] for n in names]


def _plaintext(public, coefficients):
    """The plaintext whose slots (its coefficients) are ``coefficients``: what a server can make, too."""
    with crypto.bfv._MemoryFile() as file:
        return public.load_plaintext(file, coefficients)


def _forge(public, ciphertexts, plain=None):
    total = seal.Ciphertext()
    public.evaluator.add_many(ciphertexts, total)
    if plain is not None:
        public.evaluator.add_plain_inplace(total, plain)
    return public.pack_aggregate([total])


@pytest.fixture(scope="module")
def packed_params():
    """Three values a slot and t above 2^32: the check slots' products span six bytes."""
    params = select_bfv_parameters(max_contributors=5, vector_length=12_000, sum_bound=20_000)
    assert params.values_per_slot == 3 and params.plain_modulus > 2**32 and params.chunk_count == 1
    return params


def test_several_values_a_slot_sum_exactly(packed_params):
    secret, public = SecretContext.generate(packed_params, run_id=RUN), PublicContext(packed_params)
    share = packed_params.sum_bound // 5
    vectors = np.random.default_rng(5).integers(-share, share, size=(5, packed_params.vector_length), endpoint=True)
    vectors[:, :3] = 0
    vectors[0, :3], vectors[1, :3] = [2**40, -(2**40), 2**50], [-(2**40) + 3, 2**40 - 3, 7 - 2**50]  # far out, sums in
    total = _sum_of(public, secret, vectors)
    assert np.array_equal(total, vectors.sum(axis=0)) and total[:3].tolist() == [3, -3, 7]


@pytest.mark.parametrize("packed", [False, True])
def test_a_dishonest_aggregate_is_refused(packed, secret, public, small_params, packed_params):
    """What a server holding every ciphertext can build: only the honest sum of the listed contributors decrypts."""
    if packed:
        small_params = packed_params
        secret, public = SecretContext.generate(packed_params, run_id=RUN), PublicContext(packed_params)
    assert small_params.chunk_count == 1
    data_slots = small_params.digits.slots_for(small_params.vector_length)
    vector = np.arange(small_params.vector_length) % (small_params.sum_bound // 3)
    names = _names(3)
    x1, x2, x3 = _raw_contributions(public, secret, names, vector=vector)
    (old2,) = _raw_contributions(public, secret, names[1:2], round_number=0, vector=vector)
    degree = small_params.poly_modulus_degree
    shift = _plaintext(public, np.eye(1, degree, 0, dtype=np.int64)[0])  # slot 0 plus one
    monomial = _plaintext(public, np.eye(1, degree, 1, dtype=np.int64)[0])  # x: every slot moves up one, the last wraps
    crt_mask = seal.Plaintext()  # t = 1 mod 2N: SEAL's batch encoder makes plaintexts that act slot-wise on the CRT
    encoder = seal.BatchEncoder(public.seal)
    encoder.encode([0] * data_slots + [1] * (encoder.slot_count() - data_slots), crt_mask)
    moved_x1, masked_x1, masked_x3 = seal.Ciphertext(), seal.Ciphertext(), seal.Ciphertext()
    public.evaluator.multiply_plain(x1, monomial, moved_x1)
    public.evaluator.multiply_plain(x1, crt_mask, masked_x1)
    public.evaluator.multiply_plain(x3, crt_mask, masked_x3)
    forgeries = {
        "3 Enc(x2)": _forge(public, [x2, x2, x2]),
        "a contributor left out": _forge(public, [x1, x2]),
        "a contributor counted twice": _forge(public, [x1, x2, x3, x3]),
        "a replayed contribution": _forge(public, [x1, old2, x3]),
        "a shifted sum": _forge(public, [x1, x2, x3], plain=shift),
        "a contribution's slots moved by one": _forge(public, [moved_x1, x2, x3]),
        "x2 behind the others multiplied by a CRT mask": _forge(public, [masked_x1, x2, masked_x3]),
    }
    honest = _forge(public, [x1, x2, x3])
    assert np.array_equal(secret.decrypt_sum(honest, round_number=1, contributors=names), 3 * vector)
    with pytest.raises(BfvError, match="listed twice"):
        secret.decrypt_sum(_forge(public, [x1, x1]), round_number=1, contributors=names[:1] * 2)
    for name, chunks in forgeries.items():
        with pytest.raises(BfvError, match="not one fresh contribution"):
            secret.decrypt_sum(chunks, round_number=1, contributors=names)
            pytest.fail(name)


@pytest.mark.parametrize("scale", [1, 2])
def test_a_check_slot_added_into_another_ciphertext_s_data_is_refused(scale):
    """A server's maps reach across an update's ciphertexts: here a contribution's last ciphertext,
    check slots and all, is multiplied by a constant into the data of its first. The data slots then
    carry tags the server cannot know, nor undo in the check slots (membership's argument)."""
    params = select_bfv_parameters(max_contributors=3, vector_length=5000, sum_bound=30_000)
    assert params.chunk_count == 3
    secret, public = SecretContext.generate(params, run_id=RUN), PublicContext(params)
    names = _names(3)
    uploads = [public.load_upload(secret.encrypt_update(np.full(5000, 7), round_number=1, hospital=n)) for n in names]

    def sums():
        totals = [seal.Ciphertext() for _ in range(params.chunk_count)]
        for position, total in enumerate(totals):
            public.evaluator.add_many([upload[position] for upload in uploads], total)
        return totals

    select = _plaintext(public, np.eye(1, params.poly_modulus_degree, 0, dtype=np.int64)[0] * scale)  # the constant
    leaked, forged = seal.Ciphertext(), sums()
    public.evaluator.multiply_plain(uploads[0][-1], select, leaked)
    public.evaluator.add_inplace(forged[0], leaked)
    assert np.all(secret.decrypt_sum(public.pack_aggregate(sums()), round_number=1, contributors=names) == 21)
    with pytest.raises(BfvError, match="not one fresh contribution"):
        secret.decrypt_sum(public.pack_aggregate(forged), round_number=1, contributors=names)


def test_transparent_and_arbitrary_aggregates_are_refused(secret, public, small_params):
    size = aggregate_bytes(small_params)
    half = size // 2
    ones = np.ones(small_params.vector_length, dtype=np.int64)
    forged = SecretContext.generate(small_params, run_id=RUN).encrypt_update(
        ones, round_number=1, hospital="hospital-1"
    )
    (other_key,) = public.pack_aggregate(public.load_upload(forged))
    (honest,) = public.pack_aggregate(
        public.load_upload(secret.encrypt_update(ones, round_number=1, hospital="hospital-1"))
    )
    q, bits = small_params.ciphertext_modulus, small_params.ciphertext_modulus.bit_length()
    coefficients = np.frombuffer(unpack_words(honest, 2 * small_params.poly_modulus_degree, bits), dtype="<u8")
    halved = [p * ((q + 1) // 2) % q for p in coefficients.tolist()]  # below the plaintext level: no slot-wise map
    assert np.array_equal(secret.decrypt_sum([honest], round_number=1, contributors=["hospital-1"]), ones)
    candidates = [
        [pack_words(np.array(halved, dtype="<u8").tobytes(), bits)],
        [b"\x00" * size],  # transparent: decrypts to c0 under any key
        [bytes(np.random.default_rng(1).integers(0, 256, half, dtype=np.uint8)) + b"\x00" * (size - half)],
        [other_key],  # a valid ciphertext under another key
        [b"\x00" * (size - 1)],
    ]
    for chunks in candidates:
        with pytest.raises(BfvError):
            secret.decrypt_sum(chunks, round_number=1, contributors=["hospital-1"])


def test_secrets_round_trip_and_garbage_is_refused(secret, small_params):
    copy = SecretContext.from_bytes(secret.to_bytes(), small_params, run_id=RUN)
    chunks = secret.encrypt_update(
        np.full(small_params.vector_length, 5, dtype=np.int64), round_number=1, hospital="hospital-1"
    )
    public = PublicContext(small_params)
    aggregate = public.pack_aggregate(public.load_upload(chunks))
    assert np.all(copy.decrypt_sum(aggregate, round_number=1, contributors=["hospital-1"]) == 5)
    for garbage in (b"", b"\x00" * 32, secret.to_bytes()[:-10], b"\x01" * 31 + secret.to_bytes()[32:]):
        with pytest.raises(BfvError):
            SecretContext.from_bytes(garbage, small_params, run_id=RUN)
    other = SecretContext.from_bytes(secret.to_bytes(), small_params, run_id="fedcba98")
    with pytest.raises(BfvError, match="not one fresh contribution"):
        other.decrypt_sum(aggregate, round_number=1, contributors=["hospital-1"])


@pytest.mark.parametrize("contributors, length", [(3, 1586), (10, 100_000), (100, 100_000), (100, 1_000_000)])
def test_an_upload_is_at_most_1_1_times_its_float32_size(contributors, length):
    """The default run (3 hospitals, 1586 parameters), and K_max up to 100 for larger models, with the
    default run's sum bound per contributor. (A small model at K = 10 fills 78% of its slots: 1.14x.)"""
    params = select_bfv_parameters(max_contributors=contributors, vector_length=length, sum_bound=8000 * contributors)
    assert params.chunk_count * upload_bytes(params) <= 1.1 * 4 * length


@pytest.mark.parametrize("nonzero", [0, 1, 1000, "all"])
def test_a_plaintext_s_coefficients_come_back_as_they_went_in(secret, small_params, nonzero):
    """Slots are plaintext coefficients: SEAL saves a decrypted plaintext without its highest zero
    coefficients, which must read back as zeros, not shift or shorten the slots."""
    degree, t = small_params.poly_modulus_degree, small_params.plain_modulus
    slots = np.zeros(degree, dtype=np.int64)
    count = degree if nonzero == "all" else nonzero
    slots[:count] = np.random.default_rng().integers(1, t, size=count)
    slots[0] = t - 1 if count else 0
    (chunk,) = secret.encrypt_slots(slots, seeded=False)
    np.testing.assert_array_equal(secret.decrypt_slots([chunk]), slots)


def test_a_slot_outside_the_plaintext_modulus_is_refused(secret, small_params):
    slots = np.zeros(small_params.poly_modulus_degree, dtype=np.int64)
    slots[5] = small_params.plain_modulus
    with pytest.raises(BfvError, match="not a plaintext for these parameters"):
        secret.encrypt_slots(slots)
