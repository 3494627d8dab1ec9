"""One round of the secure sum with one-time keys, both sides, without the network.

The message sequence and the argument for each check are in ``docs/explanation/secure-round.md``;
this module holds what each party computes and checks at each step, so the roles only carry
messages. ``HospitalRound`` is one hospital's side of one round: upload and deal, endorse, prove its
dealing, release, open the sum. ``SumRound`` is the server's: add the uploads, then check the
endorsements, the proofs and the releases as the members do (it holds no share, so it checks no
dealing). Both open the sum with ``open_sum``.

Everything a peer sends is checked for its shape, type and range before anything else, and every
signed or hashed value is a canonical, length-prefixed encoding (``_frame``), so that no value has
two encodings a signature would cover alike (review 3, findings 1, 5, 11, 12). A check that fails
raises ``RoundRefused`` with the reason and whom it names (``"server"`` where the relay alone can
have done it); after a refusal the object refuses every later step. A hospital's refusal of a
dishonest dealer carries, per dealer, that box's own key (``crypto.sealed_box.box_key``): with the
relayed box and the dealer's signed proof, anyone can check it (``check_opening``).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.bfv_parameters import BfvParameters
from consilium.crypto.endorsement import one_time_statement
from consilium.crypto.key_shares import DealtShare, Release, check_release, check_share, interpolate, rebuild, release
from consilium.crypto.linear_hash import LinearHash, challenge_count
from consilium.crypto.one_time_keys import (
    OneTimeKey,
    check_zero_slots,
    decrypt_sum,
    key_share_bytes,
    pack_ring,
    public_polynomials,
    sum_uploads,
    unpack_ring,
)
from consilium.crypto.sealed_box import (
    SealedBoxError,
    box_key,
    open_box,
    open_with_box_key,
    seal,
    verify_box,
    verify_certified_key,
)

__all__ = [
    "Endorsed",
    "HospitalRound",
    "Proved",
    "Released",
    "RoundRefused",
    "RoundSetting",
    "SumRound",
    "box_key_context",
    "check_box_keys",
    "check_opening",
    "check_threshold",
    "open_sum",
    "released_from",
    "state_digest",
]

_ENDORSEMENT_LABEL = b"consilium one-time endorsement v1"
_COMMITMENT_LABEL = b"consilium one-time release commitment v1"
_PROOF_LABEL = b"consilium one-time dealing proof v1"
_PROOFS_LABEL = b"consilium one-time proofs used v1"
_RELEASE_LABEL = b"consilium one-time release v1"
_SEED_LABEL = b"consilium one-time dealing challenges v1"
_HASHES_LABEL = b"consilium one-time upload hashes v1"
_UPLOAD_LABEL = b"consilium one-time upload v1"
_BOX_LABEL = b"consilium one-time key share v1"
_BOX_KEY_LABEL = b"consilium one-time box key v1"
_BOX_KEYS_LABEL = b"consilium one-time box keys v1"
_WORD = struct.Struct("<Q")
_DIGEST_BYTES = 32


class RoundRefused(RuntimeError):
    """A round a party refuses, and whom its checks name (``named``), with any openings as evidence."""

    def __init__(self, reason: str, *, named: Sequence[str] = (), openings: Mapping[str, bytes] | None = None) -> None:
        super().__init__(reason)
        self.named = tuple(named)
        self.openings = dict(openings or {})


def check_threshold(hospitals: int, threshold: int, quorum: int) -> None:
    """``ValueError`` unless ``tau`` and ``K_min`` give the design's guarantee (review F1): ``n >= 3``,
    ``floor(n/2) + 1 <= tau <= n`` and ``tau + 1 <= K_min <= n``, so every sum holds two honest updates."""
    if hospitals < 3:
        raise ValueError(f"one-time keys need at least 3 hospitals, not {hospitals}")
    if not hospitals // 2 + 1 <= threshold <= hospitals:
        raise ValueError(f"the threshold must be between {hospitals // 2 + 1} and {hospitals}, not {threshold}")
    if not threshold + 1 <= quorum <= hospitals:
        raise ValueError(f"the quorum must be at least the threshold plus one ({threshold + 1}), not {quorum}")


@dataclass(frozen=True)
class RoundSetting:
    """What every party of round ``round_number`` agrees on before it starts."""

    run: str  # RunConfig.fingerprint
    round_number: int
    hospitals: tuple[str, ...]  # the run's order: hospital i is Shamir party i + 1
    threshold: int
    quorum: int
    params: BfvParameters

    def __post_init__(self) -> None:
        if len(set(self.hospitals)) != len(self.hospitals):
            raise ValueError("a run's hospitals must be distinct")
        check_threshold(len(self.hospitals), self.threshold, self.quorum)

    def party(self, name: str) -> int:
        return self.hospitals.index(name) + 1

    @functools.cached_property
    def public_polynomials(self) -> np.ndarray:
        """``a_c`` of this round (``crypto.one_time_keys.public_polynomials``), derived once."""
        return public_polynomials(self.params, run=self.run, round_number=self.round_number)

    @property
    def challenges(self) -> int:
        return challenge_count(self.params.ciphertext_modulus)


def box_key_context(run: str, owner: str, round_number: int) -> bytes:
    """What a hospital's box key is certified for: one round of one run (review F3)."""
    return _frame(_BOX_KEY_LABEL, run.encode(), owner.encode(), b"%d" % round_number)


