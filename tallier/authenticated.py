"""A round's checks and labels over authenticated pairs: a tallier that deviates in their arithmetic is caught.

The MAC compiler of Chida, Genkin, Hamada, Ikarashi, Kikuchi, Lindell and Nof (CRYPTO 2018), over
MPyC's field, Shamir sharing, resharing and pseudorandom sharing (PRSS); the design and the argument
for each property are in ``docs/explanation/authenticated-labels.md``.

- A secret key ``[alpha]`` (PRSS: no one knows it) and every secret as a **pair** ``([x], [alpha x])``.
  Sums and public factors act on both halves, locally.
- A **product** of pairs is ``([x y], [(alpha x) y])``, two products resharing in one message, and an
  **inner product** ``<x, y>`` likewise; a value with no MAC yet (an input, the totals) is
  **authenticated** by ``[alpha] [x]``. Every product is recorded. The ballot checks (``tallier.mpc``,
  step 4) and the labels (step 6) share one key a round.
- MPyC's resharing is secure up to an additive error at ``J = 2t + 1`` talliers: a tallier that
  reshares a wrong value adds ``e`` to a product and ``f`` to its MAC. The **check**, before every
  opening of anything a product made, opens only whether ``sum_k r_k ([alpha z_k] - [alpha] [z_k])``
  is zero (``is_zero``), for secret PRSS coefficients ``r_k``: always for honest talliers, and despite
  an error with probability about ``2 / p`` (``p >= 2^40``) whatever the data, since ``r`` and
  ``alpha`` are never opened (``DeviationError``).
- **Comparisons** ``[d < 0]``, for ``-2^k <= d < 2^k`` with ``k = l - 1``: ``k`` random bits (``u^2``
  checked, then opened; the bit ``(u / sqrt(u^2) + 1) / 2``), a mask's high part ``s`` of about
  ``kappa`` bits, ``c = d + 2^k + r' + 2^k s`` opened, and ``[c mod 2^k < r']`` from the suffix
  products of the bits' equalities with ``c``'s, ``k - 1`` products one after another.
- The **argmax** is a tournament over the classes, ties to the lower class, as NumPy's.

Every opening is ``open_checked``: from all three shares, which must lie on one line.
"""

from __future__ import annotations

import numpy as np
from consilium.crypto.secret_sharing import random_elements
from consilium.tallier.mpc_values import open_checked

__all__ = [
    "Authenticated",
    "DeviationError",
    "DrawError",
    "joint_seed",
    "pair_difference",
    "pair_part",
    "pair_sum",
    "pairs_joined",
]

_KAPPA = 30  # the mask's high part: its one summand no single tallier knows hides d to about 2^-(kappa - 1)


class DrawError(RuntimeError):
    """A random bit's square opened as zero (probability about ``1/p`` a bit): the round is tallied again."""


class DeviationError(RuntimeError):
    """A tallier deviated where it shows: a check of the labels' arithmetic failed, or a peer sent what no honest
    tallier sends once the output began. No label of the round is released, and the run stops."""

    def __init__(self, round_number: int, what: str) -> None:
        super().__init__(
            f"round {round_number}: {what}: a tallier deviated; no label of the round is released, and the run stops"
        )


