"""BFV parameters computed from what the sum must hold.

Each contributor encrypts a vector of integers with BFV and the aggregator adds up to ``K``
ciphertexts. Slots hold integers modulo the plaintext modulus ``t``: the sum is reduced mod ``t``,
never clamped. Two failures would corrupt it silently; both are ruled out here by construction:

1. **Wrap-around modulo t.** ``crypto.slot_digits`` puts ``k`` values in a slot as the digits of
   one integer in balanced base ``M = 2 S + 1``, and reads a sum back exactly when every summed value
   lies in ``[-S, S]`` and ``t >= M^k``. The caller states ``S``
   (``training.privacy.skellam.SkellamMechanism.sum_bound`` for Dopamine). ``k = 1`` is one value a slot,
   read in ``(-t/2, t/2]``.

2. **Decryption failure.** A fresh symmetric BFV ciphertext of ``m`` satisfies
   ``c0 + c1 s = round(q m / t) - e (mod q)`` where ``e`` is SEAL's centred-binomial error: in each
   coefficient the difference of two sums of 21 fair bits, independently. Adding ``K`` ciphertexts
   adds the errors, so in each coefficient the summed error is exactly ``E = B - 21 K`` with
   ``B ~ Binomial(42 K, 1/2)``, plus at most ``K/2`` of rounding (the ``q * floor(sum / t)`` from
   plaintext wrap vanishes mod ``q``). Decryption is exact while ``K/2 + |E| < q / (2t)``. Let
   ``a_K`` be the smallest integer with ``P(|E| >= a_K) <= 2^-40 / n`` over the ``n`` coefficients
   of the sum, by a bound within a few percent of the exact binomial tail; then no coefficient fails, except with
   probability ``2^-40`` a round (union bound), when ``q >= t (K + 2 a_K)``, where ``q`` is the
   ciphertext modulus (the coefficient modulus without SEAL's special prime). The tail is what keeps
   ``q`` small for many contributors: ``a_K`` is 264 to 295 at ``K = 100`` (by the number of coefficients)
   where the worst case is 2,100. If it ever failed, the garbled sum would fail its zero slots: the
   hospitals would refuse it, never use it decrypted wrongly.

``t`` is prime (the zero slots' count is a linear hash's modulo ``t``: ``zero_slot_count``) and ``= 1 (mod 2N)``, the form SEAL's batching
needs. Slots are plaintext coefficients now (``crypto.bfv``), so that form is no longer needed; it
is kept so that the parameters every committed result was measured with stay the same. SEAL's NTT
needs ``= 1 (mod 2N)`` of each prime of the coefficient modulus. SEAL keeps the last prime as the "special" prime of key switching; nobody here
switches keys (no party holds a relinearisation or Galois key), so it only has to exist and keep the
total within the 128-bit security bound for ``N`` (HomomorphicEncryption.org standard, as enforced
by SEAL). Ciphertexts live below it, at the data level.

Among the polynomial degrees and values per slot that satisfy all of this, the pair that
minimises the bytes of the encrypted vector wins (fewer ciphertexts on a tie). ``crypto/bfv.py``
packs each coefficient into ``ceil(log2 q)`` bits, which is why ``q`` is kept as small as the bounds
allow. A value costs about ``log2 M + log2(K + 2 a_K) / k`` bits, so more values a slot cost fewer
bytes and, above all, fewer ciphertexts: every ciphertext is an encryption, a transfer, an addition
and a decryption, so at ``k = 2`` a round's cryptography takes about half the time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from consilium.errors import ConsiliumError
from consilium.crypto.linear_hash import challenge_count
from consilium.crypto.primes import is_prime
from consilium.crypto.slot_digits import SlotDigits

__all__ = ["BfvParameters", "ParameterError", "select_bfv_parameters"]

_FRESH_ERROR_BITS = 21  # SEAL 4's centred binomial error: the difference of two sums of 21 fair bits
_DECRYPTION_FAILURE_LOG_PROBABILITY = -40 * math.log(2)  # a round, over every coefficient of the sum
_MAX_PRIME_BITS = 60  # SEAL's limit for each prime
MAX_PLAIN_MODULUS_BITS = 60  # SEAL's largest plaintext modulus
_MAX_SUM_BOUND_BITS = 31  # a summed value fits an int32, the plaintext benchmark's word (crypto.insecure_plaintext)
_MIN_SPECIAL_PRIME_BITS = 20
# Largest total coefficient-modulus bits at 128-bit classical security (SEAL's CoeffModulus::MaxBitCount).
_MAX_COEFF_MODULUS_BITS = {2048: 54, 4096: 109, 8192: 218, 16384: 438, 32768: 881}


class ParameterError(ConsiliumError, ValueError):
    """No BFV parameters can hold the requested sum."""


@dataclass(frozen=True)
class BfvParameters:
    """A BFV parameter set together with the sums it was sized for."""

    poly_modulus_degree: int
    plain_modulus: int
    ciphertext_modulus: int
    coeff_mod_bit_sizes: tuple[int, int]  # (ciphertext prime, special prime), as TenSEAL takes them
    sum_bound: int  # S: every coordinate of a sum lies in [-S, S], so it never wraps mod t
    vector_length: int
    max_contributors: int  # K_max: the most ciphertexts whose sum stays exact
    values_per_slot: int  # k: digits base 2 S + 1 in each slot (crypto.slot_digits)

    @property
    def digits(self) -> SlotDigits:
        return SlotDigits(base=2 * self.sum_bound + 1, per_slot=self.values_per_slot, modulus=self.plain_modulus)

    @property
    def slot_count(self) -> int:
        """The vector's slots, then the zero slots (``zero_slot_count``)."""
        return _slot_count(self.digits, self.vector_length)

    @property
    def chunk_count(self) -> int:
        return _chunk_count(self.digits, self.vector_length, self.poly_modulus_degree)

    def slots_of(self, values: np.ndarray) -> np.ndarray:
        """The slots of every chunk that carry ``vector_length`` integers: their digits, then zeros."""
        slots = np.zeros(self.chunk_count * self.poly_modulus_degree, dtype=np.int64)
        digits = self.digits.to_slots(values)
        slots[: digits.size] = digits
        return slots

    def values_of(self, slots: np.ndarray) -> np.ndarray:
        """The ``vector_length`` integers that a decrypted sum's ``slots`` carry (``slots_of``'s inverse)."""
        return self.digits.from_slots(slots[: self.digits.slots_for(self.vector_length)], self.vector_length)

    def to_dict(self) -> dict:
        return {
            "poly_modulus_degree": self.poly_modulus_degree,
            "plain_modulus": self.plain_modulus,
            "ciphertext_modulus": self.ciphertext_modulus,
            "coeff_mod_bit_sizes": list(self.coeff_mod_bit_sizes),
            "sum_bound": self.sum_bound,
            "vector_length": self.vector_length,
            "max_contributors": self.max_contributors,
            "values_per_slot": self.values_per_slot,
            "chunk_count": self.chunk_count,
        }


