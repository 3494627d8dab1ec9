"""Check slots: the inner products are exact modulo t whatever t's size, and a sum verifies only as itself."""

import numpy as np
import pytest

from crypto.membership import CheckKey, MembershipError, check_slot_count


def test_check_slots_are_the_products_and_tags_modulo_t():
    plain_modulus = 40353793
    key = CheckKey.generate(run_id="0123456789abcdef", plain_modulus=plain_modulus)
    values = np.random.default_rng().integers(0, plain_modulus, size=30_000)
    slots = _with_checks(key, values, round_number=3, hospital="hospital-1")
    np.testing.assert_array_equal(slots[: values.size], values)
    products, tags = key.products(values, round_number=3), key._tags(3, "hospital-1")
    assert len(products) == len(tags) == check_slot_count(plain_modulus)
    for check, product, tag in zip(slots[values.size :], products, tags):
        assert 0 <= tag < plain_modulus and int(check) == (product + tag) % plain_modulus
    assert key.products(values, round_number=4) != products  # each round its own coefficients


def test_a_sum_verifies_for_its_contributors_only():
    t = 40353793
    key = CheckKey.generate(run_id="0123456789abcdef", plain_modulus=t)
    rng = np.random.default_rng()
    first, second = rng.integers(-1000, 1000, size=300), rng.integers(-1000, 1000, size=300)
    total = np.mod(
        _with_checks(key, first, round_number=1, hospital="a")
        + _with_checks(key, second, round_number=1, hospital="b"),
        t,
    )
    values, checks = total[:300], total[300:]
    np.testing.assert_array_equal(values, np.mod(first + second, t))

    def verify(round_number, contributors):
        products = key.products(values, round_number=round_number)
        key.verify(checks, products=products, round_number=round_number, contributors=contributors)

    verify(1, ["a", "b"])
    for contributors, round_number in ((["a"], 1), (["a", "b", "c"], 1), (["a", "b"], 2), (["a", "a"], 1)):
        with pytest.raises(MembershipError):
            verify(round_number, contributors)


def test_a_vector_s_products_are_the_sums_of_its_pieces_products():
    """What lets crypto workers each take a piece: the keystream entered at a piece's first slot."""
    t = 1114517667841
    key = CheckKey.generate(run_id="0123456789abcdef", plain_modulus=t)
    values = np.random.default_rng().integers(0, t, size=10_000)
    whole = key.products(values, round_number=2)
    cuts = [0, 4096, 8192, 10_000]
    pieces = [key.products(values[a:b], round_number=2, first=a) for a, b in zip(cuts, cuts[1:])]
    assert [sum(parts) % t for parts in zip(*pieces)] == whole
    assert key.products(values[4096:], round_number=2, first=4096) != key.products(values[4096:], round_number=2)
    with pytest.raises(ValueError, match="block"):
        key.products(values[10:], round_number=2, first=10)


KNOWN_26_BITS = [32707918, 25259624, 31772055, 3033086, 567833, 8790523]
KNOWN_32_BITS = [3481187214, 2688446223, 3381580600, 322818549, 60435991]
KNOWN_41_BITS = [253576544700, 736068169042, 773972711602, 997101285351]


@pytest.mark.parametrize(
    "t, known",
    [
        (40353793, KNOWN_26_BITS),
        (4294957057, KNOWN_32_BITS),  # coefficients: w r near 2^64
        (1114517667841, KNOWN_41_BITS),  # coefficients are the words themselves
    ],
)
def test_the_check_slots_are_pinned_to_their_derivation(t, known):
    """Known answers, and every slot recomputed from the module docstring's derivation in Python
    integers: a change to the labels, the key derivation or the mapping to Z_t changes them."""
    import hashlib
    import hmac

    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    values = np.arange(-5, 5)  # t - 5 to 4 modulo t
    key = CheckKey(bytes(range(32)), run_id="0123456789abcdef", plain_modulus=t)
    slots = _with_checks(key, values, round_number=7, hospital="hospital-2")[10:]
    assert slots.tolist() == known

    def stream(key: bytes, label: bytes, size: int, bits: int, modulus: int) -> list[int]:
        digest = hmac.new(key, label, hashlib.sha256).digest()
        keystream = (
            Cipher(algorithms.ChaCha20(digest, bytes(16)), mode=None).encryptor().update(bytes(bits // 8 * size))
        )
        words = [int.from_bytes(keystream[i : i + bits // 8], "little") for i in range(0, len(keystream), bits // 8)]
        return [word * modulus >> bits for word in words]

    labelled = lambda label: b"consilium/check-slots/v6|0123456789abcdef|" + label  # noqa: E731
    seed = hmac.new(bytes(range(32)), labelled(b"coefficients|7"), hashlib.sha256).digest()

    def coefficients(l: int, seed: bytes = seed) -> list[int]:
        return stream(seed, b"coefficients|%d" % l, 10, 32, min(t, 2**32))

    tags = stream(bytes(range(32)), labelled(b"tags|7|hospital-2"), len(known), 256, t)
    for l, slot in enumerate(slots):
        a = coefficients(l)
        assert int(slot) == (sum(x * (int(v) % t) for x, v in zip(a, values)) + tags[l]) % t
    other_round = hmac.new(bytes(range(32)), labelled(b"coefficients|8"), hashlib.sha256).digest()
    assert coefficients(0) != coefficients(1) != coefficients(0, other_round)


def test_a_composite_or_oversized_plaintext_modulus_is_refused():
    """The soundness argument needs t prime (a product with a nonzero error coordinate is then uniform)."""
    for modulus in (2**31, 65537 * 3, 2**61 - 1, 2):
        with pytest.raises(MembershipError):
            CheckKey.generate(run_id="0123456789abcdef", plain_modulus=modulus)


def _with_checks(key: CheckKey, values: np.ndarray, *, round_number: int, hospital: str) -> np.ndarray:
    """A vector modulo t followed by its check slots: what one hospital encrypts."""
    reduced = np.mod(values, key._t)
    products = key.products(reduced, round_number=round_number)
    return np.concatenate([reduced, key.check_slots(products, round_number=round_number, hospital=hospital)])
