"""A voting round that released nothing, proven by every tallier, so that its hospitals' charges are cancelled.

The design and its review are in ``docs/explanation/void-rounds.md``. A tallier signs the void
statement of a round only if the round failed for too few voters before any output of it was
computed (``tallier.mpc``: the talliers pin that the output began, then pass a barrier, before
anything vote-dependent is opened), and it names the box key the hospitals sealed that round's
ballots to: only the tallier state that saw those ballots can void them. A hospital accepts a void
only for the round it last sealed a ballot in, under the keys it sealed to, signed by every tallier
of the run, and at most ``MAX_VOIDS`` times a run.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

__all__ = ["MAX_VOIDS", "VoidError", "check_void", "sign_void", "void_signers"]

# Voided rounds a hospital accepts in one run: a corrupt tallier can make any round fail for too few voters,
# and without a cap a server working with it would have the hospitals vote on its queries for free.
MAX_VOIDS = 3


class VoidError(ValueError):
    """A round void that does not prove what it claims: the round's charge stays."""


def sign_void(
    signing: Ed25519PrivateKey, *, run: str, round_number: int, tallier: str, box_key: X25519PublicKey
) -> bytes:
    """``tallier``'s signature that round ``round_number`` of ``run`` released nothing, naming its box key."""
    return signing.sign(_statement(run, round_number, tallier, box_key))


def check_void(
    signatures: dict[str, bytes],
    *,
    round_number: int,
    last_ballot: tuple[int, dict[str, X25519PublicKey]],
    voids: int,
    identities: dict[str, Ed25519PublicKey],
    run: str,
) -> None:
    """``VoidError`` unless a hospital may cancel the charge of ``round_number`` of ``run``: it is the round of its
    last ballot (``last_ballot``: that round and the box keys it sealed to, by tallier), the run has had fewer
    than ``MAX_VOIDS`` ``voids``, and every tallier of ``identities`` (the run's, with their roster identities)
    signed the round's void naming the box key the ballot was sealed to."""
    sealed_round, box_keys = last_ballot
    if round_number != sealed_round:
        raise VoidError(f"it is of round {round_number}, not of round {sealed_round}, this hospital's last ballot")
    if voids >= MAX_VOIDS:
        raise VoidError(f"{MAX_VOIDS} rounds of this run were void already")
    if set(signatures) != set(identities) or set(box_keys) != set(identities):
        raise VoidError(f"signed by {sorted(signatures)}, not by every tallier of the run {sorted(identities)}")
    signers = void_signers(signatures, run=run, round_number=round_number, identities=identities, box_keys=box_keys)
    if unverified := sorted(set(identities) - signers):
        raise VoidError(
            f"{', '.join(unverified)}'s signature does not verify for round {round_number} of this run under the box "
            "key this hospital sealed to"
        )


def void_signers(
    signatures: dict[str, bytes],
    *,
    run: str,
    round_number: int,
    identities: dict[str, Ed25519PublicKey],
    box_keys: dict[str, X25519PublicKey],
) -> set[str]:
    """The talliers whose signature in ``signatures`` verifies, under their identity, as their void of round
    ``round_number`` of ``run`` naming their box key in ``box_keys``: what a hospital and the server check alike."""
    signers = set()
    for tallier, signature in signatures.items():
        if tallier not in identities or tallier not in box_keys:
            continue
        try:
            identities[tallier].verify(signature, _statement(run, round_number, tallier, box_keys[tallier]))
        except InvalidSignature:
            continue
        signers.add(tallier)
    return signers


def _statement(run: str, round_number: int, tallier: str, box_key: X25519PublicKey) -> bytes:
    raw = box_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"consilium/round-void/v1|{run}|{round_number}|{tallier}|{raw.hex()}".encode()