class Authenticated:
    """One tallier's view of a round's authenticated arithmetic: the key, the recorded products, the check."""

    def __init__(self, runtime, secint, round_number: int) -> None:
        if len(runtime.parties) != 2 * runtime.threshold + 1:  # else a resharing's error need not be additive
            raise ValueError(f"the labels' checks need an odd number of talliers, not {len(runtime.parties)}")
        self.runtime, self.secint, self.round = runtime, secint, round_number
        self.modulus = secint.field.modulus
        self.key = runtime._np_randoms(secint, 1)
        self.recorded: list[tuple[object, object]] = []  # (z, alpha z) for every product
        self.checked = 0  # how many of them the last check covered

    # -- pairs: (value, MAC), each a 1-D secure array --------------------------------------------------------------

    def public(self, values) -> object:
        """Public integers as a vector of field elements, for products with secret arrays (local)."""
        return self.secint.field.array(np.asarray(values).astype(object) % self.modulus)  # Python ints, never int64

    def constant(self, values) -> tuple[object, object]:
        """A pair holding public ``values``: the constants themselves, and ``values`` times the key."""
        values = np.array(values, dtype=object)
        return self.secint.array(self.public(values)), self.key * self.public(values)

    def plus(self, pair, values) -> tuple[object, object]:
        """``pair`` plus public ``values`` (a number, or one per element)."""
        x, mac = pair
        shift = self.public(np.broadcast_to(np.array(values, dtype=object), (x.size,)))
        return x + shift, mac + self.key * shift

    def scaled(self, pair, factors) -> tuple[object, object]:
        """``pair`` times public ``factors`` (a number, or one per element)."""
        factors = self.public(np.broadcast_to(np.array(factors, dtype=object), (pair[0].size,)))
        return pair[0] * factors, pair[1] * factors

    def authenticate(self, x) -> tuple[object, object]:
        """``x`` (a secure array with no MAC) as a pair, by one recorded product with the key."""
        mac = self.product(self.key, x)
        self.recorded.append((x, mac))
        return x, mac

    def product(self, a, b):
        """The elementwise product of two secure arrays (with broadcasting): MPyC's local product and resharing,
        the step a tallier can bend, by an additive error, which the checks catch. Every product goes through here
        or ``inner``."""
        return a * b

    def inner(self, a, b):
        """The inner product of two secure vectors (or each row of a matrix and a vector): local products summed,
        then one resharing."""
        return a @ b

    def inner_product(self, left, right) -> tuple[object, object]:
        """``<x, y>`` of the pair ``left`` and the secure vector ``right``, as a pair of one-element arrays: ``<x, y>``
        and ``<alpha x, y>`` in one resharing, recorded."""
        both = self.inner(self.runtime.np_stack(left), right)
        product = both[:1], both[1:]
        self.recorded.append(product)
        return product

    def masked(self, checks: list) -> object:
        """``rho z`` for each of ``checks`` (pairs), ``rho`` a fresh PRSS random element each, never opened: a product
        of pairs, recorded. Opened after the next ``check``, it is zero for a zero ``z`` and uniform for another, and
        carries no error. (``rho`` needs no MAC: it is the right factor, and ``alpha z rho`` is made from ``z``'s.)"""
        joined = pairs_joined(self.runtime, checks)
        factors = self.runtime._np_randoms(self.secint, joined[0].size)
        return self.times(joined, (factors, None))[0]

    async def is_zero(self, check) -> bool:
        """Whether the secure one-element array ``check`` is zero, opening only ``rho check`` for a fresh secret
        ``rho`` (Chida et al.'s CheckZero): a nonzero check opened bare could carry a secret that an error a tallier
        chose has put into it, such as a difference of two totals."""
        factor = self.runtime._np_randoms(self.secint, 1)
        return (await open_checked(self.runtime, self.product(factor, check)))[0] == 0

    def times(self, left, right) -> tuple[object, object]:
        """The elementwise product of two pairs: ``x y`` and ``(alpha x) y`` in one resharing, recorded."""
        runtime, (x, mac), (y, _) = self.runtime, left, right
        size = x.size
        both = self.product(runtime.np_concatenate((x, mac)), runtime.np_concatenate((y, y)))
        product = both[:size], both[size:]
        self.recorded.append(product)
        return product

    # -- comparisons and argmax ------------------------------------------------------------------------------------

    async def random_bits(self, count: int) -> tuple[object, object]:
        """``count`` secret uniform bits as a pair, checked before anything that depends on a vote is opened.

        ``u`` random (PRSS), ``[u^2]`` and ``[alpha u]`` in one resharing, then ``[alpha u] [u]``, the MAC of
        ``u^2``, recorded with it; the bit is ``(u / sqrt(u^2) + 1) / 2``, its MAC ``(alpha u / sqrt(u^2) + alpha) /
        2``. A tallier that shifted ``u^2`` would make a "bit" it knows up to a sign, and read ``d``'s low bits off
        the comparison's opening, so every product so far is checked (``check``) before ``u^2`` is opened."""
        runtime, p = self.runtime, self.modulus
        u = runtime._np_randoms(self.secint, count)
        keys = self.key * self.public(np.ones(count, dtype=object))
        both = self.product(runtime.np_concatenate((u, u)), runtime.np_concatenate((u, keys)))
        square, mac_u = both[:count], both[count:]
        self.recorded += [(u, mac_u), (square, self.product(mac_u, u))]
        await self.check()
        opened = np.array(await open_checked(runtime, square), dtype=object) % p
        if np.any(opened == 0):  # u = 0 leaves the bit undefined: probability count / p
            raise DrawError(f"round {self.round}: a random bit's square opened as zero; the round is tallied again")
        roots = type(self.secint.field.array([1]))._sqrt(opened, INV=True)
        if np.any((roots * roots % p) * opened % p != 1):  # the check passed: only a chance of 2 / p leaves this
            raise DeviationError(self.round, "a random bit's square opened as a non-square")
        return self.scaled(self.plus(self.scaled((u, mac_u), roots), 1), (p + 1) // 2)

    async def less_than_zero(self, d, bit_length: int) -> tuple[object, object]:
        """``[d < 0]`` elementwise, as a pair, for a pair ``d`` whose values lie in ``[-2^k, 2^k)``, ``k = l - 1``."""
        runtime, k, n = self.runtime, bit_length - 1, d[0].size
        bits = await self.random_bits(k * n)  # bit i of comparison j at i n + j
        column = [(bits[0][i * n : (i + 1) * n], bits[1][i * n : (i + 1) * n]) for i in range(k)]
        low = column[0]
        for i in range(1, k):
            low = pair_sum(low, self.scaled(column[i], 1 << i))
        # The mask's high part hides d and is never used again, so it needs no MAC: a wrong share of it shows at
        # the opening. PRSS adds comb(J, t) summands below 2^32 / comb(J, t) each (J = 3: 2^30; J = 5: 2^28), so c
        # stays below 3 p / 8 for every l, and the one summand a corrupt tallier does not know hides d.
        high = runtime._np_randoms(self.secint, n, 1 << (_KAPPA + 2))
        masked = d[0] + (1 << k) + low[0] + high * (1 << k)
        c = np.array(await open_checked(runtime, masked), dtype=object) % self.modulus % (1 << k)
        c_bits = [(c >> i) & 1 for i in range(k)]
        equal = [self.plus(self.scaled(column[i], 2 * c_bits[i] - 1), 1 - c_bits[i]) for i in range(k)]
        suffix = [None] * k + [self.constant(np.ones(n, dtype=object))]  # suffix[i]: the product of equal[i:]
        suffix[k - 1] = equal[k - 1]
        for i in range(k - 2, -1, -1):
            suffix[i] = self.times(suffix[i + 1], equal[i])
        below = self.constant(np.zeros(n, dtype=object))
        for i in range(k):
            below = pair_sum(below, self.scaled(pair_difference(suffix[i + 1], suffix[i]), 1 - c_bits[i]))
        d_mod = pair_sum(self.plus(self.scaled(low, -1), c), self.scaled(below, 1 << k))
        return self.scaled(pair_difference(d_mod, d), pow(1 << k, -1, self.modulus))

    async def argmax(self, columns: list, bit_length: int) -> tuple[tuple[object, object], tuple[object, object]]:
        """Each row's first largest column's index and value, as pairs, over ``columns`` (pairs of one length)."""
        rows = columns[0][0].size
        entrants = [(column, self.constant(np.full(rows, c, dtype=object))) for c, column in enumerate(columns)]
        while len(entrants) > 1:
            meetings = [(entrants[i], entrants[i + 1]) for i in range(0, len(entrants) - 1, 2)]
            left = pairs_joined(self.runtime, [value for (value, _), _ in meetings])
            right = pairs_joined(self.runtime, [value for _, (value, _) in meetings])
            right_wins = await self.less_than_zero(pair_difference(left, right), bit_length)
            left_index = pairs_joined(self.runtime, [index for (_, index), _ in meetings])
            right_index = pairs_joined(self.runtime, [index for _, (_, index) in meetings])
            steps = self.times(
                pairs_joined(self.runtime, [right_wins, right_wins]),
                pairs_joined(self.runtime, [pair_difference(right, left), pair_difference(right_index, left_index)]),
            )
            size = len(meetings) * rows
            value = pair_sum(left, pair_part(steps, 0, size))
            index = pair_sum(left_index, pair_part(steps, size, 2 * size))
            winners = [
                (pair_part(value, m * rows, (m + 1) * rows), pair_part(index, m * rows, (m + 1) * rows))
                for m in range(len(meetings))
            ]
            entrants = winners + entrants[2 * len(meetings) :]
        [(top, label)] = entrants
        return label, top

    async def labels(self, totals, bit_length: int, label_threshold: int) -> np.ndarray:
        """Step 6 of a round (``tallier.mpc``), checked: each query's first largest class of the ``(Q, C)`` secret
        ``totals``, or ``C`` where its top total falls short of a positive ``label_threshold``; opened only once the
        check passed (``DeviationError`` if it fails)."""
        runtime, (queries, classes) = self.runtime, totals.shape
        flat = self.authenticate(runtime.np_reshape(runtime.np_transpose(totals), (-1,)))  # class by class
        label, top = await self.argmax(
            [pair_part(flat, c * queries, (c + 1) * queries) for c in range(classes)], bit_length
        )
        if label_threshold:  # C + [top >= T] (label - C)
            reaches = self.plus(
                self.scaled(await self.less_than_zero(self.plus(top, -label_threshold), bit_length), -1), 1
            )
            label = self.plus(self.times(reaches, self.plus(label, -classes)), classes)
        await self.check()
        return np.array(await open_checked(runtime, label[0]), dtype=np.int64)

    # -- the check -------------------------------------------------------------------------------------------------

    async def check(self, of: str = "the labels' arithmetic") -> None:
        """``DeviationError`` (naming the check ``of`` what) unless every product ``z_k`` recorded since the last check
        carries its MAC: ``sum_k r_k [alpha z_k] - [alpha] sum_k r_k [z_k]`` is zero (``is_zero``), for secret random
        ``r_k`` (PRSS) that no one ever learns, as are ``alpha`` and the sums. Public coefficients would let a tallier
        cancel an error it knows in the check's last product, so that the check passed or failed with a secret that
        an earlier MAC error was multiplied by, and showed it (Review 4, finding 1). A check comes before every
        opening of a value a product made (a masked check, a masked difference, the labels): an error in a product,
        however large, could otherwise move a masked value past its mask, and show a secret's bits."""
        runtime = self.runtime
        fresh, self.checked = self.recorded[self.checked :], len(self.recorded)
        values, macs = (runtime.np_concatenate([pair[half] for pair in fresh]) for half in (0, 1))
        weights = runtime._np_randoms(self.secint, values.size)
        both = self.inner(runtime.np_stack((values, macs)), weights)  # sum r z and sum r (alpha z): one resharing
        if not await self.is_zero(both[1:] - self.product(self.key, both[:1])):
            raise DeviationError(self.round, f"the MAC check of {of} failed")


async def joint_seed(runtime, secint) -> int:
    """A fresh public seed no tallier chose: each inputs a uniform field element from the OS, and their sum is
    opened (a signed integer, as ``open_checked`` gives it)."""
    field = secint.field
    summands = runtime.input(secint.array(field.array(np.array(random_elements(1, field.modulus), dtype=object))))
    return (await open_checked(runtime, sum(summands[1:], summands[0])))[0]


def pair_sum(left, right):
    return left[0] + right[0], left[1] + right[1]


def pair_difference(left, right):
    return left[0] - right[0], left[1] - right[1]


def pair_part(pair, start: int, stop: int):
    return pair[0][start:stop], pair[1][start:stop]


def pairs_joined(runtime, pairs: list):
    return runtime.np_concatenate([x for x, _ in pairs]), runtime.np_concatenate([m for _, m in pairs])