def select_bfv_parameters(
    *, max_contributors: int, vector_length: int, sum_bound: int, key_shares: int = 0
) -> BfvParameters:
    """The smallest-on-the-wire BFV parameters that sum ``max_contributors`` vectors exactly.

    ``sum_bound`` bounds every coordinate of the summed vector (zero slots are read modulo t).
    ``key_shares`` is the number of polynomials of ``R_q`` that travel with each upload besides its
    ciphertexts (a one-time key's shares, one per hospital: ``crypto.one_time_keys``): they count in
    its size, which favours a smaller ``N``. Raises ``ParameterError`` when no parameter set within
    SEAL's limits can hold the sum.
    """
    if max_contributors < 1:
        raise ParameterError(f"max_contributors must be at least 1, got {max_contributors}")
    if vector_length < 1:
        raise ParameterError(f"vector_length must be at least 1, got {vector_length}")
    if not 1 <= sum_bound < 2**_MAX_SUM_BOUND_BITS:
        raise ParameterError(f"sum_bound must be between 1 and 2^{_MAX_SUM_BOUND_BITS}, got {sum_bound}")
    if key_shares < 0:
        raise ParameterError(f"key_shares must be at least 0, got {key_shares}")

    candidates = []
    failures = []
    for degree in _MAX_COEFF_MODULUS_BITS:
        per_slot = 1
        while (2 * sum_bound + 1) ** per_slot < 2**MAX_PLAIN_MODULUS_BITS:
            try:
                candidates.append(_parameters_for_degree(degree, per_slot, max_contributors, vector_length, sum_bound))
            except ParameterError as error:
                failures.append(str(error))
            per_slot += 1
    if not candidates:
        raise ParameterError(
            f"cannot sum {max_contributors} vectors whose sum is bounded by {sum_bound}: {failures[0]}; "
            "lower the bound or the number of contributors"
        )
    return min(candidates, key=lambda p: (_upload_bits(p, key_shares), p.chunk_count))


