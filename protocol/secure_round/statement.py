"""What every party of a one-time-key round agrees on, signs and hashes.

The round's setting (``RoundSetting``), the steps' signed values (``Endorsed``, ``Proved``,
``Released``), and their canonical encodings: every signed or hashed value is a length-prefixed
encoding (``frame``), so that no value has two encodings a signature would cover alike (review 3,
findings 1, 5, 11, 12). Everything a peer sends is checked for its shape, type and range here
before anything else. A check that fails raises ``RoundRefused`` with the reason and whom it names
(``"server"`` where the relay alone can have done it).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.bfv_parameters import BfvParameters
from consilium.crypto.key_shares import DealtShare, Release
from consilium.crypto.linear_hash import LinearHash, challenge_count
from consilium.crypto.one_time_keys import key_share_bytes, pack_ring, public_polynomials, unpack_ring
from consilium.crypto.sealed_box import SealedBoxError, verify_certified_key


__all__ = [
    "Steps",
    "Endorsed",
    "Opened",
    "Proved",
    "Released",
    "RoundRefused",
    "RoundSetting",
    "box_context",
    "box_key_context",
    "box_keys_digest",
    "challenge_seed",
    "check_box_keys",
    "check_threshold",
    "dealing_challenges",
    "encodable_release",
    "endorsement_message",
    "is_digest",
    "proof_message",
    "proofs_digest",
    "read_chunks",
    "release_commitment",
    "release_message",
    "released_from",
    "share_bytes",
    "share_from",
    "signature_holds",
    "state_digest",
    "upload_digest",
    "upload_hashes",
    "well_formed_proof",
    "within_field",
    "words_below",
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
DIGEST_BYTES = 32


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


def box_context(setting: RoundSetting, dealer: str, recipient: str, upload_digest: bytes) -> bytes:
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
class Opened:
    """What opening the sum needs, gathered as the round goes."""

    statement: bytes = b""
    contributors: tuple[str, ...] = ()
    total: np.ndarray | None = None
    endorsements: dict[str, Endorsed] = field(default_factory=dict)
    seed: bytes = b""
    proofs: dict[str, Proved] = field(default_factory=dict)
    proofs_digest: bytes = b""


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


def challenge_seed(setting: RoundSetting, opened: Opened) -> bytes:
    """``gamma``'s seed: the statement and every member's signed fields in the order of their points,
    never signature bytes or an order the relay chooses (review 2, R2). Fixed after every release was
    committed."""
    parts = [_SEED_LABEL, opened.statement]
    for name in sorted(opened.contributors, key=setting.party):
        endorsed = opened.endorsements[name]
        parts += [b"%d" % setting.party(name), _words(endorsed.hashes), endorsed.commitment]
    return hashlib.sha256(_frame(*parts)).digest()


def proofs_digest(setting: RoundSetting, opened: Opened) -> bytes:
    """The proofs a party checks against, in the order of their dealers' points: every release names them."""
    parts = [_PROOFS_LABEL, opened.statement, opened.seed]
    for name in sorted(opened.contributors, key=setting.party):
        parts += [b"%d" % setting.party(name), *(_words(row) for row in opened.proofs[name].proof)]
    return hashlib.sha256(_frame(*parts)).digest()


def dealing_challenges(setting: RoundSetting, seed: bytes) -> LinearHash:
    return LinearHash(seed, modulus=setting.params.ciphertext_modulus, label=b"dealing")


def upload_hashes(setting: RoundSetting, statement: bytes) -> LinearHash:
    seed = hashlib.sha256(_frame(_HASHES_LABEL, statement)).digest()
    return LinearHash(seed, modulus=setting.params.ciphertext_modulus, label=b"upload")


def endorsement_message(statement: bytes, hashes: Sequence[int], commitment: bytes) -> bytes:
    return _frame(_ENDORSEMENT_LABEL, statement, _words(hashes), commitment)


def proof_message(statement: bytes, seed: bytes, proof: Sequence[Sequence[int]]) -> bytes:
    return _frame(_PROOF_LABEL, statement, seed, *(_words(row) for row in proof))


def release_message(statement: bytes, seed: bytes, proofs: bytes, released: Release) -> bytes:
    return _frame(_RELEASE_LABEL, statement, seed, proofs, *_release_parts(released))


def _release_parts(released: Release) -> tuple[bytes, bytes]:
    return np.ascontiguousarray(released.share, dtype="<u8").tobytes(), _words(released.masks)


def _frame(*parts: bytes) -> bytes:
    """Parts, each preceded by its length: one encoding for one sequence of parts."""
    return b"".join(_WORD.pack(len(part)) + part for part in parts)


def _words(values: Sequence[int]) -> bytes:
    return b"".join(_WORD.pack(value) for value in values)


def words_below(values, count: int, modulus: int) -> bool:
    return (
        type(values) is tuple
        and len(values) == count
        and all(type(value) is int and 0 <= value < modulus for value in values)
    )


def is_digest(value) -> bool:
    return type(value) is bytes and len(value) == DIGEST_BYTES


def well_formed_proof(setting: RoundSetting, proof) -> bool:
    """``lambda`` polynomials of ``tau`` coefficients, each an integer below ``q``."""
    q = setting.params.ciphertext_modulus
    return (
        type(proof) is tuple
        and len(proof) == setting.challenges
        and all(words_below(row, setting.threshold, q) for row in proof)
    )


def encodable_release(setting: RoundSetting, released) -> bool:
    """``N`` uint64 values and ``lambda`` masks that fit a word: what a release's signature covers."""
    share = getattr(released, "share", None)
    return (
        isinstance(released, Release)
        and isinstance(share, np.ndarray)
        and share.dtype == np.uint64
        and share.shape == (setting.params.poly_modulus_degree,)
        and words_below(released.masks, setting.challenges, 2**64)
    )


def within_field(setting: RoundSetting, released: Release) -> bool:
    """Every value and mask below ``q``: a value at or above would hash as another (review 3, finding 4)."""
    q = setting.params.ciphertext_modulus
    return bool(np.all(released.share < np.uint64(q))) and all(mask < q for mask in released.masks)


def signature_holds(identity: Ed25519PublicKey, signature, message: bytes) -> bool:
    if type(signature) is not bytes:
        return False
    try:
        identity.verify(signature, message)
    except InvalidSignature:
        return False
    return True


def read_chunks(public: PublicContext, chunks: Sequence[bytes], what: str) -> np.ndarray:
    """An upload or a sum of exactly ``C`` packed ciphertexts (review 3, finding 10)."""
    if len(chunks) != public.params.chunk_count:
        raise BfvError(f"{what} must have {public.params.chunk_count} ciphertexts, not {len(chunks)}")
    return unpack_ring(public, list(chunks), f"{what} ciphertext")


def share_bytes(public: PublicContext, dealt: DealtShare) -> bytes:
    return pack_ring(public, dealt.share[np.newaxis])[0] + _words(dealt.masks)


def share_from(public: PublicContext, payload: bytes) -> DealtShare:
    size, count = key_share_bytes(public.params), challenge_count(public.params.ciphertext_modulus)
    if len(payload) != size + 8 * count:
        raise BfvError(f"a key share must be {size + 8 * count} bytes")
    masks = tuple(_WORD.unpack_from(payload, size + 8 * m)[0] for m in range(count))
    if any(mask >= public.params.ciphertext_modulus for mask in masks):
        raise BfvError("a key share's mask is at or above the ciphertext modulus")
    return DealtShare(unpack_ring(public, [payload[:size]], "key share")[0], masks)


class Steps:
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
