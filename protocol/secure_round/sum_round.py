"""The server's side of a one-time-key round, without the network: add the uploads, then check the
endorsements, the proofs and the releases as the members do (it holds no share, so it checks no
dealing), and open the sum (``docs/explanation/secure-round.md``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.endorsement import one_time_statement
from consilium.crypto.one_time_keys import pack_ring, sum_uploads
from consilium.crypto.sealed_box import SealedBoxError, verify_box, verify_certified_key
from consilium.protocol.secure_round.statement import (
    Endorsed,
    Opened,
    Proved,
    Released,
    RoundRefused,
    RoundSetting,
    Steps,
    box_context,
    box_key_context,
    box_keys_digest,
    challenge_seed,
    dealing_challenges,
    endorsement_message,
    is_digest,
    proof_message,
    proofs_digest,
    read_chunks,
    signature_holds,
    upload_digest,
    upload_hashes,
    well_formed_proof,
    words_below,
)
from consilium.protocol.secure_round.checks import (
    check_endorsements,
    check_proofs,
    open_sum,
    right_release,
    signed_release,
)

__all__ = ["SumRound"]


class SumRound:
    """The server's side of one round: it adds uploads and opens the sum once the members released."""

    def __init__(self, setting: RoundSetting, public: PublicContext) -> None:
        self.setting, self.public = setting, public
        self._steps = Steps(setting)
        self._uploads: dict[str, np.ndarray] = {}
        self._hashed: dict[str, list[int]] = {}  # each upload's hashes under this round's statement
        self.digests: dict[str, bytes] = {}
        self._opened = Opened()

    def box_refusal(
        self, name: str, chunks: Sequence[bytes], boxes: Mapping[str, bytes], box_keys: Mapping[str, bytes], identities
    ) -> str:
        """Why the server refuses ``name``'s upload for its sealed shares (""): each must be signed by
        ``name`` for its recipient's certified box key of this round, bound to this upload, so that a
        box a hospital cannot open is never the relay's doing (review 4, finding 1)."""
        setting, digest = self.setting, upload_digest(list(chunks))
        for recipient, box in boxes.items():
            try:
                key = verify_certified_key(
                    box_keys[recipient],
                    signer=identities[recipient],
                    context=box_key_context(setting.run, recipient, setting.round_number),
                )
                verify_box(
                    box, recipient=key, sender=identities[name], context=box_context(setting, name, recipient, digest)
                )
            except (SealedBoxError, KeyError, TypeError) as error:
                return f"the share {name} sealed to {recipient} does not verify: {error}"
        return ""

    def add(self, name: str, chunks: Sequence[bytes]) -> None:
        """Take ``name``'s upload (``BfvError`` if it is not one, and nothing changes)."""
        if self._steps._done:
            raise BfvError("the round's sum is made: no upload is taken any more")
        if name in self._uploads:
            raise BfvError(f"a second upload from {name}")
        self._uploads[name] = read_chunks(self.public, chunks, "upload")
        self.digests[name] = upload_digest(list(chunks))

    def total(
        self,
        contributors: Sequence[str],
        box_keys: Mapping[str, bytes],
        *,
        round_state: Mapping[str, float],
        previous_result: bytes,
    ) -> list[bytes]:
        """The sum of the contributors' uploads, packed as an upload; fixes the statement every member
        must sign (``crypto.endorsement.one_time_statement``)."""

        def make() -> list[bytes]:
            members = tuple(contributors)
            total = sum_uploads(self.public, [self._uploads[name] for name in members])
            packed = pack_ring(self.public, total)
            statement = one_time_statement(
                run=self.setting.run,
                round_number=self.setting.round_number,
                contributors=members,
                upload_digests=[self.digests[name] for name in members],
                sum_digest=upload_digest(packed),
                round_state=round_state,
                box_keys_digest=box_keys_digest(self.setting, box_keys),
                previous_result=previous_result,
            )
            self._opened = Opened(statement, members, total)
            return packed

        return self._steps.run(1, "the sum", make)

    @property
    def statement_bytes(self) -> bytes:
        """The statement every member signs, once the sum is made."""
        return self._opened.statement

    def endorsement_refusal(self, name: str, endorsed: Endorsed, identity: Ed25519PublicKey) -> str:
        """Why the server rejects one member's endorsement as it arrives (""): not its signature on this
        round's statement, or hashes of another upload than the one it sent."""
        opened, hashes = self._opened, upload_hashes(self.setting, self._opened.statement)
        if not (
            words_below(endorsed.hashes, hashes.count, self.setting.params.ciphertext_modulus)
            and is_digest(endorsed.commitment)
            and signature_holds(
                identity,
                endorsed.signature,
                endorsement_message(opened.statement, endorsed.hashes, endorsed.commitment),
            )
        ):
            return f"{name}'s endorsement is not its signature on this round"
        if list(endorsed.hashes) != self._hashes_of(name):
            return f"{name} signed hashes of another upload than its own"
        return ""

    def _hashes_of(self, name: str) -> list[int]:
        """``name``'s upload's hashes under the statement, computed once (the server checks each
        endorsement as it arrives, then all together)."""
        if name not in self._hashed:
            self._hashed[name] = upload_hashes(self.setting, self._opened.statement).products(self._uploads[name])
        return self._hashed[name]

    def proof_refusal(self, name: str, proved: Proved, identity: Ed25519PublicKey) -> str:
        """Why the server rejects one member's proof as it arrives (""): under other challenges, or not
        its well-formed signed proof."""
        opened = self._opened
        if proved.seed != opened.seed:
            return f"{name} proved under other challenges than this round's"
        if not (
            well_formed_proof(self.setting, proved.proof)
            and signature_holds(identity, proved.signature, proof_message(opened.statement, opened.seed, proved.proof))
        ):
            return f"{name}'s proof is not its signed proof"
        return ""

    def release_refusal(self, name: str, released: Released, identity: Ed25519PublicKey) -> str:
        """Why the server rejects one member's release as it arrives (""): not its signed release.
        ``RoundRefused`` naming the member where it signed wrong values (off its commitment or its
        dealers' proofs): the whole check of ``open_sum``, run as each release arrives, so that the
        member is caught then (review 5, finding 3)."""
        opened = self._opened
        if not signed_release(self.setting, opened, identity, released):
            return f"{name}'s release is not its signed release over this round's proofs"
        if not right_release(self.setting, opened, name, released, dealing_challenges(self.setting, opened.seed)):
            raise RoundRefused(
                f"round {self.setting.round_number}: {name} released wrong values, which it signed", named=[name]
            )
        return ""

    def endorsed(self, endorsements: Mapping[str, Endorsed], identities: Mapping[str, Ed25519PublicKey]) -> None:
        def check() -> None:
            check_endorsements(self.setting, self._opened, endorsements, identities, hashes_of=self._hashes_of)
            self._opened.endorsements = dict(endorsements)
            self._opened.seed = challenge_seed(self.setting, self._opened)

        self._steps.run(2, "the endorsements", check)

    def proved(self, proofs: Mapping[str, Proved], identities: Mapping[str, Ed25519PublicKey]) -> None:
        def check() -> None:
            check_proofs(self.setting, self._opened, proofs, identities)
            self._opened.proofs = dict(proofs)
            self._opened.proofs_digest = proofs_digest(self.setting, self._opened)

        self._steps.run(3, "the proofs", check)

    def open(self, releases: Mapping[str, Released], identities: Mapping[str, Ed25519PublicKey]) -> np.ndarray:
        return self._steps.run(
            4, "opening the sum", lambda: open_sum(self.setting, self.public, self._opened, releases, identities)
        )