def _box_context(setting: RoundSetting, dealer: str, recipient: str, upload_digest: bytes) -> bytes:
    """What a sealed key share is bound to: run, round, dealer, recipient and the dealer's upload."""
    return _frame(
        _BOX_LABEL,
        setting.run.encode(),
        b"%d" % setting.round_number,
        dealer.encode(),
        recipient.encode(),
        upload_digest,
    )


@dataclass(frozen=True)
class Endorsed:
    """A member's signed endorsement: its upload's hashes under the statement's challenges, and its
    commitment to the release it will make."""

    hashes: tuple[int, ...]
    commitment: bytes
    signature: bytes


@dataclass(frozen=True)
class Proved:
    """A member's signed proof of its dealing, under the challenges' seed it computed."""

    seed: bytes
    proof: tuple[tuple[int, ...], ...]
    signature: bytes


@dataclass(frozen=True)
class Released:
    """A member's signed release; the signature also covers the proofs it checked its shares against."""

    release: Release
    signature: bytes


@dataclass
class _Opened:
    """What opening the sum needs, gathered as the round goes."""

    statement: bytes = b""
    contributors: tuple[str, ...] = ()
    total: np.ndarray | None = None
    endorsements: dict[str, Endorsed] = field(default_factory=dict)
    seed: bytes = b""
    proofs: dict[str, Proved] = field(default_factory=dict)
    proofs_digest: bytes = b""


