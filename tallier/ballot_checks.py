"""What the talliers make of one ballot inside the MPC: its checks, its votes, and its noise signed and placed.

A ballot (``protocol.voting.ballots``) is three checked vectors: the votes ``v`` (``Q`` rows of
``s`` votes), the noise ``n`` (``M Q C`` values in ``[-R, R]``) and the slack ``e = E_max - sum n^2``.
Once every tallier's inputs of every ballot's bits and keys are in, the talliers open a jointly
random seed, and from it public coefficients (``crypto.checked_shares.challenge``):

- the **tag check**, per part as in ``crypto.checked_shares``, summed over the three parts: zero
  unless a tallier changed its input (or the hospital sent wrong tags);
- the **bit check**, ``sum s[i,k] b[i,k] (b[i,k] - 1)`` over the three parts' bits: zero for bits.
  With bits, every vote lies in ``[0, s]``, every noise value in ``[-R, R]``, and the slack in
  ``[0, E_max]``, whatever the hospital sent;
- the **sum check**, ``sum_q r[q] (sum_c v[q, c] - s)``: zero, but with probability ``1/p``, only
  if every query holds ``s`` votes in all. Linear: no communication. With counts at least 0 and
  ``s`` to a query, the votes are votes: one-hot for AE-DPFL (or "no class", a last column, where
  its teachers may abstain), ``k`` neighbours for kNN-DPFL;
- the **energy check**, ``sum n^2 + e - E_max``: zero only if the noise's energy is at most
  ``E_max``, since both terms are non-negative integers whose sum stays below ``p``
  (``BallotLayout.energy_bound``, checked when a run is configured). One inner product; no
  comparison.

A ballot that passes enters the totals as ``v[:, :C] + rho * n[pi[:Q C]]`` (``pool_placement``):
of its noise, a pool of ``M Q C`` values, the first ``Q C`` of a public random permutation, signed
by public random signs, both drawn from the seed, which no one knew when the ballot was sealed.
The hospital chose the noise's sizes (in the range, under the cap), not where they land, which of
them land (each with probability ``1 / M``) nor which way they point. An honest pool is
exchangeable and symmetric, so the values placed have its law: ``Sk(mu)`` in every total.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

import numpy as np
from consilium.crypto.checked_shares import challenge, tag_combination
from consilium.protocol.voting.ballots import BallotLayout
from consilium.tallier.authenticated import Authenticated, pair_difference, pair_part, pair_sum

__all__ = ["REFUSALS", "BallotChecks", "CheckedBallot", "noise_placement", "pool_placement"]

# Why a ballot is refused, by the check it failed (a ``CheckedBallot`` field), in the order they are opened.
REFUSALS = {
    "bit": "its bits are not bits",
    "sum": "its votes are not {s} per query",
    "energy": "its noise's energy exceeds the cap",
}


@dataclass
class CheckedBallot:
    """One ballot inside the MPC: its four checks (authenticated pairs of one-element arrays, ``Authenticated``)
    and its votes and noise (secret arrays)."""

    tag: tuple
    bit: tuple
    sum: tuple
    energy: tuple
    votes: object  # (Q vote_columns,)
    noise: object  # (M Q C,): the pool


class BallotChecks:
    """The public coefficients of one round's checks, drawn from its ``seed``, and what they make of each ballot."""

    def __init__(self, runtime, secint, layout: BallotLayout, seed: int) -> None:
        self.runtime, self.secint, self.layout, self.seed = runtime, secint, layout, seed
        self.modulus = p = secint.field.modulus
        parts = list(zip(BallotLayout.PARTS, layout.parts))
        self.spreads = [challenge(seed, part.entries * part.bits, p, f"bits/{name}") for name, part in parts]
        self.coefficients = [challenge(seed, part.entries, p, f"tags/{name}") for name, part in parts]
        self.tag_weights = [self.public(r) for r in self.coefficients]
        self.weights = [np.array(part.weights, dtype=object) for part in layout.parts]
        row_weights = challenge(seed, layout.queries, p, "sums")
        self.sum_weights = self.public(np.repeat(np.array(row_weights, dtype=object), layout.vote_columns))
        self.sum_target = layout.votes_per_query * sum(row_weights)

    def public(self, values) -> object:
        """A public vector of field elements, for products with secret arrays (free of communication)."""
        return self.secint.field.array(np.array(values, dtype=object))

    def tag_combinations(self, ballot: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[int]:
        """This tallier's share of each part's ``sum_i r[i] t[i]``, from its share of the ballot (split by part)."""
        return [tag_combination(tags, r, self.modulus) for (_, tags, _), r in zip(ballot, self.coefficients)]

    def check(self, pairs: Authenticated, committed: tuple, tags: tuple) -> CheckedBallot:
        """The checks, votes and noise of one ballot, from the pair of its secret bits and keys (part after part, as
        ``BallotLayout.committed``) and the pair of its three parts' secret tag combinations: every product a pair
        product under ``pairs``' key, recorded for its next check."""
        runtime, start, values, bit_checks, tag_checks = self.runtime, 0, [], [], []
        for k, part in enumerate(self.layout.parts):
            size = part.entries * part.bits
            bits, key = (
                pair_part(committed, start, start + size),
                pair_part(committed, start + size, start + size + part.bits),
            )
            start += size + part.bits
            rows = [runtime.np_reshape(half, (part.entries, part.bits)) for half in bits]
            bit_checks.append(pairs.inner_product(pairs.scaled(bits, self.spreads[k]), bits[0] - 1))
            tag_checks.append(
                pair_difference(pair_part(tags, k, k + 1), pairs.inner_product(key, self.tag_weights[k] @ rows[0]))
            )
            values.append(pairs.plus((rows[0] @ self.weights[k], rows[1] @ self.weights[k]), part.low))
        votes, noise, slack = values
        summed = pairs.plus(tuple(runtime.np_fromlist([half @ self.sum_weights]) for half in votes), -self.sum_target)
        energy = pairs.plus(pair_sum(pairs.inner_product(noise, noise[0]), slack), -self.layout.energy_cap)
        return CheckedBallot(
            tag=reduce(pair_sum, tag_checks),
            bit=reduce(pair_sum, bit_checks),
            sum=summed,
            energy=energy,
            votes=votes[0],
            noise=noise[0],
        )

    def placed(self, ballot: CheckedBallot, voter: str, placement: int):
        """``v[:, :C] + rho * n[pi]``, flattened: what ``voter``'s ballot adds to the round's ``Q C`` totals, its
        noise signed and placed by ``placement``, a seed opened after every ballot was in (``pool_placement``): a
        gather and public signs, so no communication."""
        runtime, layout = self.runtime, self.layout
        rows = runtime.np_reshape(ballot.votes, (layout.queries, layout.vote_columns))
        votes = runtime.np_reshape(rows[:, : layout.classes], (-1,))
        signs, slots = pool_placement(placement, voter, layout, self.modulus)
        return votes + ballot.noise[slots] * self.public(signs)


def pool_placement(seed: int, voter: str, layout: BallotLayout, modulus: int) -> tuple[np.ndarray, np.ndarray]:
    """How ``voter``'s noise enters the round's ``N = Q C`` totals: total ``i`` gets ``signs[i] n[slots[i]]``, the
    first ``N`` of a uniform permutation of its pool's ``M N`` slots (``noise_placement``)."""
    signs, places = noise_placement(seed, voter, layout.pool_values, modulus, totals=layout.totals)
    return signs, places[: layout.totals]


def noise_placement(
    seed: int, voter: str, count: int, modulus: int, *, totals: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The public signs (``+1`` or ``-1``) of ``totals`` totals (``count`` unless given) and a permutation of
    ``count`` pool slots with which ``voter``'s noise enters a round: total ``i`` gets ``signs[i] n[places[i]]``.
    Drawn from the round's jointly random ``seed``: a uniform permutation (the order of uniform keys of two field
    elements each, ties below ``count^2 / p^2``) and uniform signs (within ``1/p``; ``challenge``'s stream is the
    same whatever its length, so the first signs do not depend on how many are drawn)."""
    signed = count if totals is None else totals
    signs = np.array(challenge(seed, signed, modulus, f"noise-signs/{voter}"), dtype=np.uint64) & 1  # p < 2^64
    keys = [np.array(challenge(seed, count, modulus, f"noise-places/{voter}/{k}"), dtype=np.uint64) for k in (0, 1)]
    return 1 - 2 * signs.astype(np.int64), np.lexsort((keys[1], keys[0]))