def _parameters_for_degree(
    degree: int, per_slot: int, contributors: int, vector_length: int, sum_bound: int
) -> BfvParameters:
    base = 2 * sum_bound + 1
    plain_modulus = _smallest_batching_prime_at_least(base**per_slot, degree)
    if plain_modulus.bit_length() > MAX_PLAIN_MODULUS_BITS:
        raise ParameterError(
            f"the plaintext modulus would need {plain_modulus.bit_length()} bits (max {MAX_PLAIN_MODULUS_BITS})"
        )

    digits = SlotDigits(base=base, per_slot=per_slot, modulus=plain_modulus)
    coefficients = _chunk_count(digits, vector_length, degree) * degree
    needed = plain_modulus * (contributors + 2 * _decryption_error_bound(contributors, coefficients))
    bits = needed.bit_length()
    while True:
        if bits > _MAX_PRIME_BITS:
            raise ParameterError(f"the ciphertext modulus would need {bits} bits (max {_MAX_PRIME_BITS})")
        special_bits = min(bits, _MAX_COEFF_MODULUS_BITS[degree] - bits)
        if special_bits < _MIN_SPECIAL_PRIME_BITS:
            raise ParameterError(f"a {bits}-bit ciphertext modulus leaves no room for the special prime at N={degree}")
        ciphertext_modulus, special_prime = _seal_coeff_modulus(degree, (bits, special_bits))
        if ciphertext_modulus >= needed:
            break
        bits += 1
    if plain_modulus in (ciphertext_modulus, special_prime):  # both are primes = 1 mod 2N near a power of two
        raise ParameterError(f"the plaintext modulus {plain_modulus} is one of SEAL's coefficient primes at N={degree}")

    return BfvParameters(
        poly_modulus_degree=degree,
        plain_modulus=plain_modulus,
        ciphertext_modulus=ciphertext_modulus,
        coeff_mod_bit_sizes=(bits, special_bits),
        sum_bound=sum_bound,
        vector_length=vector_length,
        max_contributors=contributors,
        values_per_slot=per_slot,
    )


def _decryption_error_bound(contributors: int, coefficients: int) -> int:
    """The smallest ``a`` with ``P(|E| >= a) <= 2^-40 / coefficients`` by the tail bound below, for ``E``
    the summed fresh error of ``contributors`` ciphertexts in one coefficient.

    ``E = B - m`` with ``B ~ Binomial(2 m, 1/2)`` and ``m = 21 K``, so ``P(|E| >= a) = 2 P(B >= m + a)``.
    The terms ``C(2m, k)`` of that tail shrink by the ratio ``r_k = (2m - k) / (k + 1)``, itself
    decreasing in ``k``, so the tail is at most its first term times ``1 / (1 - r_{m+a})``: within a few
    percent of the exact sum, and computable in O(1) with ``lgamma``, so ``a`` is found by bisection.
    """
    half = _FRESH_ERROR_BITS * contributors
    log_budget = _DECRYPTION_FAILURE_LOG_PROBABILITY - math.log(2 * coefficients)

    def log_tail_bound(error: int) -> float:
        successes = half + error
        log_first = math.lgamma(2 * half + 1) - math.lgamma(successes + 1) - math.lgamma(2 * half - successes + 1)
        ratio = (half - error) / (successes + 1)
        return log_first - 2 * half * math.log(2) - math.log1p(-ratio)

    low, high = 0, half + 1  # P(|E| >= half + 1) = 0 meets any budget
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if log_tail_bound(middle) <= log_budget else (middle, high)
    return high


def zero_slot_count(plain_modulus: int) -> int:
    """The slots after the data that every upload leaves at 0 (``crypto.one_time_keys``): a sum's key
    rebuilt wrong leaves each uniform modulo ``t``, and this many all read 0 with probability at most
    ``2^-128`` (as many as a linear hash modulo ``t`` has challenges: ``crypto.linear_hash``)."""
    return challenge_count(plain_modulus)


def _slot_count(digits: SlotDigits, vector_length: int) -> int:
    return digits.slots_for(vector_length) + zero_slot_count(digits.modulus)


def _chunk_count(digits: SlotDigits, vector_length: int, degree: int) -> int:
    """Ciphertexts of ``degree`` slots that hold the vector's slots and the zero slots."""
    return -(-_slot_count(digits, vector_length) // degree)


def _upload_bits(params: BfvParameters, key_shares: int = 0) -> int:
    return (params.chunk_count + key_shares) * params.poly_modulus_degree * params.ciphertext_modulus.bit_length()


def _smallest_batching_prime_at_least(lower: int, degree: int) -> int:
    step = 2 * degree
    candidate = -(-(lower - 1) // step) * step + 1
    while not is_prime(candidate):
        candidate += step
    return candidate


def _seal_coeff_modulus(degree: int, bit_sizes: tuple[int, ...]) -> list[int]:
    """The primes SEAL's CoeffModulus::Create picks: for each bit size, the largest primes = 1 mod 2N
    below 2^bits in descending order, handed out from the smallest, so [b, b] puts the second-largest
    b-bit prime first."""
    descending = {
        bits: _largest_batching_primes_below(2**bits, degree, bit_sizes.count(bits)) for bits in set(bit_sizes)
    }
    return [descending[bits].pop() for bits in bit_sizes]


def _largest_batching_primes_below(upper: int, degree: int, count: int) -> list[int]:
    step = 2 * degree
    primes = []
    candidate = (upper - 1) // step * step + 1
    while len(primes) < count:
        if candidate <= step:
            raise ParameterError(f"fewer than {count} primes = 1 mod {step} below {upper}")
        if is_prime(candidate):
            primes.append(candidate)
        candidate -= step
    return primes
