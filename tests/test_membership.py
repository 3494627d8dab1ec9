"""Check slots: the inner products are exact modulo t whatever t's size, and a sum verifies only as itself."""

from fractions import Fraction

import numpy as np
import pytest

from crypto.membership import CheckKey, MembershipError, check_slot_count


@pytest.mark.parametrize("plain_modulus", [12289, 40353793, 4294957057])  # 14, 26 and 32 bits (one product a block)
def test_check_slots_are_the_inner_products_and_tags_modulo_t(plain_modulus):
    key = CheckKey.generate(run_id="0123456789abcdef", plain_modulus=plain_modulus)
    values = np.random.default_rng().integers(0, plain_modulus, size=5000)
    slots = key.append(values, round_number=3, hospital="hospital-1")
    np.testing.assert_array_equal(slots[:5000], values)
    # The same coefficients and tag, in Python integers: no overflow can hide there.
    tags = key._tags(3, "hospital-1")
    for l, (check, tag) in enumerate(zip(slots[5000:], tags)):
        a = key._uniform(b"coefficients|3|%d" % l, 5000)
        assert a.max() < plain_modulus
        assert int(check) == (sum(int(p) * int(q) for p, q in zip(a, values)) + int(tag)) % plain_modulus


@pytest.mark.parametrize("plain_modulus, slots", [(65537, 9), (1073153, 7), (40353793, 6), (4294957057, 5)])
def test_check_slots_are_just_enough_for_2_to_the_minus_128(plain_modulus, slots):
    """Each slot passes a forgery with probability p = 1/t + 2^-32. At t = 65537, p is just above 2^-16:
    eight slots, what a rounded logarithm gives, are one too few."""
    p = Fraction(1, plain_modulus) + Fraction(1, 2**32)
    assert check_slot_count(plain_modulus) == slots
    assert p**slots <= Fraction(1, 2**128) < p ** (slots - 1)


def test_a_sum_verifies_for_its_contributors_only():
    key = CheckKey.generate(run_id="0123456789abcdef", plain_modulus=40353793)
    rng = np.random.default_rng()
    first, second = rng.integers(-1000, 1000, size=300), rng.integers(-1000, 1000, size=300)
    total = key.append(first, round_number=1, hospital="a") + key.append(second, round_number=1, hospital="b")
    np.testing.assert_array_equal(key.verify(total, round_number=1, contributors=["a", "b"]), np.mod(first + second, 40353793))
    for contributors, round_number in ((["a"], 1), (["a", "b", "c"], 1), (["a", "b"], 2), (["a", "a"], 1)):
        with pytest.raises(MembershipError):
            key.verify(total, round_number=round_number, contributors=contributors)


@pytest.mark.parametrize(
    "t, known",
    [
        (40353793, [4767385, 26840940, 19068501, 27445837, 21373067, 256444]),
        (4294957057, [507405101, 2856749185, 2029509236, 2921130394, 2274789797]),  # w t near 2^64
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
    slots = key.append(values, round_number=7, hospital="hospital-2")[10:]
    assert slots.tolist() == known

    def stream(label: bytes, size: int) -> list[int]:
        digest = hmac.new(bytes(range(32)), b"consilium/check-slots/v3|0123456789abcdef|" + label, hashlib.sha256).digest()
        keystream = Cipher(algorithms.ChaCha20(digest, bytes(16)), mode=None).encryptor().update(bytes(4 * size))
        return [int.from_bytes(keystream[4 * i : 4 * i + 4], "little") * t >> 32 for i in range(size)]

    tags = stream(b"tags|7|hospital-2", len(known))
    for l, slot in enumerate(slots):
        a = stream(b"coefficients|7|%d" % l, 10)
        assert int(slot) == (sum(x * (int(v) % t) for x, v in zip(a, values)) + tags[l]) % t
    assert stream(b"coefficients|7|0", 10) != stream(b"coefficients|7|1", 10) != stream(b"coefficients|8|0", 10)


def test_a_composite_or_oversized_plaintext_modulus_is_refused():
    """The soundness argument needs t prime (a product with a nonzero error coordinate is then uniform)."""
    for modulus in (2**31, 65537 * 3, 2**32 + 15, 2):
        with pytest.raises(MembershipError):
            CheckKey.generate(run_id="0123456789abcdef", plain_modulus=modulus)
