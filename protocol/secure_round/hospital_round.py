"""One hospital's side of a one-time-key round, without the network: upload and deal, endorse, prove
its dealing, release, open the sum (``docs/explanation/secure-round.md`` argues each step). What it
signs and hashes is ``statement``'s; what it checks of the others, ``checks``'. After a refusal it
refuses every later step.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.endorsement import one_time_statement
from consilium.crypto.key_shares import DealtShare, Release, check_share, release
from consilium.crypto.one_time_keys import OneTimeKey, unpack_ring
from consilium.crypto.sealed_box import SealedBoxError, box_key, open_box, seal, verify_box
from consilium.protocol.secure_round.statement import (
    DIGEST_BYTES,
    Endorsed,
    Opened,
    Proved,
    Released,
    RoundRefused,
    RoundSetting,
    Steps,
    box_context,
    box_keys_digest,
    challenge_seed,
    check_box_keys,
    dealing_challenges,
    endorsement_message,
    proof_message,
    proofs_digest,
    read_chunks,
    release_commitment,
    release_message,
    share_bytes,
    share_from,
    upload_digest,
    upload_hashes,
)
from consilium.protocol.secure_round.checks import check_endorsements, check_proofs, open_sum

__all__ = ["HospitalRound"]


class HospitalRound:
    """One hospital's side of one round."""

    def __init__(
        self,
        setting: RoundSetting,
        public: PublicContext,
        *,
        name: str,
        signing: Ed25519PrivateKey,
        box: X25519PrivateKey,
    ) -> None:
        self._setting, self._public, self._name = setting, public, name
        self._signing, self._box = signing, box
        self._steps = Steps(setting)
        self._key: OneTimeKey | None = None
        self._upload: np.ndarray | None = None
        self._digest = b""
        self._box_keys_digest = b""
        self._shares: dict[str, DealtShare] = {}
        self._openings: dict[str, bytes] = {}  # each dealer's box key: evidence, should it have cheated
        self._release: Release | None = None
        self._opened = Opened()

    def upload(
        self, slots: np.ndarray, box_keys: Mapping[str, bytes], identities: Mapping[str, Ed25519PublicKey]
    ) -> tuple[list[bytes], dict[str, bytes]]:
        """The upload (``c0`` of each ciphertext) and a share sealed to every hospital's box key, once
        each certificate checks for this round (``box_key_context``)."""
        return self._steps.run(1, "the upload", lambda: self._do_upload(slots, box_keys, identities))

    def endorse(
        self,
        contributors: Sequence[str],
        digests: Mapping[str, bytes],
        total: Sequence[bytes],
        boxes: Mapping[str, bytes],
        identities: Mapping[str, Ed25519PublicKey],
        *,
        round_state: Mapping[str, float],
        previous_result: bytes,
    ) -> Endorsed:
        """Check the server's set and sum, open this hospital's shares from each member, and sign the
        round's one statement with the upload's hashes and a commitment to the release.
        ``previous_result`` is a digest of this hospital's model and update rule's state at the
        round's start: the same at every honest hospital that applied the same sums."""
        return self._steps.run(
            2,
            "the endorsement",
            lambda: self._do_endorse(contributors, digests, total, boxes, identities, round_state, previous_result),
        )

    def prove(self, endorsements: Mapping[str, Endorsed], identities: Mapping[str, Ed25519PublicKey]) -> Proved:
        """The signed proof of this hospital's dealing, once every member endorsed the statement it
        signed and their hashes add up to the sum's. Computed once: a second proof under other
        challenges would unmask linear forms of the key (review 2, R6)."""
        return self._steps.run(3, "the proof", lambda: self._do_prove(endorsements, identities))

    def release(self, proofs: Mapping[str, Proved], identities: Mapping[str, Ed25519PublicKey]) -> Released:
        """This hospital's signed release, once every member's signed proof, under the same challenges,
        matches the share it dealt this hospital. A dealer whose proof does not is named, with that
        box's key as evidence: only a dealer whose own signed proof contradicts its own signed box can
        be. The caller records the release durably before sending it."""
        return self._steps.run(4, "the release", lambda: self._do_release(proofs, identities))

    def open(self, releases: Mapping[str, Released], identities: Mapping[str, Ed25519PublicKey]) -> np.ndarray:
        """The sum's slots, from every member's release (``open_sum``)."""
        return self._steps.run(
            5, "opening the sum", lambda: open_sum(self._setting, self._public, self._opened, releases, identities)
        )

    def _do_upload(self, slots, box_keys, identities):
        setting = self._setting
        recipients = check_box_keys(setting, self._name, box_keys, identities)
        self._box_keys_digest = box_keys_digest(setting, box_keys)
        self._key = OneTimeKey(self._public, threshold=setting.threshold, parties=len(setting.hospitals))
        chunks = self._key.encrypt(slots, setting.public_polynomials)
        self._upload = unpack_ring(self._public, chunks, "our upload")
        self._digest = upload_digest(chunks)
        boxes = {
            owner: seal(
                share_bytes(self._public, self._key.dealing.shares[setting.party(owner) - 1]),
                recipient=recipients[owner],
                sender=self._signing,
                context=box_context(setting, self._name, owner, self._digest),
            )
            for owner in recipients
        }
        return chunks, boxes

    def _do_endorse(self, contributors, digests, total, boxes, identities, round_state, previous_result):
        setting, number = self._setting, self._setting.round_number
        members = tuple(contributors)
        if (
            self._name not in members
            or len(set(members)) != len(members)
            or not set(members) <= set(setting.hospitals)
            or list(members) != sorted(members, key=setting.hospitals.index)
        ):
            raise RoundRefused(
                f"round {number}: the contributor list {list(members)} is inconsistent", named=["server"]
            )
        if len(members) < setting.quorum:
            raise RoundRefused(f"round {number}: {len(members)} contributors, fewer than the quorum", named=["server"])
        if (
            set(digests) != set(members)
            or set(boxes) != set(members)
            or any(type(digest) is not bytes or len(digest) != DIGEST_BYTES for digest in digests.values())
            or digests[self._name] != self._digest
        ):
            raise RoundRefused(
                f"round {number}: the uploads listed are not the members' (ours included)", named=["server"]
            )
        try:
            summed = read_chunks(self._public, total, "the sum")
        except BfvError as error:
            raise RoundRefused(f"round {number}: {error}", named=["server"]) from None
        for dealer in members:
            self._shares[dealer] = self._open_share(dealer, boxes[dealer], digests[dealer], identities[dealer])
        self._box = None  # every box of this round is open: the private key has nothing left to open
        statement = one_time_statement(
            run=setting.run,
            round_number=number,
            contributors=members,
            upload_digests=[digests[name] for name in members],
            sum_digest=upload_digest(list(total)),
            round_state=round_state,
            box_keys_digest=self._box_keys_digest,
            previous_result=previous_result,
        )
        self._release = release([self._shares[dealer] for dealer in members], setting.params.ciphertext_modulus)
        hashes = tuple(upload_hashes(setting, statement).products(self._upload))
        commitment = release_commitment(setting, self._name, self._release)
        self._opened = Opened(statement, members, summed)
        return Endorsed(hashes, commitment, self._signing.sign(endorsement_message(statement, hashes, commitment)))

    def _open_share(self, dealer: str, box: bytes, digest: bytes, identity: Ed25519PublicKey) -> DealtShare:
        """The share ``dealer`` sealed to us. A box whose signature fails names the relay (the server
        checks every dealer's signatures before it relays: review 4, finding 1); one that is signed
        but does not decrypt, or holds no share, names the dealer, with the box's key (evidence that
        convicts where the box opens to no share: ``check_opening``; review 3, finding 6)."""
        number = self._setting.round_number
        context = box_context(self._setting, dealer, self._name, digest)
        if type(box) is not bytes:
            raise RoundRefused(f"round {number}: the share from {dealer} is not a box", named=["server"])
        try:
            verify_box(box, recipient=self._box.public_key(), sender=identity, context=context)
        except SealedBoxError as error:
            raise RoundRefused(
                f"round {number}: the share from {dealer} does not verify: {error}", named=["server"]
            ) from None
        self._openings[dealer] = box_key(box, recipient=self._box)  # verify_box refused a low-order ephemeral key
        try:
            payload = open_box(box, recipient=self._box, sender=identity, context=context)
        except SealedBoxError as error:
            raise RoundRefused(
                f"round {number}: {dealer} signed a share that does not open: {error}",
                named=[dealer],
                openings={dealer: self._openings[dealer]},
            ) from None
        try:
            return share_from(self._public, payload)
        except BfvError as error:
            raise RoundRefused(
                f"round {number}: {dealer} sealed us no share: {error}",
                named=[dealer],
                openings={dealer: self._openings[dealer]},
            ) from None

    def _do_prove(self, endorsements, identities):
        opened = self._opened
        check_endorsements(self._setting, opened, endorsements, identities)
        opened.endorsements = dict(endorsements)
        opened.seed = challenge_seed(self._setting, opened)
        proof = self._key.dealing.proof(dealing_challenges(self._setting, opened.seed))
        self._key = None  # the key and its dealing are not needed after the proof (review 2, R8)
        return Proved(opened.seed, proof, self._signing.sign(proof_message(opened.statement, opened.seed, proof)))

    def _do_release(self, proofs, identities):
        setting, opened = self._setting, self._opened
        check_proofs(setting, opened, proofs, identities)
        opened.proofs = dict(proofs)
        opened.proofs_digest = proofs_digest(setting, opened)
        challenges, me = dealing_challenges(setting, opened.seed), setting.party(self._name)
        dishonest = [
            dealer
            for dealer in opened.contributors
            if not check_share(self._shares[dealer], me, proofs[dealer].proof, challenges, threshold=setting.threshold)
        ]
        if dishonest:
            raise RoundRefused(
                f"round {setting.round_number}: the shares {', '.join(dishonest)} dealt us are not on the "
                "polynomials they proved",
                named=dishonest,
                openings={dealer: self._openings[dealer] for dealer in dishonest},
            )
        message = release_message(opened.statement, opened.seed, opened.proofs_digest, self._release)
        return Released(self._release, self._signing.sign(message))
