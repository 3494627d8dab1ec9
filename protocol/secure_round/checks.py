"""What anyone can check of a one-time-key round: the members' endorsements and dealing proofs, a
release, the opened sum, and a refusal's opening of a dealer's box.

A hospital's refusal of a dishonest dealer carries, per dealer, that box's own key
(``crypto.sealed_box.box_key``): with the relayed box and the dealer's signed proof, anyone can
check it (``check_opening``). The argument for each check is in ``docs/explanation/secure-round.md``.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.key_shares import check_release, check_share, interpolate, rebuild
from consilium.crypto.linear_hash import LinearHash
from consilium.crypto.one_time_keys import check_zero_slots, decrypt_sum
from consilium.crypto.sealed_box import SealedBoxError, open_with_box_key, verify_certified_key
from consilium.protocol.secure_round.statement import (
    Endorsed,
    Opened,
    Proved,
    Released,
    RoundRefused,
    RoundSetting,
    box_context,
    box_key_context,
    dealing_challenges,
    encodable_release,
    endorsement_message,
    is_digest,
    proof_message,
    release_commitment,
    release_message,
    share_from,
    signature_holds,
    upload_hashes,
    well_formed_proof,
    within_field,
    words_below,
)

__all__ = [
    "check_endorsements",
    "check_opening",
    "check_proofs",
    "open_sum",
    "right_release",
    "signed_release",
]


def signed_release(setting: RoundSetting, opened: Opened, identity: Ed25519PublicKey, released: Released) -> bool:
    """``released`` is well formed and its member's signature over this round's statement and proofs."""
    return encodable_release(setting, released.release) and signature_holds(
        identity,
        released.signature,
        release_message(opened.statement, opened.seed, opened.proofs_digest, released.release),
    )


def right_release(setting: RoundSetting, opened: Opened, name: str, released: Released, challenges: LinearHash) -> bool:
    """``name``'s release is in the field, the one its endorsement committed to, and on its dealers'
    proofs under the round's ``challenges``."""
    proofs = [opened.proofs[member].proof for member in opened.contributors]
    return (
        within_field(setting, released.release)
        and release_commitment(setting, name, released.release) == opened.endorsements[name].commitment
        and check_release(released.release, setting.party(name), proofs, challenges, threshold=setting.threshold)
    )


def open_sum(
    setting: RoundSetting,
    public: PublicContext,
    opened: Opened,
    releases: Mapping[str, Released],
    identities: Mapping[str, Ed25519PublicKey],
) -> np.ndarray:
    """The sum's slots from every member's release. Each must be well formed and signed by its member
    over the proofs this party holds (else the relay is named; a release over other proofs means a
    dealer signed two, or the relay split them: review 3, finding 2), match the commitment in its
    endorsement and pass the check against the signed proofs (else its member is named: it
    released only after every dealing to it checked). Every member's release is needed, so no party
    chooses, after seeing the honest ones, which are used (review 2, R3); all must lie on one
    polynomial of degree ``tau - 1``, and the key is rebuilt from the ``tau`` with the smallest
    points. The zero slots then catch an upload made under another key than its dealer shared; a
    dishonest member that fits that key is changing its own input."""
    number, members = setting.round_number, opened.contributors
    if set(releases) != set(members):
        raise RoundRefused(f"round {number}: releases from {sorted(releases)}, not from every member", named=["server"])
    named, challenges = [], dealing_challenges(setting, opened.seed)
    for name in members:
        released = releases[name]
        if not (isinstance(released, Released) and signed_release(setting, opened, identities[name], released)):
            raise RoundRefused(
                f"round {number}: {name}'s release is not its signed release over the proofs we hold", named=["server"]
            )
        if not right_release(setting, opened, name, released, challenges):
            named.append(name)  # it signed this release: the fault is its own
    if named:
        raise RoundRefused(f"round {number}: {', '.join(named)} released wrong values", named=named)
    q = setting.params.ciphertext_modulus
    points = {setting.party(name): releases[name].release.share for name in members}
    chosen = dict(sorted(points.items())[: setting.threshold])
    for x, share in points.items():
        if x not in chosen and not np.array_equal(interpolate(chosen, x, q), share):
            raise RoundRefused(f"round {number}: the releases do not lie on one polynomial")
    slots = decrypt_sum(public, opened.total, rebuild(chosen, setting.threshold, q), setting.public_polynomials)
    try:
        check_zero_slots(public, slots, setting.params.digits.slots_for(setting.params.vector_length))
    except BfvError:
        raise RoundRefused(
            f"round {number}: the sum does not decrypt under the keys its members dealt: an upload was made "
            "under another key"
        ) from None
    return slots


