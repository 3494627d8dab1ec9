"""One round of the secure sum with one-time keys, both sides, without the network.

The message sequence and the argument for each check are in ``docs/explanation/secure-round.md``;
this module holds what each party computes and checks at each step, so the roles only carry
messages. ``HospitalRound`` is one hospital's side of one round: upload and deal, endorse, prove its
dealing, release, open the sum. ``SumRound`` is the server's: add the uploads, then check the
endorsements, the proofs and the releases as the members do (it holds no share, so it checks no
dealing). Both open the sum with ``open_sum``, which checks every release before any is used.

A check that fails raises ``RoundRefused`` with the reason and the parties it names (``"server"``
where only the relay can have done it); a hospital's refusal of a dishonest dealer carries the
opening of that dealer's box (``crypto.sealed_box.box_key``), which anyone can check.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from crypto.bfv import BfvError, PublicContext
from crypto.bfv_parameters import BfvParameters
from crypto.endorsement import one_time_statement
from crypto.key_shares import DealtShare, Release, check_release, check_share, rebuild, release
from crypto.linear_hash import LinearHash, challenge_count
from crypto.one_time_keys import (
    OneTimeKey,
    check_zero_slots,
    decrypt_sum,
    key_share_bytes,
    pack_ring,
    public_polynomials,
    sum_uploads,
    unpack_ring,
)
from crypto.sealed_box import SealedBoxError, box_key, open_box, open_with_box_key, seal

__all__ = [
    "Endorsed",
    "Proved",
    "Released",
    "HospitalRound",
    "RoundRefused",
    "RoundSetting",
    "SumRound",
    "box_context",
    "check_opening",
    "check_threshold",
    "challenge_seed",
    "open_sum",
]

_ENDORSEMENT_LABEL = b"consilium one-time endorsement v1"
_COMMITMENT_LABEL = b"consilium one-time release commitment v1"
_PROOF_LABEL = b"consilium one-time dealing proof v1"
_RELEASE_LABEL = b"consilium one-time release v1"
_VALUE = struct.Struct("<Q")


class RoundRefused(RuntimeError):
    """A round a party refuses, and whom its checks name (``named``), with any openings as evidence."""

    def __init__(self, reason: str, *, named: Sequence[str] = (), openings: Mapping[str, bytes] | None = None) -> None:
        super().__init__(reason)
        self.named = tuple(named)
        self.openings = dict(openings or {})


def check_threshold(hospitals: int, threshold: int, quorum: int) -> None:
    """``ValueError`` unless ``tau`` and ``K_min`` give the design's guarantee (review F1): ``n >= 3``,
    ``floor(n/2) + 1 <= tau <= n`` and ``K_min >= tau + 1``, so every sum holds two honest updates."""
    if hospitals < 3:
        raise ValueError(f"one-time keys need at least 3 hospitals, not {hospitals}")
    if not hospitals // 2 + 1 <= threshold <= hospitals:
        raise ValueError(f"the threshold must be between {hospitals // 2 + 1} and {hospitals}, not {threshold}")
    if quorum < threshold + 1:
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

    def party(self, name: str) -> int:
        return self.hospitals.index(name) + 1

    @functools.cached_property
    def public_polynomials(self) -> np.ndarray:
        """``a_c`` of this round (``crypto.one_time_keys.public_polynomials``), derived once."""
        return public_polynomials(self.params, run=self.run, round_number=self.round_number)


def box_context(setting: RoundSetting, dealer: str, recipient: str, upload_digest: bytes) -> bytes:
    """What a sealed key share is bound to: run, round, dealer, recipient and the dealer's upload."""
    return b"consilium/one-time-key-share/v1|%s|%d|%s|%s|%s" % (
        setting.run.encode(),
        setting.round_number,
        dealer.encode(),
        recipient.encode(),
        upload_digest.hex().encode(),
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
    """A member's signed release."""

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
        self._key: OneTimeKey | None = None
        self._upload: np.ndarray | None = None
        self._digest = b""
        self._shares: dict[str, DealtShare] = {}
        self._boxes: dict[str, bytes] = {}
        self._release: Release | None = None
        self._opened = _Opened()

    def upload(
        self, slots: np.ndarray, box_keys: Mapping[str, X25519PublicKey]
    ) -> tuple[list[bytes], dict[str, bytes]]:
        """The upload (``c0`` of each ciphertext) and a sealed share for every hospital of the run."""
        setting = self._setting
        if self._key is not None:
            raise RoundRefused(f"round {setting.round_number}: a hospital uploads once a round")
        if set(box_keys) != set(setting.hospitals):
            raise RoundRefused(
                f"round {setting.round_number}: box keys for {sorted(box_keys)}, not for the run's hospitals"
            )
        self._key = OneTimeKey(self._public, threshold=setting.threshold, parties=len(setting.hospitals))
        chunks = self._key.encrypt(slots, setting.public_polynomials)
        self._upload = unpack_ring(self._public, chunks, "our upload")
        self._digest = upload_digest(chunks)
        boxes = {
            recipient: seal(
                _share_bytes(self._public, self._key.dealing.shares[setting.party(recipient) - 1]),
                recipient=box_keys[recipient],
                sender=self._signing,
                context=box_context(setting, self._name, recipient, self._digest),
            )
            for recipient in setting.hospitals
        }
        return chunks, boxes

    def endorse(
        self,
        contributors: Sequence[str],
        digests: Mapping[str, bytes],
        total: Sequence[bytes],
        boxes: Mapping[str, bytes],
        senders: Mapping[str, Ed25519PublicKey],
        *,
        round_state: Mapping[str, float],
        box_keys_digest: bytes,
        previous_result: bytes,
    ) -> Endorsed:
        """Check the server's set and sum, open this hospital's shares from each member, and sign the
        round's one statement with the upload's hashes and a commitment to the release."""
        setting, number = self._setting, self._setting.round_number
        if self._upload is None or self._opened.statement:
            raise RoundRefused(f"round {number}: a hospital endorses once a round, after its upload")
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
        if set(digests) != set(members) or set(boxes) != set(members) or digests[self._name] != self._digest:
            raise RoundRefused(
                f"round {number}: the uploads listed are not the members' (ours included)", named=["server"]
            )
        for dealer in members:
            context = box_context(setting, dealer, self._name, digests[dealer])
            try:
                payload = open_box(boxes[dealer], recipient=self._box, sender=senders[dealer], context=context)
                self._shares[dealer] = _share_from(self._public, payload)
            except (SealedBoxError, BfvError) as error:
                # The dealer signed the box: only its relay can make it fail to open (review F3).
                raise RoundRefused(
                    f"round {number}: the share from {dealer} does not open: {error}", named=["server"]
                ) from None
        self._boxes = dict(boxes)
        try:
            summed = unpack_ring(self._public, total, "the sum")
        except BfvError as error:
            raise RoundRefused(f"round {number}: {error}", named=["server"]) from None
        statement = one_time_statement(
            run=setting.run,
            round_number=number,
            contributors=members,
            upload_digests=[digests[name] for name in members],
            sum_digest=upload_digest(total),
            round_state=round_state,
            box_keys_digest=box_keys_digest,
            previous_result=previous_result,
        )
        self._release = release([self._shares[dealer] for dealer in members], setting.params.ciphertext_modulus)
        hashes = tuple(_upload_hashes(setting, statement).products(self._upload))
        commitment = release_commitment(setting, self._name, self._release)
        self._opened = _Opened(statement, members, summed)
        return Endorsed(hashes, commitment, self._signing.sign(_endorsement_message(statement, hashes, commitment)))

    def prove(self, endorsements: Mapping[str, Endorsed], signers: Mapping[str, Ed25519PublicKey]) -> Proved:
        """The signed proof of this hospital's dealing, once every member endorsed the statement it
        signed and their hashes add up to the sum's. Computed once: a second proof under other
        challenges would unmask linear forms of the key (review R6)."""
        opened, number = self._opened, self._setting.round_number
        if not opened.statement or opened.endorsements:
            raise RoundRefused(f"round {number}: a hospital proves its dealing once a round, after endorsing")
        check_endorsements(self._setting, opened, endorsements, signers)
        opened.endorsements = dict(endorsements)
        opened.seed = challenge_seed(self._setting, opened)
        proof = self._key.dealing.proof(_challenges(self._setting, opened.seed))
        self._key = None  # the key and its dealing are not needed after the proof
        message = _proof_message(opened.statement, opened.seed, proof)
        return Proved(opened.seed, proof, self._signing.sign(message))

    def release(self, proofs: Mapping[str, Proved], signers: Mapping[str, Ed25519PublicKey]) -> Released:
        """This hospital's signed release, once every member's signed proof, under the same challenges,
        matches the share it dealt this hospital. A dealer whose proof does not is named, with the
        opening of its box as evidence (only a dishonest dealer's share is ever opened). The caller
        records the release durably before sending it."""
        setting, opened = self._setting, self._opened
        if not opened.seed or opened.proofs:
            raise RoundRefused(f"round {setting.round_number}: a hospital releases once a round, after its proof")
        check_proofs(setting, opened, proofs, signers)
        opened.proofs = dict(proofs)
        challenges, me = _challenges(setting, opened.seed), setting.party(self._name)
        dishonest = [
            dealer
            for dealer in opened.contributors
            if not check_share(self._shares[dealer], me, proofs[dealer].proof, challenges, threshold=setting.threshold)
        ]
        if dishonest:
            openings = {dealer: box_key(self._boxes[dealer], recipient=self._box) for dealer in dishonest}
            raise RoundRefused(
                f"round {setting.round_number}: the shares {', '.join(dishonest)} dealt us are not on the "
                "polynomials they proved",
                named=dishonest,
                openings=openings,
            )
        message = _release_message(opened.statement, opened.seed, self._release)
        return Released(self._release, self._signing.sign(message))

    def open(self, releases: Mapping[str, Released], signers: Mapping[str, Ed25519PublicKey]) -> np.ndarray:
        """The sum's slots, from every member's release (``open_sum``)."""
        if not self._opened.proofs:
            raise RoundRefused(f"round {self._setting.round_number}: releases before this hospital released")
        return open_sum(self._setting, self._public, self._opened, releases, signers)


class SumRound:
    """The server's side of one round: it adds uploads and opens the sum once the members released."""

    def __init__(self, setting: RoundSetting, public: PublicContext) -> None:
        self._setting, self._public = setting, public
        self._uploads: dict[str, np.ndarray] = {}
        self.digests: dict[str, bytes] = {}
        self._opened = _Opened()

    def add(self, name: str, chunks: Sequence[bytes]) -> None:
        """Take ``name``'s upload (``BfvError`` if it is not one, and nothing changes)."""
        if name in self._uploads:
            raise BfvError(f"a second upload from {name}")
        self._uploads[name] = unpack_ring(self._public, chunks, "upload ciphertext")
        self.digests[name] = upload_digest(list(chunks))

    def total(self, contributors: Sequence[str]) -> list[bytes]:
        """The sum of the contributors' uploads, packed as an upload."""
        total = sum_uploads(self._public, [self._uploads[name] for name in contributors])
        self._opened = _Opened(contributors=tuple(contributors), total=total)
        return pack_ring(self._public, total)

    def statement(self, **parts) -> bytes:
        """The statement every member must have signed (``crypto.endorsement.one_time_statement``)."""
        members = self._opened.contributors
        self._opened.statement = one_time_statement(
            run=self._setting.run,
            round_number=self._setting.round_number,
            contributors=members,
            upload_digests=[self.digests[name] for name in members],
            sum_digest=upload_digest(pack_ring(self._public, self._opened.total)),
            **parts,
        )
        return self._opened.statement

    def endorsed(self, endorsements: Mapping[str, Endorsed], signers: Mapping[str, Ed25519PublicKey]) -> None:
        check_endorsements(self._setting, self._opened, endorsements, signers)
        self._opened.endorsements = dict(endorsements)
        self._opened.seed = challenge_seed(self._setting, self._opened)

    def proved(self, proofs: Mapping[str, Proved], signers: Mapping[str, Ed25519PublicKey]) -> None:
        check_proofs(self._setting, self._opened, proofs, signers)
        self._opened.proofs = dict(proofs)

    def open(self, releases: Mapping[str, Released], signers: Mapping[str, Ed25519PublicKey]) -> np.ndarray:
        return open_sum(self._setting, self._public, self._opened, releases, signers)


def open_sum(
    setting: RoundSetting,
    public: PublicContext,
    opened: _Opened,
    releases: Mapping[str, Released],
    signers: Mapping[str, Ed25519PublicKey],
) -> np.ndarray:
    """The sum's slots from every member's release. Each must carry its member's signature (else the
    relay is named), match the commitment in its endorsement and pass the check against the signed
    proofs (else its member is named: it released only after every dealing to it checked). Every
    member's release is needed, so no party chooses, after seeing the honest ones, which are used
    (review R3); all must lie on one polynomial of degree ``tau - 1``, and the key is rebuilt from
    the ``tau`` with the smallest points. The zero slots then catch an upload made under another key
    than its dealer shared; a dishonest member that fits that key is changing its own input."""
    number, members = setting.round_number, opened.contributors
    if set(releases) != set(members):
        raise RoundRefused(f"round {number}: releases from {sorted(releases)}, not from every member", named=["server"])
    challenges = _challenges(setting, opened.seed)
    proofs = [opened.proofs[name].proof for name in members]
    named = []
    for name in members:
        released = releases[name]
        try:
            signers[name].verify(released.signature, _release_message(opened.statement, opened.seed, released.release))
        except InvalidSignature:
            raise RoundRefused(f"round {number}: {name}'s release is not signed by {name}", named=["server"]) from None
        if release_commitment(setting, name, released.release) != opened.endorsements[name].commitment or not (
            check_release(released.release, setting.party(name), proofs, challenges, threshold=setting.threshold)
        ):
            named.append(name)
    if named:
        raise RoundRefused(f"round {number}: {', '.join(named)} released wrong values", named=named)
    points = {setting.party(name): releases[name].release.share for name in members}
    q = setting.params.ciphertext_modulus
    chosen = dict(sorted(points.items())[: setting.threshold])
    key = rebuild(chosen, setting.threshold, q)
    for x, share in points.items():
        if x not in chosen and not np.array_equal(_evaluate_at(chosen, x, q), share):
            raise RoundRefused(f"round {number}: the releases do not lie on one polynomial")
    slots = decrypt_sum(public, opened.total, key, setting.public_polynomials)
    try:
        check_zero_slots(public, slots, setting.params.digits.slots_for(setting.params.vector_length))
    except BfvError:
        raise RoundRefused(
            f"round {number}: the sum does not decrypt under the keys its members dealt: an upload was made "
            "under another key"
        ) from None
    return slots


def check_proofs(
    setting: RoundSetting, opened: _Opened, proofs: Mapping[str, Proved], signers: Mapping[str, Ed25519PublicKey]
) -> None:
    """Every member signed one proof under this party's challenges' seed. A proof under another seed
    means members were shown different endorsements (the relay, or a member that endorsed twice):
    the round ends naming the relay, and no share is opened (review R2)."""
    number = setting.round_number
    if set(proofs) != set(opened.contributors):
        raise RoundRefused(f"round {number}: proofs from {sorted(proofs)}, not from every member", named=["server"])
    for name, proved in proofs.items():
        if proved.seed != opened.seed:
            raise RoundRefused(
                f"round {number}: {name} proved under other challenges: endorsements were split", named=["server"]
            )
        try:
            signers[name].verify(proved.signature, _proof_message(opened.statement, opened.seed, proved.proof))
        except (InvalidSignature, TypeError, struct.error):
            raise RoundRefused(f"round {number}: {name}'s proof is not signed by {name}", named=["server"]) from None


def check_endorsements(
    setting: RoundSetting,
    opened: _Opened,
    endorsements: Mapping[str, Endorsed],
    signers: Mapping[str, Ed25519PublicKey],
) -> None:
    """Every member signed this statement, and the hashes they signed add up to the sum's."""
    number = setting.round_number
    if set(endorsements) != set(opened.contributors):
        raise RoundRefused(
            f"round {number}: endorsements from {sorted(endorsements)}, not from every member", named=["server"]
        )
    hashes = _upload_hashes(setting, opened.statement)
    for name, endorsed in endorsements.items():
        try:
            if len(endorsed.hashes) != hashes.count:
                raise InvalidSignature
            signers[name].verify(
                endorsed.signature, _endorsement_message(opened.statement, endorsed.hashes, endorsed.commitment)
            )
        except InvalidSignature:
            raise RoundRefused(
                f"round {number}: {name}'s endorsement is not its signature on this round", named=["server"]
            ) from None
    q = setting.params.ciphertext_modulus
    signed = [sum(column) % q for column in zip(*(endorsed.hashes for endorsed in endorsements.values()))]
    if signed != hashes.products(opened.total):
        raise RoundRefused(f"round {number}: the sum is not the members' uploads", named=["server"])


def upload_digest(chunks: Sequence[bytes]) -> bytes:
    digest = hashlib.sha256(b"consilium one-time upload v1")
    for chunk in chunks:
        digest.update(_VALUE.pack(len(chunk)) + chunk)
    return digest.digest()


def release_commitment(setting: RoundSetting, name: str, released: Release) -> bytes:
    digest = hashlib.sha256(
        _COMMITMENT_LABEL + b"|%s|%d|%s|" % (setting.run.encode(), setting.round_number, name.encode())
    )
    digest.update(_release_bytes(released))
    return digest.digest()


def challenge_seed(setting: RoundSetting, opened: _Opened) -> bytes:
    """``gamma``'s seed: the statement and every member's signed fields in the order of their points,
    never signature bytes or an order the relay chooses (review R2). Fixed after every release was
    committed."""
    digest = hashlib.sha256(b"consilium one-time dealing challenges v1" + opened.statement)
    for name in sorted(opened.contributors, key=setting.party):
        endorsed = opened.endorsements[name]
        digest.update(
            b"%d|" % setting.party(name) + b"".join(_VALUE.pack(h) for h in endorsed.hashes) + endorsed.commitment
        )
    return digest.digest()


def _challenges(setting: RoundSetting, seed: bytes) -> LinearHash:
    return LinearHash(seed, modulus=setting.params.ciphertext_modulus, label=b"dealing")


def _upload_hashes(setting: RoundSetting, statement: bytes) -> LinearHash:
    seed = hashlib.sha256(b"consilium one-time upload hashes v1" + statement).digest()
    return LinearHash(seed, modulus=setting.params.ciphertext_modulus, label=b"upload")


def _endorsement_message(statement: bytes, hashes: Sequence[int], commitment: bytes) -> bytes:
    return _ENDORSEMENT_LABEL + statement + b"".join(_VALUE.pack(value) for value in hashes) + commitment


def _proof_message(statement: bytes, seed: bytes, proof: Sequence[Sequence[int]]) -> bytes:
    values = b"".join(_VALUE.pack(c) for polynomial in proof for c in polynomial)
    return _PROOF_LABEL + statement + seed + b"%d|%d|" % (len(proof), len(proof[0]) if proof else 0) + values


def _release_message(statement: bytes, seed: bytes, released: Release) -> bytes:
    return _RELEASE_LABEL + statement + seed + _release_bytes(released)


def _release_bytes(released: Release) -> bytes:
    return np.ascontiguousarray(released.share, dtype="<u8").tobytes() + b"".join(
        _VALUE.pack(m) for m in released.masks
    )


def _evaluate_at(points: Mapping[int, np.ndarray], x: int, modulus: int) -> np.ndarray:
    """The polynomial through ``points`` (degree ``len(points) - 1``) at ``x``, by Lagrange."""
    total = np.zeros(next(iter(points.values())).size, dtype=object)
    for xi, values in points.items():
        numerator, denominator = 1, 1
        for other in points:
            if other != xi:
                numerator, denominator = numerator * (x - other) % modulus, denominator * (xi - other) % modulus
        total += values.astype(object) * (numerator * pow(denominator, -1, modulus) % modulus)
    return (total % modulus).astype(np.uint64)


def _share_bytes(public: PublicContext, dealt: DealtShare) -> bytes:
    return pack_ring(public, dealt.share[np.newaxis])[0] + b"".join(_VALUE.pack(mask) for mask in dealt.masks)


def _share_from(public: PublicContext, payload: bytes) -> DealtShare:
    size, count = key_share_bytes(public.params), challenge_count(public.params.ciphertext_modulus)
    if len(payload) != size + 8 * count:
        raise BfvError(f"a key share must be {size + 8 * count} bytes")
    masks = tuple(_VALUE.unpack_from(payload, size + 8 * m)[0] for m in range(count))
    if any(mask >= public.params.ciphertext_modulus for mask in masks):
        raise BfvError("a key share's mask is at or above the ciphertext modulus")
    return DealtShare(unpack_ring(public, [payload[:size]], "key share")[0], masks)


def check_opening(
    setting: RoundSetting,
    public: PublicContext,
    *,
    dealer: str,
    recipient: str,
    box: bytes,
    key: bytes,
    dealer_upload: bytes,
    recipient_box: X25519PublicKey,
    dealer_signing: Ed25519PublicKey,
    proof: Sequence,
    challenges: LinearHash,
) -> bool:
    """Whether a recipient's opening of ``dealer``'s box shows a share off the dealer's proof: the
    evidence that names a dishonest dealer alone (``True``), or shows the complaint false."""
    try:
        payload = open_with_box_key(
            box,
            key=key,
            recipient=recipient_box,
            sender=dealer_signing,
            context=box_context(setting, dealer, recipient, dealer_upload),
        )
        dealt = _share_from(public, payload)
    except (SealedBoxError, BfvError):
        return False
    return not check_share(dealt, setting.party(recipient), proof, challenges, threshold=setting.threshold)
