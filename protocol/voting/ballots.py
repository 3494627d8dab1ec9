"""A hospital's ballot: its votes and its noise as sealed checked shares, one per tallier, relayed by a server
that cannot read them.

A ballot is three checked vectors (``crypto.checked_shares``: each value's bits, additively
shared, under a tag the talliers check inside the MPC), one after the other (``BallotLayout``):

- the **votes**, ``Q`` rows of counts in ``[0, s]``: a one-hot row per query for AE-DPFL (with a
  last column for "no class" where its teachers may abstain), the ``k`` neighbours' label counts
  for kNN-DPFL. The talliers check that each row sums to ``s``, so the votes are votes;
- the **noise**, ``M Q C`` values in ``[-R, R]``: the hospital's ``Sk(mu)`` share drawn as a pool
  (``training.voting.vote_privacy.NoisePool``), of which the talliers sign and place the round's
  ``Q C`` at random after the fact (``tallier.ballot_checks``);
- the **slack**, ``E_max - sum n^2`` in ``[0, E_max]``: the talliers check that it and the noise's
  energy add up to ``E_max``, which bounds the energy without a secure comparison.

The hospital seals share ``j`` to tallier ``j`` (``crypto.sealed_box``): to a box key the tallier
made for this run alone and certified with its identity (``tallier_key_context``), signed by the
hospital, and bound to the run, the round, the hospital and the tallier (``_share_context``). The
server relays the boxes; it checks their length and that the hospital signed each for its tallier's
key, the run and the round (``verify_ballot``), and can check nothing else. A tallier opens only its
own, and a box replayed into another round, from another hospital or to another tallier does not open.
It marks each box it was given (``mark_box``): OK, NONE (not a box the hospital signed for it, this
run and this round) or BAD (signed by the hospital, and yet it does not open to a share); the talliers
agree on the marks before anything is counted (``tallier.voter_marks``). The hospital keeps each box's
ephemeral secret, in memory, until its next ballot (``protocol.voting.box_dispute``): revealed, it
shows what that one box holds.

Any ``J - 1`` shares are uniform and independent of the votes and the noise, so a tallier (or the
server, were it to open a box) learns nothing from what it holds; only all ``J`` together give them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from consilium.crypto.checked_shares import CheckedLayout, share_checked
from consilium.training.voting.vote_privacy import NoisePool, VotingSettings
from consilium.crypto.mpc_field import MpcField
from consilium.crypto.sealed_box import (
    OVERHEAD_BYTES,
    SealedBoxError,
    open_box,
    open_with_ephemeral,
    seal_revealable,
    verify_box,
    verify_certified_key,
)
from consilium.crypto.secret_sharing import ShareError, from_bytes, to_bytes
from consilium.protocol.identity.roster import Roster
from consilium.protocol.wire.messages import ProtocolError

__all__ = [
    "BAD",
    "NONE",
    "OK",
    "BallotError",
    "BallotLayout",
    "MarkedBox",
    "box_bytes",
    "box_digest",
    "mark_box",
    "revealed_share",
    "seal_ballot",
    "share_ballot",
    "tallier_box_keys",
    "tallier_key_context",
    "verify_ballot",
]


NONE, OK, BAD = 0, 1, 2  # a tallier's mark of the box it holds from a hospital in a round


class BallotError(ValueError):
    """A sealed share that does not open, or holds no valid share of this round."""


@dataclass(frozen=True)
class MarkedBox:
    """What a tallier makes of one hospital's box: its mark, the box's SHA-256, its share if OK, why if not."""

    mark: int
    digest: bytes
    share: np.ndarray | None = None
    reason: str = ""


@dataclass(frozen=True)
class BallotLayout:
    """Where a ballot's three checked vectors lie, and the ranges each is checked against."""

    queries: int  # Q
    classes: int  # C
    votes_per_query: int  # s: AE-DPFL 1, kNN-DPFL k
    abstains: bool  # a last vote column per query, "no class" (AE-DPFL with a teacher confidence)
    noise_range: int  # R
    energy_cap: int  # E_max
    pool_factor: int = 1  # M: the noise is a pool of M Q C values (training.voting.vote_privacy.NoisePool)

    PARTS = ("votes", "noise", "slack")

    @classmethod
    def for_round(cls, voting: VotingSettings, *, queries: int, classes: int, abstains: bool) -> "BallotLayout":
        """The ballot of a round of ``queries`` over ``classes`` under ``voting``: its noise from
        ``VotingSettings.noise_pool``."""
        pool = voting.noise_pool(queries=queries, classes=classes)
        return cls(
            queries=queries,
            classes=classes,
            votes_per_query=voting.votes_per_query,
            abstains=abstains,
            noise_range=pool.radius,
            energy_cap=pool.energy_cap,
            pool_factor=pool.factor,
        )

    @property
    def totals(self) -> int:
        """``N = Q C``: the round's noisy totals."""
        return self.queries * self.classes

    @property
    def pool_values(self) -> int:
        """``M N``: the values of a hospital's noise pool, all in its ballot, of which the round's ``N`` are placed."""
        return self.pool_factor * self.totals

    @property
    def noise_pool(self) -> NoisePool:
        """What a hospital draws its noise under (``training.voting.votes.noise_share``)."""
        return NoisePool(self.pool_factor, self.noise_range, self.energy_cap)

    @property
    def vote_columns(self) -> int:
        return self.classes + self.abstains

    @property
    def parts(self) -> tuple[CheckedLayout, CheckedLayout, CheckedLayout]:
        """The votes, the noise and the slack, in that order."""
        return (
            CheckedLayout(self.queries * self.vote_columns, 0, self.votes_per_query),
            CheckedLayout(self.pool_values, -self.noise_range, self.noise_range),
            CheckedLayout(1, 0, self.energy_cap),
        )

    @property
    def values(self) -> int:
        """Field elements in one tallier's share of a ballot."""
        return sum(part.values for part in self.parts)

    @property
    def committed_values(self) -> int:
        """Field elements of a ballot that the talliers input before the challenge: each part's bits, then its key."""
        return sum(part.entries * part.bits + part.bits for part in self.parts)

    def split(self, vector: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Each part's bits, tags and key (``CheckedLayout.split``)."""
        if len(vector) != self.values:
            raise ShareError(f"a ballot's share holds {self.values} values, got {len(vector)}")
        ends = np.cumsum([part.values for part in self.parts])[:-1]
        return [part.split(piece) for part, piece in zip(self.parts, np.split(vector, ends), strict=True)]

    def with_abstentions(self, counts: np.ndarray) -> np.ndarray:
        """A hospital's ``(Q, C)`` counts as its ballot carries them: with the "no class" column where it abstains."""
        counts = np.asarray(counts, dtype=np.int64)
        if not self.abstains:
            return counts
        return np.concatenate([counts, self.votes_per_query - counts.sum(axis=1, keepdims=True)], axis=1)

    def totals_bound(self, senders: int) -> int:
        """``|every total|`` of ``senders`` ballots whatever each sent: votes and noise rebuilt from their bits."""
        return senders * (self.votes_per_query + self.noise_range)

    @property
    def energy_bound(self) -> int:
        """The largest ``sum n^2 + slack`` bits can rebuild: the field must exceed it for the energy check to be exact."""
        return self.pool_values * self.noise_range**2 + self.energy_cap


def share_ballot(
    votes: np.ndarray, noise: np.ndarray, layout: BallotLayout, parties: int, modulus: int
) -> list[np.ndarray]:
    """``parties`` shares of a ballot: ``votes`` (``Q`` rows of ``layout.vote_columns``) and ``noise`` (``M Q C``).

    ``ShareError`` unless the votes are in ``[0, s]``, ``s`` to a row, and the noise is in its range and under its cap."""
    votes = np.asarray(votes, dtype=np.int64)
    noise = np.asarray(noise, dtype=np.int64).reshape(-1)
    if votes.shape != (layout.queries, layout.vote_columns) or np.any(votes.sum(axis=1) != layout.votes_per_query):
        raise ShareError(
            f"votes are {layout.queries} rows of {layout.vote_columns} counts, {layout.votes_per_query} to a row"
        )
    slack = layout.energy_cap - int(noise @ noise)
    if slack < 0:
        raise ShareError(f"the noise's energy exceeds its cap of {layout.energy_cap}")
    parts = zip(layout.parts, (votes.reshape(-1), noise, np.array([slack])), strict=True)
    return [np.concatenate(shares) for shares in zip(*(share_checked(v, part, parties, modulus) for part, v in parts))]


def tallier_key_context(run: str, tallier: str) -> bytes:
    """What a tallier's per-run box key is certified for: this run (``VotingConfig.fingerprint``), this tallier."""
    return f"consilium/tallier-box-key/v1|{run}|{tallier}".encode()


def box_bytes(values: int) -> int:
    """The length of a sealed share of ``values`` field elements."""
    return 8 * values + OVERHEAD_BYTES


def seal_ballot(
    votes: np.ndarray,
    noise: np.ndarray,
    *,
    tallier_keys: dict[str, X25519PublicKey],
    field: MpcField,
    layout: BallotLayout,
    sender: Ed25519PrivateKey,
    run: str,
    round_number: int,
    hospital: str,
) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """``votes`` and ``noise`` (``share_ballot``) in shares among the talliers (in the order of ``tallier_keys``),
    each share sealed to its tallier; and each box's ephemeral secret, which the hospital keeps to settle a
    dispute over that box (``protocol.voting.box_dispute``) and reveals for nothing else."""
    shares = share_ballot(votes, noise, layout, len(tallier_keys), field.modulus)
    sealed = {
        tallier: seal_revealable(
            to_bytes(vector), recipient=key, sender=sender, context=_share_context(run, round_number, hospital, tallier)
        )
        for (tallier, key), vector in zip(tallier_keys.items(), shares, strict=True)
    }
    return {t: box for t, (box, _) in sealed.items()}, {t: secret for t, (_, secret) in sealed.items()}


def box_digest(box: bytes) -> bytes:
    return hashlib.sha256(box).digest()


def mark_box(
    box: bytes,
    *,
    recipient: X25519PrivateKey,
    hospital_key: Ed25519PublicKey,
    field: MpcField,
    values: int,
    run: str,
    round_number: int,
    hospital: str,
    tallier: str,
) -> MarkedBox:
    """``tallier``'s mark of the box ``hospital`` sent it for this round: OK with its share (``values`` elements of the
    field, a checked share's), NONE where ``hospital`` did not sign it for this tallier's key, the run and the round
    (only a server could relay that: it verified every box), BAD where it did and the box does not open to a share
    (only the hospital could have made that)."""
    context, digest = _share_context(run, round_number, hospital, tallier), box_digest(box)
    try:
        verify_box(box, recipient=recipient.public_key(), sender=hospital_key, context=context)
    except SealedBoxError as error:
        return MarkedBox(NONE, digest, reason=f"the box from {hospital} for round {round_number} is not its: {error}")
    try:
        plaintext = open_box(box, recipient=recipient, sender=hospital_key, context=context)
        return MarkedBox(OK, digest, from_bytes(plaintext, values, field.modulus))
    except (SealedBoxError, ShareError) as error:
        return MarkedBox(BAD, digest, reason=f"the share from {hospital} for round {round_number} is refused: {error}")


def revealed_share(
    box: bytes,
    *,
    ephemeral: bytes,
    tallier_key: X25519PublicKey,
    hospital_key: Ed25519PublicKey,
    field: MpcField,
    values: int,
    run: str,
    round_number: int,
    hospital: str,
    tallier: str,
) -> str:
    """Why the box ``hospital`` signed for ``tallier`` does not open to a share with the ephemeral secret it revealed
    (its own doing), or "" if it does (the tallier that marked it BAD lied). ``BallotError`` if ``hospital`` did not
    sign this box for ``tallier``'s key, the run and the round: then it shows nothing about either."""
    context = _share_context(run, round_number, hospital, tallier)
    try:
        verify_box(box, recipient=tallier_key, sender=hospital_key, context=context)
    except SealedBoxError as error:
        raise BallotError(
            f"the box is not one {hospital} sealed to {tallier} for round {round_number}: {error}"
        ) from None
    try:
        plaintext = open_with_ephemeral(
            box, ephemeral=ephemeral, recipient=tallier_key, sender=hospital_key, context=context
        )
        from_bytes(plaintext, values, field.modulus)
    except (SealedBoxError, ShareError) as error:
        return str(error)
    return ""


def tallier_box_keys(certified: dict[str, bytes], *, roster: Roster, run: str) -> dict[str, X25519PublicKey]:
    """Each tallier's box key for ``run``, as it certified it with its identity in the roster (``ProtocolError``
    naming the first that is not its tallier's): what a hospital seals to and a relay verifies boxes against."""
    keys = {}
    for name, key in certified.items():
        try:
            signer = roster.party(name).identity.signing
            keys[name] = verify_certified_key(key, signer=signer, context=tallier_key_context(run, name))
        except SealedBoxError as error:
            raise ProtocolError(f"the box key given for {name} is not {name}'s for this run: {error}") from None
    return keys


def verify_ballot(
    boxes: dict[str, bytes],
    *,
    tallier_keys: dict[str, X25519PublicKey],
    hospital_key: Ed25519PublicKey,
    run: str,
    round_number: int,
    hospital: str,
) -> None:
    """``BallotError`` unless ``hospital`` signed each box for its tallier's key, the run and this round: what a
    relay can check without opening one (a box that passes and still does not open is the hospital's doing)."""
    for tallier, box in boxes.items():
        context = _share_context(run, round_number, hospital, tallier)
        try:
            verify_box(box, recipient=tallier_keys[tallier], sender=hospital_key, context=context)
        except SealedBoxError as error:
            raise BallotError(f"its box to {tallier} for round {round_number} is refused: {error}") from None


def _share_context(run: str, round_number: int, hospital: str, tallier: str) -> bytes:
    return f"consilium/vote-share/v2|{run}|{round_number}|{hospital}|{tallier}".encode()