class _Steps:
    """One step after another, each once; after a refusal, none."""

    def __init__(self, setting: RoundSetting) -> None:
        self._setting, self._done, self._refused = setting, 0, ""

    def run(self, number: int, name: str, step):
        if self._refused:
            raise RoundRefused(f"round {self._setting.round_number} was refused: {self._refused}")
        if self._done != number - 1:
            raise RoundRefused(f"round {self._setting.round_number}: {name} out of order, or a second time")
        try:
            result = step()
        except RoundRefused as refusal:
            self._refused = str(refusal)
            raise
        self._done = number
        return result


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
        self._steps = _Steps(setting)
        self._key: OneTimeKey | None = None
        self._upload: np.ndarray | None = None
        self._digest = b""
        self._box_keys_digest = b""
        self._shares: dict[str, DealtShare] = {}
        self._openings: dict[str, bytes] = {}  # each dealer's box key: evidence, should it have cheated
        self._release: Release | None = None
        self._opened = _Opened()

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
                _share_bytes(self._public, self._key.dealing.shares[setting.party(owner) - 1]),
                recipient=recipients[owner],
                sender=self._signing,
                context=_box_context(setting, self._name, owner, self._digest),
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
            or any(type(digest) is not bytes or len(digest) != _DIGEST_BYTES for digest in digests.values())
            or digests[self._name] != self._digest
        ):
            raise RoundRefused(
                f"round {number}: the uploads listed are not the members' (ours included)", named=["server"]
            )
        try:
            summed = _chunks(self._public, total, "the sum")
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
        hashes = tuple(_upload_hashes(setting, statement).products(self._upload))
        commitment = release_commitment(setting, self._name, self._release)
        self._opened = _Opened(statement, members, summed)
        return Endorsed(hashes, commitment, self._signing.sign(_endorsement_message(statement, hashes, commitment)))

    def _open_share(self, dealer: str, box: bytes, digest: bytes, identity: Ed25519PublicKey) -> DealtShare:
        """The share ``dealer`` sealed to us. A box whose signature fails names the relay (the server
        checks every dealer's signatures before it relays: review 4, finding 1); one that is signed
        but does not decrypt, or holds no share, names the dealer, with the box's key (evidence that
        convicts where the box opens to no share: ``check_opening``; review 3, finding 6)."""
        number = self._setting.round_number
        context = _box_context(self._setting, dealer, self._name, digest)
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
            return _share_from(self._public, payload)
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
        proof = self._key.dealing.proof(_challenges(self._setting, opened.seed))
        self._key = None  # the key and its dealing are not needed after the proof (review 2, R8)
        return Proved(opened.seed, proof, self._signing.sign(_proof_message(opened.statement, opened.seed, proof)))

    def _do_release(self, proofs, identities):
        setting, opened = self._setting, self._opened
        check_proofs(setting, opened, proofs, identities)
        opened.proofs = dict(proofs)
        opened.proofs_digest = proofs_digest(setting, opened)
        challenges, me = _challenges(setting, opened.seed), setting.party(self._name)
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
        message = _release_message(opened.statement, opened.seed, opened.proofs_digest, self._release)
        return Released(self._release, self._signing.sign(message))


