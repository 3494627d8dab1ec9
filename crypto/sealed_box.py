"""Signed sealed boxes: a message only one recipient can open, that provably comes from one sender.

Used to relay secrets (the BFV secret context) through a party that must not read them. The sender
makes an ephemeral X25519 key ``e``, derives ``k = HKDF-SHA256(X25519(e, R), info = label | E | R)``
for the recipient's box key ``R`` (``E`` the ephemeral public key), encrypts with
ChaCha20-Poly1305 under ``k`` with the caller's ``context`` as associated data, and signs the whole
box, context and recipient included, with its Ed25519 identity key.

Layout: ``version (4) | E (32) | nonce (12) | ciphertext + tag | signature (64)``.

The signature is checked before anything is decrypted; a box that was altered, sealed to someone
else, signed by someone else, or presented under another context is refused with
``SealedBoxError``.

For forward secrecy a recipient seals to a short-lived key instead of its long-term one: it makes a
fresh X25519 key, ``certify_key`` signs it with the recipient's Ed25519 identity for one context
(e.g. one run), the sender checks it with ``verify_certified_key`` and seals to it, and the
recipient forgets the private half once the box is open. A later leak of every long-term key then
opens no stored box.

A sender that must be able to show, later, what one box holds keeps its ephemeral secret
(``seal_revealable``). Revealed, ``e`` opens that box and no other (``open_with_ephemeral``): ``E`` and
``R`` are in the key derivation, and anyone checks ``public(e) = E`` and derives ``k`` exactly as the
recipient does, so a sender that encrypted under a key of its own making cannot pass the box off as
one the recipient should have opened.
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from consilium.errors import ConsiliumError

__all__ = [
    "OVERHEAD_BYTES",
    "SealedBoxError",
    "box_key",
    "certify_key",
    "open_box",
    "open_with_box_key",
    "open_with_ephemeral",
    "seal",
    "seal_revealable",
    "verify_box",
    "verify_certified_key",
]

_VERSION = b"CSB1"
_LABEL = b"consilium sealed box v1"
_CERTIFICATE_LABEL = b"consilium certified box key v1"
_KEY_BYTES = 32
_NONCE_BYTES = 12
_TAG_BYTES = 16
_SIGNATURE_BYTES = 64
_HEADER_BYTES = len(_VERSION) + _KEY_BYTES + _NONCE_BYTES
OVERHEAD_BYTES = _HEADER_BYTES + _TAG_BYTES + _SIGNATURE_BYTES  # a box is exactly this much longer than its plaintext


class SealedBoxError(ConsiliumError, ValueError):
    """A sealed box that cannot be opened as asked."""


def seal(plaintext: bytes, *, recipient: X25519PublicKey, sender: Ed25519PrivateKey, context: bytes) -> bytes:
    return seal_revealable(plaintext, recipient=recipient, sender=sender, context=context)[0]


def seal_revealable(
    plaintext: bytes, *, recipient: X25519PublicKey, sender: Ed25519PrivateKey, context: bytes
) -> tuple[bytes, bytes]:
    """The box ``seal`` makes, and its ephemeral secret ``e`` (32 bytes), which opens it and no other box
    (``open_with_ephemeral``): keep it secret, and reveal it only to show what this one box holds."""
    ephemeral = X25519PrivateKey.generate()
    ephemeral_public = _raw(ephemeral.public_key())
    recipient_public = _raw(recipient)
    key = _derive_key(_exchange(ephemeral, recipient), ephemeral_public, recipient_public)
    nonce = os.urandom(_NONCE_BYTES)
    body = _VERSION + ephemeral_public + nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, context)
    secret = ephemeral.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return body + sender.sign(_signed_message(body, context, recipient_public)), secret


def open_with_ephemeral(
    box: bytes, *, ephemeral: bytes, recipient: X25519PublicKey, sender: Ed25519PublicKey, context: bytes
) -> bytes:
    """The contents of a box ``sender`` sealed to ``recipient`` for ``context``, opened with the ephemeral secret
    its sender revealed: ``SealedBoxError`` unless ``ephemeral``'s public half is the box's ``E`` and the box opens
    under the key the recipient derives from it."""
    verify_box(box, recipient=recipient, sender=sender, context=context)
    if len(ephemeral) != _KEY_BYTES:
        raise SealedBoxError(f"an ephemeral secret has {_KEY_BYTES} bytes, not {len(ephemeral)}")
    secret = X25519PrivateKey.from_private_bytes(ephemeral)
    ephemeral_public = box[len(_VERSION) : len(_VERSION) + _KEY_BYTES]
    if _raw(secret.public_key()) != ephemeral_public:
        raise SealedBoxError("the revealed ephemeral secret is not the box's: its public half differs")
    key = _derive_key(_exchange(secret, recipient), ephemeral_public, _raw(recipient))
    return open_with_box_key(box, key=key, recipient=recipient, sender=sender, context=context)


def _exchange(private: X25519PrivateKey, public: X25519PublicKey) -> bytes:
    try:
        return private.exchange(public)
    except ValueError:  # a low-order point: every shared secret would be zero
        raise SealedBoxError("the recipient's key is a low-order point, not a usable X25519 key") from None


def open_box(box: bytes, *, recipient: X25519PrivateKey, sender: Ed25519PublicKey, context: bytes) -> bytes:
    return open_with_box_key(
        box,
        key=box_key(box, recipient=recipient),
        recipient=recipient.public_key(),
        sender=sender,
        context=context,
    )


def box_key(box: bytes, *, recipient: X25519PrivateKey) -> bytes:
    """The key of this one box. Revealed, it opens this box and no other: a recipient shows what a sender
    sealed to it (``open_with_box_key``) without giving up its own key. A recipient cannot reveal a
    false key to pin other contents on an honest sender: that key would have to pass the Poly1305 tag
    of a box it did not make."""
    _parts(box)
    ephemeral_public = box[len(_VERSION) : len(_VERSION) + _KEY_BYTES]
    try:
        shared = recipient.exchange(X25519PublicKey.from_public_bytes(ephemeral_public))
    except ValueError:
        raise SealedBoxError("sealed box does not decrypt with this recipient's key") from None
    return _derive_key(shared, ephemeral_public, _raw(recipient.public_key()))


def verify_box(box: bytes, *, recipient: X25519PublicKey, sender: Ed25519PublicKey, context: bytes) -> None:
    """``SealedBoxError`` unless ``sender`` signed this box for ``recipient`` and ``context``: what a relay
    can check without opening it (whatever fails after this is the sender's own doing)."""
    body, signature = _parts(box)
    try:
        sender.verify(signature, _signed_message(body, context, _raw(recipient)))
    except InvalidSignature:
        raise SealedBoxError(
            "sealed box signature does not verify: altered, from another sender, "
            "for another recipient or for another purpose"
        ) from None
    _usable_key(body[len(_VERSION) : len(_VERSION) + _KEY_BYTES], "the box's ephemeral key")


def open_with_box_key(
    box: bytes, *, key: bytes, recipient: X25519PublicKey, sender: Ed25519PublicKey, context: bytes
) -> bytes:
    """The contents of a box sealed to ``recipient`` by ``sender`` for ``context``, opened with its own key."""
    verify_box(box, recipient=recipient, sender=sender, context=context)
    body = box[:-_SIGNATURE_BYTES]
    nonce = body[len(_VERSION) + _KEY_BYTES : _HEADER_BYTES]
    try:
        return ChaCha20Poly1305(key).decrypt(nonce, body[_HEADER_BYTES:], context)
    except (InvalidTag, ValueError):
        raise SealedBoxError("sealed box does not decrypt with this recipient's key") from None


def _parts(box: bytes) -> tuple[bytes, bytes]:
    """A box's signed body and its signature, once its length and version are right."""
    if len(box) < _HEADER_BYTES + _TAG_BYTES + _SIGNATURE_BYTES:
        raise SealedBoxError(f"sealed box too short ({len(box)} bytes)")
    if not box.startswith(_VERSION):
        raise SealedBoxError("not a sealed box of a known version")
    return box[:-_SIGNATURE_BYTES], box[-_SIGNATURE_BYTES:]


def certify_key(public_key: X25519PublicKey, *, signer: Ed25519PrivateKey, context: bytes) -> bytes:
    """``public_key`` and a signature binding it to ``context``: ``key (32) | signature (64)``."""
    raw = _raw(public_key)
    return raw + signer.sign(_certified_message(raw, context))


def verify_certified_key(certified: bytes, *, signer: Ed25519PublicKey, context: bytes) -> X25519PublicKey:
    """The key ``certify_key`` certified for ``context`` by ``signer``; ``SealedBoxError`` otherwise."""
    if len(certified) != _KEY_BYTES + _SIGNATURE_BYTES:
        raise SealedBoxError(f"a certified key has {_KEY_BYTES + _SIGNATURE_BYTES} bytes, not {len(certified)}")
    raw, signature = certified[:_KEY_BYTES], certified[_KEY_BYTES:]
    try:
        signer.verify(signature, _certified_message(raw, context))
    except InvalidSignature:
        raise SealedBoxError(
            "the key's certificate does not verify: from another party or for another purpose"
        ) from None
    return _usable_key(raw, "the certified key")


def _usable_key(raw: bytes, what: str) -> X25519PublicKey:
    """``raw`` as an X25519 key, unless it is a low-order point: an exchange with one yields the
    all-zero secret, which ``cryptography`` refuses, so a signed low-order key would make every
    exchange with it fail after every check had passed (review 5, finding 1)."""
    key = X25519PublicKey.from_public_bytes(raw)
    try:
        X25519PrivateKey.generate().exchange(key)
    except ValueError:
        raise SealedBoxError(f"{what} is a low-order point, not a usable X25519 key") from None
    return key


def _certified_message(raw_key: bytes, context: bytes) -> bytes:
    return _CERTIFICATE_LABEL + struct.pack(">I", len(context)) + context + raw_key


def _derive_key(shared: bytes, ephemeral_public: bytes, recipient_public: bytes) -> bytes:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_LABEL + ephemeral_public + recipient_public)
    return hkdf.derive(shared)


def _signed_message(body: bytes, context: bytes, recipient_public: bytes) -> bytes:
    return _LABEL + struct.pack(">I", len(context)) + context + recipient_public + body


def _raw(public_key: X25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
