"""Endorsed aggregates: a hospital decrypts a sum only once every listed contributor vouches for it.

Check slots (``crypto.membership``) prove that an aggregate adds one fresh contribution from each
contributor it lists. They do not stop a server from *equivocating*: with a quorum below the
number of hospitals it can send the sum over ``S1 = {1, 2}`` to hospital 1 and the sum over
``S2 = {2, 3}`` to hospital 3 in the same round. Each passes its check, and the two releases
together count hospital 2's update twice while its ledger charges it once (with three such sums
the server solves for every single update).

**The rule.** Every contributor ``k`` in ``S`` signs, with its Ed25519 identity key, ::

    statement = SHA-256(label | run | round | S in order | SHA-256 of each aggregate chunk)

and signs at most one statement per round. A hospital decrypts and releases only once it holds a
valid signature of every member of ``S`` on the statement of the aggregate it holds.

**Why that suffices.** Hospital ``j``'s update of round ``r`` enters a decrypted sum only if ``j``
is in that sum's ``S`` (otherwise the check slots fail), and then ``j`` signed that ``S`` and those
exact ciphertexts. ``j`` signs one statement per round, so every decryption that contains ``j``'s
update is of one and the same aggregate: its update is released at most once, as its ledger
assumes. ``run`` names the run and digests every setting each signer was given
(``protocol.config.RunConfig.fingerprint``): all signers of a statement took part under the same
noise and quorum, so the sum carries the noise each of them charged. The round is in the statement,
and a hospital's ledger refuses a run id it has seen before, so no signature carries over to another
run or round.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Mapping, Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = ["EndorsementError", "aggregate_statement", "check_endorsements", "endorse", "one_time_statement"]

_LABEL = b"consilium endorsed aggregate v1"
_ONE_TIME_LABEL = b"consilium one-time-key round v1"


class EndorsementError(ValueError):
    """Endorsements that do not show every contributor vouching for this aggregate."""


def aggregate_statement(
    *,
    run: str,
    round_number: int,
    contributors: Sequence[str],
    chunks: Sequence[bytes],
    round_state: Mapping[str, float],
) -> bytes:
    """The 32 bytes a contributor signs for one aggregate: unambiguous, as every part is length-prefixed.

    ``round_state`` is what the contributor's share was made with beyond the run's settings (the
    number of sub-clients and the clipping bound, where they adapt), each value as an IEEE double,
    exact for whole numbers and float32 values: contributors that disagree on it sign different statements."""
    statement = hashlib.sha256()
    parts = [_LABEL, run.encode(), b"%d" % round_number, b"%d" % len(contributors)]
    parts += [name.encode() for name in contributors]
    parts += [b"%d" % len(chunks)] + [hashlib.sha256(chunk).digest() for chunk in chunks]
    parts += _round_state_parts(round_state)
    return _digest(statement, parts)


def one_time_statement(
    *,
    run: str,
    round_number: int,
    contributors: Sequence[str],
    upload_digests: Sequence[bytes],
    sum_digest: bytes,
    round_state: Mapping[str, float],
    box_keys_digest: bytes,
    previous_result: bytes,
) -> bytes:
    """The 32 bytes every contributor of a one-time-key round signs (``docs/explanation/secure-round.md``):
    the set, each member's upload digest, the sum's, the round state, the round's box keys and the
    previous round's result, each part length-prefixed."""
    parts = [_ONE_TIME_LABEL, run.encode(), b"%d" % round_number, b"%d" % len(contributors)]
    parts += [name.encode() for name in contributors] + list(upload_digests)
    parts += [sum_digest, box_keys_digest, previous_result] + _round_state_parts(round_state)
    return _digest(hashlib.sha256(), parts)


def _round_state_parts(round_state: Mapping[str, float]) -> list[bytes]:
    return [b"%d" % len(round_state)] + [
        name.encode() + b"=" + struct.pack(">d", value) for name, value in sorted(round_state.items())
    ]


def _digest(statement, parts: list[bytes]) -> bytes:
    for part in parts:
        statement.update(struct.pack(">Q", len(part)) + part)
    return statement.digest()


def endorse(statement: bytes, signer: Ed25519PrivateKey) -> bytes:
    return signer.sign(_LABEL + statement)


def check_endorsements(
    statement: bytes, signatures: Mapping[str, bytes], contributors: Mapping[str, Ed25519PublicKey]
) -> None:
    """Raise ``EndorsementError`` unless ``signatures`` holds exactly one valid signature per contributor."""
    if set(signatures) != set(contributors):
        missing, extra = sorted(set(contributors) - set(signatures)), len(set(signatures) - set(contributors))
        raise EndorsementError(f"endorsements missing from {missing}, and {extra} from parties that did not contribute")
    for name, signature in signatures.items():
        try:
            contributors[name].verify(signature, _LABEL + statement)
        except InvalidSignature:
            raise EndorsementError(f"{name}'s endorsement is not its signature on this aggregate") from None