class SumRound:
    """The server's side of one round: it adds uploads and opens the sum once the members released."""

    def __init__(self, setting: RoundSetting, public: PublicContext) -> None:
        self.setting, self.public = setting, public
        self._steps = _Steps(setting)
        self._uploads: dict[str, np.ndarray] = {}
        self._hashed: dict[str, list[int]] = {}  # each upload's hashes under this round's statement
        self.digests: dict[str, bytes] = {}
        self._opened = _Opened()

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
                    box, recipient=key, sender=identities[name], context=_box_context(setting, name, recipient, digest)
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
        self._uploads[name] = _chunks(self.public, chunks, "upload")
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
            self._opened = _Opened(statement, members, total)
            return packed

        return self._steps.run(1, "the sum", make)

    @property
    def statement_bytes(self) -> bytes:
        """The statement every member signs, once the sum is made."""
        return self._opened.statement

    def endorsement_refusal(self, name: str, endorsed: Endorsed, identity: Ed25519PublicKey) -> str:
        """Why the server rejects one member's endorsement as it arrives (""): not its signature on this
        round's statement, or hashes of another upload than the one it sent."""
        opened, hashes = self._opened, _upload_hashes(self.setting, self._opened.statement)
        if not (
            _words_below(endorsed.hashes, hashes.count, self.setting.params.ciphertext_modulus)
            and _is_digest(endorsed.commitment)
            and _signed(
                identity,
                endorsed.signature,
                _endorsement_message(opened.statement, endorsed.hashes, endorsed.commitment),
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
            self._hashed[name] = _upload_hashes(self.setting, self._opened.statement).products(self._uploads[name])
        return self._hashed[name]

    def proof_refusal(self, name: str, proved: Proved, identity: Ed25519PublicKey) -> str:
        """Why the server rejects one member's proof as it arrives (""): under other challenges, or not
        its well-formed signed proof."""
        opened = self._opened
        if proved.seed != opened.seed:
            return f"{name} proved under other challenges than this round's"
        if not (
            _well_formed_proof(self.setting, proved.proof)
            and _signed(identity, proved.signature, _proof_message(opened.statement, opened.seed, proved.proof))
        ):
            return f"{name}'s proof is not its signed proof"
        return ""

    def release_refusal(self, name: str, released: Released, identity: Ed25519PublicKey) -> str:
        """Why the server rejects one member's release as it arrives (""): not its signed release.
        ``RoundRefused`` naming the member where it signed wrong values (off its commitment or its
        dealers' proofs): the whole check of ``open_sum``, run as each release arrives, so that the
        member is caught then (review 5, finding 3)."""
        opened = self._opened
        if not _signed_release(self.setting, opened, identity, released):
            return f"{name}'s release is not its signed release over this round's proofs"
        if not _right_release(self.setting, opened, name, released, _challenges(self.setting, opened.seed)):
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


def _signed_release(setting: RoundSetting, opened: _Opened, identity: Ed25519PublicKey, released: Released) -> bool:
    """``released`` is well formed and its member's signature over this round's statement and proofs."""
    return _encodable_release(setting, released.release) and _signed(
        identity,
        released.signature,
        _release_message(opened.statement, opened.seed, opened.proofs_digest, released.release),
    )


def _right_release(
    setting: RoundSetting, opened: _Opened, name: str, released: Released, challenges: LinearHash
) -> bool:
    """``name``'s release is in the field, the one its endorsement committed to, and on its dealers'
    proofs under the round's ``challenges``."""
    proofs = [opened.proofs[member].proof for member in opened.contributors]
    return (
        _within_field(setting, released.release)
        and release_commitment(setting, name, released.release) == opened.endorsements[name].commitment
        and check_release(released.release, setting.party(name), proofs, challenges, threshold=setting.threshold)
    )


def open_sum(
    setting: RoundSetting,
    public: PublicContext,
    opened: _Opened,
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
    named, challenges = [], _challenges(setting, opened.seed)
    for name in members:
        released = releases[name]
        if not (isinstance(released, Released) and _signed_release(setting, opened, identities[name], released)):
            raise RoundRefused(
                f"round {number}: {name}'s release is not its signed release over the proofs we hold", named=["server"]
            )
        if not _right_release(setting, opened, name, released, challenges):
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
    opened: _Opened,
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
    hashes = _upload_hashes(setting, opened.statement)
    q = setting.params.ciphertext_modulus
    for name, endorsed in endorsements.items():
        if not (
            isinstance(endorsed, Endorsed)
            and _words_below(endorsed.hashes, hashes.count, q)
            and _is_digest(endorsed.commitment)
            and _signed(
                identities[name],
                endorsed.signature,
                _endorsement_message(opened.statement, endorsed.hashes, endorsed.commitment),
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
    setting: RoundSetting, opened: _Opened, proofs: Mapping[str, Proved], identities: Mapping[str, Ed25519PublicKey]
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
            _well_formed_proof(setting, proved.proof)
            and _signed(identities[name], proved.signature, _proof_message(opened.statement, opened.seed, proved.proof))
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
                and _well_formed_proof(setting, proved.proof)
                and _signed(identities[dealer], proved.signature, _proof_message(statement, proved.seed, proved.proof))
            )
        ):
            return False
        payload = open_with_box_key(
            box,
            key=key,
            recipient=recipient_key,
            sender=identities[dealer],
            context=_box_context(setting, dealer, recipient, dealer_upload),
        )
    except (SealedBoxError, ValueError, TypeError):
        return False
    try:
        dealt = _share_from(public, payload)
    except BfvError:
        return True  # it signed a box that holds no share
    if proved is None:
        return False
    challenges = _challenges(setting, proved.seed)
    return not check_share(dealt, setting.party(recipient), proved.proof, challenges, threshold=setting.threshold)


def released_from(public: PublicContext, share: bytes, masks: Sequence[int], signature: bytes) -> Released:
    """A release as it travels (its share packed) as the checks take it; ``BfvError`` if it does not unpack."""
    return Released(Release(unpack_ring(public, [share], "a release")[0], tuple(masks)), signature)


def state_digest(parameters: bytes, optimizer_state: bytes) -> bytes:
    """A party's model and update rule's state at a round's start: the statement's ``previous_result``."""
    return hashlib.sha256(_frame(b"consilium one-time model state v1", parameters, optimizer_state)).digest()


def upload_digest(chunks: Sequence[bytes]) -> bytes:
    return hashlib.sha256(_frame(_UPLOAD_LABEL, *chunks)).digest()


def check_box_keys(
    setting: RoundSetting, name: str, box_keys: Mapping[str, bytes], identities: Mapping[str, Ed25519PublicKey]
) -> dict[str, X25519PublicKey]:
    """The public box keys a RoundStart lists, once each is certified by its owner for this round and
    they are ``name``'s own and a quorum's of the run's hospitals; ``RoundRefused`` naming the server
    otherwise. A hospital checks them before it is charged for the round (review 4, finding 8)."""
    if not set(box_keys) <= set(setting.hospitals) or name not in box_keys or len(box_keys) < setting.quorum:
        raise RoundRefused(
            f"round {setting.round_number}: box keys for {sorted(box_keys)}: not ours and a quorum of the run's hospitals",
            named=["server"],
        )
    recipients = {}
    for owner in box_keys:
        try:
            recipients[owner] = verify_certified_key(
                box_keys[owner],
                signer=identities[owner],
                context=box_key_context(setting.run, owner, setting.round_number),
            )
        except SealedBoxError as error:
            raise RoundRefused(
                f"round {setting.round_number}: {owner}'s box key is not certified for this round: {error}",
                named=["server"],
            ) from None
    return recipients


def box_keys_digest(setting: RoundSetting, box_keys: Mapping[str, bytes]) -> bytes:
    """The round's certified box keys, in the run's order: what each member sealed to."""
    owners = [owner for owner in setting.hospitals if owner in box_keys]
    return hashlib.sha256(
        _frame(_BOX_KEYS_LABEL, *(part for o in owners for part in (o.encode(), box_keys[o])))
    ).digest()


def release_commitment(setting: RoundSetting, name: str, released: Release) -> bytes:
    parts = (_COMMITMENT_LABEL, setting.run.encode(), b"%d" % setting.round_number, name.encode())
    return hashlib.sha256(_frame(*parts, *_release_parts(released))).digest()


def challenge_seed(setting: RoundSetting, opened: _Opened) -> bytes:
    """``gamma``'s seed: the statement and every member's signed fields in the order of their points,
    never signature bytes or an order the relay chooses (review 2, R2). Fixed after every release was
    committed."""
    parts = [_SEED_LABEL, opened.statement]
    for name in sorted(opened.contributors, key=setting.party):
        endorsed = opened.endorsements[name]
        parts += [b"%d" % setting.party(name), _words(endorsed.hashes), endorsed.commitment]
    return hashlib.sha256(_frame(*parts)).digest()


def proofs_digest(setting: RoundSetting, opened: _Opened) -> bytes:
    """The proofs a party checks against, in the order of their dealers' points: every release names them."""
    parts = [_PROOFS_LABEL, opened.statement, opened.seed]
    for name in sorted(opened.contributors, key=setting.party):
        parts += [b"%d" % setting.party(name), *(_words(row) for row in opened.proofs[name].proof)]
    return hashlib.sha256(_frame(*parts)).digest()


def _challenges(setting: RoundSetting, seed: bytes) -> LinearHash:
    return LinearHash(seed, modulus=setting.params.ciphertext_modulus, label=b"dealing")


def _upload_hashes(setting: RoundSetting, statement: bytes) -> LinearHash:
    seed = hashlib.sha256(_frame(_HASHES_LABEL, statement)).digest()
    return LinearHash(seed, modulus=setting.params.ciphertext_modulus, label=b"upload")


def _endorsement_message(statement: bytes, hashes: Sequence[int], commitment: bytes) -> bytes:
    return _frame(_ENDORSEMENT_LABEL, statement, _words(hashes), commitment)


def _proof_message(statement: bytes, seed: bytes, proof: Sequence[Sequence[int]]) -> bytes:
    return _frame(_PROOF_LABEL, statement, seed, *(_words(row) for row in proof))


def _release_message(statement: bytes, seed: bytes, proofs: bytes, released: Release) -> bytes:
    return _frame(_RELEASE_LABEL, statement, seed, proofs, *_release_parts(released))


def _release_parts(released: Release) -> tuple[bytes, bytes]:
    return np.ascontiguousarray(released.share, dtype="<u8").tobytes(), _words(released.masks)


def _frame(*parts: bytes) -> bytes:
    """Parts, each preceded by its length: one encoding for one sequence of parts."""
    return b"".join(_WORD.pack(len(part)) + part for part in parts)


def _words(values: Sequence[int]) -> bytes:
    return b"".join(_WORD.pack(value) for value in values)


def _words_below(values, count: int, modulus: int) -> bool:
    return (
        type(values) is tuple
        and len(values) == count
        and all(type(value) is int and 0 <= value < modulus for value in values)
    )


def _is_digest(value) -> bool:
    return type(value) is bytes and len(value) == _DIGEST_BYTES


def _well_formed_proof(setting: RoundSetting, proof) -> bool:
    """``lambda`` polynomials of ``tau`` coefficients, each an integer below ``q``."""
    q = setting.params.ciphertext_modulus
    return (
        type(proof) is tuple
        and len(proof) == setting.challenges
        and all(_words_below(row, setting.threshold, q) for row in proof)
    )


def _encodable_release(setting: RoundSetting, released) -> bool:
    """``N`` uint64 values and ``lambda`` masks that fit a word: what a release's signature covers."""
    share = getattr(released, "share", None)
    return (
        isinstance(released, Release)
        and isinstance(share, np.ndarray)
        and share.dtype == np.uint64
        and share.shape == (setting.params.poly_modulus_degree,)
        and _words_below(released.masks, setting.challenges, 2**64)
    )


def _within_field(setting: RoundSetting, released: Release) -> bool:
    """Every value and mask below ``q``: a value at or above would hash as another (review 3, finding 4)."""
    q = setting.params.ciphertext_modulus
    return bool(np.all(released.share < np.uint64(q))) and all(mask < q for mask in released.masks)


def _signed(identity: Ed25519PublicKey, signature, message: bytes) -> bool:
    if type(signature) is not bytes:
        return False
    try:
        identity.verify(signature, message)
    except InvalidSignature:
        return False
    return True


def _chunks(public: PublicContext, chunks: Sequence[bytes], what: str) -> np.ndarray:
    """An upload or a sum of exactly ``C`` packed ciphertexts (review 3, finding 10)."""
    if len(chunks) != public.params.chunk_count:
        raise BfvError(f"{what} must have {public.params.chunk_count} ciphertexts, not {len(chunks)}")
    return unpack_ring(public, list(chunks), f"{what} ciphertext")


def _share_bytes(public: PublicContext, dealt: DealtShare) -> bytes:
    return pack_ring(public, dealt.share[np.newaxis])[0] + _words(dealt.masks)


def _share_from(public: PublicContext, payload: bytes) -> DealtShare:
    size, count = key_share_bytes(public.params), challenge_count(public.params.ciphertext_modulus)
    if len(payload) != size + 8 * count:
        raise BfvError(f"a key share must be {size + 8 * count} bytes")
    masks = tuple(_WORD.unpack_from(payload, size + 8 * m)[0] for m in range(count))
    if any(mask >= public.params.ciphertext_modulus for mask in masks):
        raise BfvError("a key share's mask is at or above the ciphertext modulus")
    return DealtShare(unpack_ring(public, [payload[:size]], "key share")[0], masks)
