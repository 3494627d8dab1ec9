"""Ballots for tests of the talliers' MPC: votes that are votes, noise of the test's choosing, and the totals the
talliers should reach from them."""

import numpy as np
from consilium.crypto.checked_shares import _share_bits
from consilium.protocol.voting.ballots import BallotLayout
from consilium.tallier.ballot_checks import pool_placement


def layout_for(
    queries: int,
    classes: int,
    votes_per_query: int,
    *,
    noise_range: int = 40,
    energy_cap: int | None = None,
    abstains: bool = False,
    pool_factor: int = 1,
):
    """A ballot layout whose energy cap binds nothing unless ``energy_cap`` is given, its noise a pool of
    ``pool_factor`` times the round's values."""
    cap = pool_factor * queries * classes * noise_range**2 if energy_cap is None else energy_cap
    return BallotLayout(queries, classes, votes_per_query, abstains, noise_range, cap, pool_factor)


def split_totals(totals: np.ndarray, votes_per_query: int) -> tuple[np.ndarray, np.ndarray]:
    """Two hospitals' votes that add up to ``totals`` (rows of ``2 s`` non-negative counts): the first takes what
    it can from the left, ``s`` to a row, and the second the rest."""
    first = np.zeros_like(totals)
    for row, counts in enumerate(totals):
        left = votes_per_query
        for column, count in enumerate(counts):
            first[row, column] = min(count, left)
            left -= first[row, column]
    return first, totals - first


def placed_totals(
    ballots: dict[str, tuple[np.ndarray, np.ndarray]], layout: BallotLayout, seed: int, modulus: int
) -> np.ndarray:
    """The ``(Q, C)`` totals the talliers compute from ``ballots``: each voter's votes plus its noise, signed and
    placed by the round's ``seed``."""
    totals = np.zeros(layout.totals, dtype=np.int64)
    for voter, (votes, noise) in ballots.items():
        signs, slots = pool_placement(seed, voter, layout, modulus)
        totals += np.asarray(votes)[:, : layout.classes].reshape(-1) + signs * np.asarray(noise).reshape(-1)[slots]
    return totals.reshape(layout.queries, layout.classes)


def forged_ballot(parts_bits: list[np.ndarray], talliers: int, modulus: int) -> list[np.ndarray]:
    """Each tallier's share of a ballot whose parts have the ``(n, m)`` bits given, whatever they are, under
    valid tags: what a hospital that forges its ballot sends."""
    shares = [_share_bits(bits, talliers, modulus) for bits in parts_bits]
    return [np.concatenate(pieces) for pieces in zip(*shares)]


def ballot_bits(layout: BallotLayout, votes: np.ndarray, noise: np.ndarray, slack: int) -> list[np.ndarray]:
    """The bits of an honest-looking ballot's three parts, for a test to change before ``forged_ballot``."""
    values = (np.asarray(votes).reshape(-1), np.asarray(noise).reshape(-1), np.array([slack]))
    return [part.decompose(v) for part, v in zip(layout.parts, values, strict=True)]