def check_endorsements(
    setting: RoundSetting,
    opened: Opened,
    endorsements: Mapping[str, Endorsed],
    identities: Mapping[str, Ed25519PublicKey],
    *,
    hashes_of: Callable[[str], list[int]] | None = None,
) -> None:
    """Every member signed this statement, and the hashes they signed add up to the sum's. The
    server, which holds every upload (``hashes_of`` gives each one's hashes), names a member whose
    hashes are not of its own upload; a hospital cannot tell that from a relay that changed the sum
    (review 3, finding 9)."""
    number = setting.round_number
    if set(endorsements) != set(opened.contributors):
        raise RoundRefused(
            f"round {number}: endorsements from {sorted(endorsements)}, not from every member", named=["server"]
        )
    hashes = upload_hashes(setting, opened.statement)
    q = setting.params.ciphertext_modulus
    for name, endorsed in endorsements.items():
        if not (
            isinstance(endorsed, Endorsed)
            and words_below(endorsed.hashes, hashes.count, q)
            and is_digest(endorsed.commitment)
            and signature_holds(
                identities[name],
                endorsed.signature,
                endorsement_message(opened.statement, endorsed.hashes, endorsed.commitment),
            )
        ):
            raise RoundRefused(
                f"round {number}: {name}'s endorsement is not its signature on this round", named=["server"]
            )
    if hashes_of is not None:
        false = [name for name, endorsed in endorsements.items() if list(endorsed.hashes) != hashes_of(name)]
        if false:
            raise RoundRefused(f"round {number}: {', '.join(false)} signed hashes of another upload", named=false)
    signed = [sum(column) % q for column in zip(*(endorsed.hashes for endorsed in endorsements.values()))]
    if signed != hashes.products(opened.total):
        raise RoundRefused(
            f"round {number}: the sum is not the members' uploads (or a member signed hashes of another)",
            named=["server"],
        )


def check_proofs(
    setting: RoundSetting, opened: Opened, proofs: Mapping[str, Proved], identities: Mapping[str, Ed25519PublicKey]
) -> None:
    """Every member signed one well-formed proof under this party's challenges' seed. A proof under
    another seed means members were shown different endorsements (the relay, or a member that
    endorsed twice): the round ends naming the relay, and no share is opened (review 2, R2). A
    proof of the wrong shape, type or range names the relay before its signature is looked at:
    only a well-formed signed proof can lead to an opening (review 3, finding 1)."""
    number = setting.round_number
    if set(proofs) != set(opened.contributors):
        raise RoundRefused(f"round {number}: proofs from {sorted(proofs)}, not from every member", named=["server"])
    for name, proved in proofs.items():
        if not isinstance(proved, Proved) or proved.seed != opened.seed:
            raise RoundRefused(
                f"round {number}: {name} proved under other challenges: endorsements were split", named=["server"]
            )
        if not (
            well_formed_proof(setting, proved.proof)
            and signature_holds(
                identities[name], proved.signature, proof_message(opened.statement, opened.seed, proved.proof)
            )
        ):
            raise RoundRefused(f"round {number}: {name}'s proof is not its signed proof", named=["server"])


def check_opening(
    setting: RoundSetting,
    public: PublicContext,
    *,
    statement: bytes,
    dealer: str,
    recipient: str,
    box: bytes,
    key: bytes,
    dealer_upload: bytes,
    recipient_box_key: bytes,
    identities: Mapping[str, Ed25519PublicKey],
    proved: Proved | None,
) -> bool:
    """Whether a recipient's opening convicts ``dealer``: its box, signed by it, to the recipient's
    certified box key of this round, opened with ``key``, holds no share, or (given the dealer's
    signed ``proved``) one off that proof (``True``). ``False`` shows the complaint false, or
    unproven (a box that does not decrypt under the key shown proves nothing: the key may be false)."""
    try:
        recipient_key = verify_certified_key(
            recipient_box_key,
            signer=identities[recipient],
            context=box_key_context(setting.run, recipient, setting.round_number),
        )
        if type(key) is not bytes or (
            proved is not None
            and not (
                isinstance(proved, Proved)
                and well_formed_proof(setting, proved.proof)
                and signature_holds(
                    identities[dealer], proved.signature, proof_message(statement, proved.seed, proved.proof)
                )
            )
        ):
            return False
        payload = open_with_box_key(
            box,
            key=key,
            recipient=recipient_key,
            sender=identities[dealer],
            context=box_context(setting, dealer, recipient, dealer_upload),
        )
    except (SealedBoxError, ValueError, TypeError):
        return False
    try:
        dealt = share_from(public, payload)
    except BfvError:
        return True  # it signed a box that holds no share
    if proved is None:
        return False
    challenges = dealing_challenges(setting, proved.seed)
    return not check_share(dealt, setting.party(recipient), proved.proof, challenges, threshold=setting.threshold)
