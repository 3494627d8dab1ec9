"""A member's side of a round on the wire: each message the server relays, read into ``HospitalRound``'s
terms and answered (``docs/explanation/secure-round.md``).

RoundStart -> Update, Aggregate -> Endorsement, Endorsements -> Proof, Proofs -> Release, Releases -> the
opened sum (and the plaintext benchmark's Update and sum, which seal nothing). A relayed
message with parts missing, or a release that is not a ring element, is a ``RoundRefused`` naming the
server, which relayed it; what ``HospitalRound`` refuses names whom its checks caught. The hospital
records each step in its ledger and sends the answer (``protocol.run.hospital``).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.bfv_parameters import BfvParameters
from consilium.crypto.insecure_plaintext import InsecurePlaintextUploads
from consilium.crypto.one_time_keys import pack_ring
from consilium.protocol.secure_round.hospital_round import HospitalRound
from consilium.protocol.secure_round.statement import Endorsed, Proved, RoundRefused, released_from
from consilium.protocol.wire.messages import (
    Aggregate,
    Endorsement,
    Endorsements,
    Proof,
    Proofs,
    ProtocolError,
    Release,
    Releases,
    RoundStart,
    Update,
)

__all__ = ["endorsement", "opened_sum", "plaintext_sum", "plaintext_update", "proof", "release", "upload"]

Identities = Mapping[str, Ed25519PublicKey]


def upload(
    keys: HospitalRound,
    params: BfvParameters,
    share: np.ndarray,
    message: RoundStart,
    identities: Identities,
    *,
    next_key: bytes,
) -> Update:
    """The share under the round's one-time key, with that key's shares sealed to the members, and this
    member's box key for the next round (b"" after the last)."""
    try:
        chunks, boxes = keys.upload(_slots(params, share), message.box_keys, identities)
    except RoundRefused as refusal:
        raise ProtocolError(f"round {message.round}: {refusal}") from None
    return Update(round=message.round, chunks=tuple(chunks), boxes=boxes, next_box_key=next_key)


def _slots(params: BfvParameters, share: np.ndarray) -> np.ndarray:
    """An update's slots: its values as digits (``crypto.slot_digits``), the zero slots after them."""
    values = np.asarray(share)
    if values.shape != (params.vector_length,) or not np.issubdtype(values.dtype, np.integer):
        raise ProtocolError(
            f"an update of {values.dtype} and shape {values.shape}, not {params.vector_length} integers"
        )
    slots = params.slots_of(values)
    return slots


def endorsement(
    keys: HospitalRound, message: Aggregate, identities: Identities, *, round_state: dict, previous_result: bytes
) -> Endorsement:
    """Check the sum and the set, open this member's shares, and sign the round's one statement."""
    endorsed = keys.endorse(
        message.contributors,
        message.digests,
        message.chunks,
        message.boxes,
        identities,
        round_state=round_state,
        previous_result=previous_result,
    )
    return Endorsement(
        round=message.round, hashes=endorsed.hashes, commitment=endorsed.commitment, signature=endorsed.signature
    )


def proof(keys: HospitalRound, message: Endorsements, identities: Identities) -> Proof:
    """Prove this member's dealing, once every contributor endorsed the same statement."""
    if not set(message.hashes) == set(message.commitments) == set(message.signatures):
        raise RoundRefused(f"round {message.round}: endorsements with parts missing", named=["server"])
    endorsements = {
        name: Endorsed(message.hashes[name], message.commitments[name], message.signatures[name])
        for name in message.signatures
    }
    proved = keys.prove(endorsements, identities)
    return Proof(round=message.round, seed=proved.seed, proof=proved.proof, signature=proved.signature)


def release(keys: HospitalRound, public: PublicContext, message: Proofs, identities: Identities) -> Release:
    """This member's share of the sum's key, once every dealing to it checks."""
    if not set(message.seeds) == set(message.proofs) == set(message.signatures):
        raise RoundRefused(f"round {message.round}: proofs with parts missing", named=["server"])
    proofs = {
        name: Proved(message.seeds[name], message.proofs[name], message.signatures[name]) for name in message.seeds
    }
    released = keys.release(proofs, identities)
    share = pack_ring(public, released.release.share[np.newaxis])[0]
    return Release(round=message.round, share=share, masks=released.release.masks, signature=released.signature)


def opened_sum(keys: HospitalRound, public: PublicContext, message: Releases, identities: Identities) -> np.ndarray:
    """The round's sum, opened from every member's release: the summed values of the updates."""
    if not set(message.shares) == set(message.masks) == set(message.signatures):
        raise RoundRefused(f"round {message.round}: releases with parts missing", named=["server"])
    try:
        releases = {
            name: released_from(public, message.shares[name], message.masks[name], message.signatures[name])
            for name in message.shares
        }
    except BfvError as error:
        raise RoundRefused(f"round {message.round}: {error}", named=["server"]) from None
    slots = keys.open(releases, identities)
    params = public.params
    return params.values_of(slots)


def plaintext_update(
    params: BfvParameters, share: np.ndarray, message: RoundStart, *, name: str, next_key: bytes
) -> Update:
    """The plaintext benchmark's upload: the share in the clear (``crypto.insecure_plaintext``)."""
    chunks = InsecurePlaintextUploads(params).encrypt_update(share, round_number=message.round, hospital=name)
    return Update(round=message.round, chunks=tuple(chunks), boxes={}, next_box_key=next_key)


def plaintext_sum(params: BfvParameters, message: Aggregate) -> np.ndarray:
    """The plaintext benchmark's sum, as the server sends it."""
    try:
        return InsecurePlaintextUploads(params).decrypt_sum(
            message.chunks, round_number=message.round, contributors=message.contributors
        )
    except BfvError as error:
        raise ProtocolError(f"round {message.round}: the server's plaintext sum is unusable: {error}") from None
