"""A hospital's noisy votes as sealed shares, one per tallier, relayed by a server that cannot read them.

A hospital splits its noisy vote vector into ``J`` checked shares (``crypto.checked_shares``: the
bits of each count, additively shared, under a tag the talliers check inside the MPC) and seals
share ``j`` to tallier ``j`` (``crypto.sealed_box``): to a box key the tallier made for this
run alone and certified with its identity (``tallier_key_context``), signed by the hospital, and
bound to the run, the round, the hospital and the tallier (``_share_context``). The server relays
the boxes; it can check their length and nothing else. A tallier opens only its own, and a box
replayed into another round, from another hospital or to another tallier does not open.

Any ``J - 1`` shares are uniform and independent of the votes, so a tallier (or the server, were
it to open a box) learns nothing from what it holds; only all ``J`` together give the votes.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from consilium.crypto.checked_shares import CheckedLayout, share_checked
from consilium.crypto.mpc_field import MpcField
from consilium.crypto.sealed_box import OVERHEAD_BYTES, SealedBoxError, open_box, seal
from consilium.crypto.secret_sharing import ShareError, from_bytes, to_bytes

__all__ = ["BallotError", "box_bytes", "open_share", "seal_ballot", "tallier_key_context"]


class BallotError(ValueError):
    """A sealed share that does not open, or holds no valid share of this round."""


def tallier_key_context(run: str, tallier: str) -> bytes:
    """What a tallier's per-run box key is certified for: this run (``VotingConfig.fingerprint``), this tallier."""
    return f"consilium/tallier-box-key/v1|{run}|{tallier}".encode()


def box_bytes(values: int) -> int:
    """The length of a sealed share of ``values`` field elements."""
    return 8 * values + OVERHEAD_BYTES


def seal_ballot(
    noisy_votes: np.ndarray,
    *,
    tallier_keys: dict[str, X25519PublicKey],
    field: MpcField,
    layout: CheckedLayout,
    sender: Ed25519PrivateKey,
    run: str,
    round_number: int,
    hospital: str,
) -> dict[str, bytes]:
    """``noisy_votes`` (within ``layout``'s range) in checked shares among the talliers (in the order of
    ``tallier_keys``), each share sealed to its tallier."""
    shares = share_checked(noisy_votes, layout, len(tallier_keys), field.modulus)
    return {
        tallier: seal(
            to_bytes(vector), recipient=key, sender=sender, context=_share_context(run, round_number, hospital, tallier)
        )
        for (tallier, key), vector in zip(tallier_keys.items(), shares, strict=True)
    }


def open_share(
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
) -> np.ndarray:
    """The share ``hospital`` sealed to ``tallier`` for this round: ``values`` elements of the field (a checked
    share's), or ``BallotError``."""
    try:
        plaintext = open_box(
            box, recipient=recipient, sender=hospital_key, context=_share_context(run, round_number, hospital, tallier)
        )
        return from_bytes(plaintext, values, field.modulus)
    except (SealedBoxError, ShareError) as error:
        raise BallotError(f"the share from {hospital} for round {round_number} is refused: {error}") from None


def _share_context(run: str, round_number: int, hospital: str, tallier: str) -> bytes:
    return f"consilium/vote-share/v1|{run}|{round_number}|{hospital}|{tallier}".encode()
