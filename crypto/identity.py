"""A party's long-term keys for end-to-end messages relayed by others.

Each party has an Ed25519 key to sign and an X25519 key to receive sealed boxes
(see ``crypto.sealed_box``). Keys are written as base64 of their raw 32 bytes; the private half
belongs in a file only its owner can read.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

__all__ = ["IdentityKeyError", "PrivateIdentity", "PublicIdentity"]


class IdentityKeyError(ValueError):
    """A key that does not decode."""


@dataclass(frozen=True)
class PublicIdentity:
    signing: Ed25519PublicKey
    box: X25519PublicKey

    def to_text(self) -> dict[str, str]:
        return {"sign_public": _encode(_raw_public(self.signing)), "box_public": _encode(_raw_public(self.box))}

    @classmethod
    def from_text(cls, fields: dict[str, str]) -> "PublicIdentity":
        return cls(
            signing=Ed25519PublicKey.from_public_bytes(_decode(fields, "sign_public")),
            box=X25519PublicKey.from_public_bytes(_decode(fields, "box_public")),
        )


@dataclass(frozen=True)
class PrivateIdentity:
    signing: Ed25519PrivateKey
    box: X25519PrivateKey

    @classmethod
    def generate(cls) -> "PrivateIdentity":
        return cls(signing=Ed25519PrivateKey.generate(), box=X25519PrivateKey.generate())

    @property
    def public(self) -> PublicIdentity:
        return PublicIdentity(signing=self.signing.public_key(), box=self.box.public_key())

    def to_text(self) -> dict[str, str]:
        return {"sign_secret": _encode(_raw_private(self.signing)), "box_secret": _encode(_raw_private(self.box))}

    @classmethod
    def from_text(cls, fields: dict[str, str]) -> "PrivateIdentity":
        return cls(
            signing=Ed25519PrivateKey.from_private_bytes(_decode(fields, "sign_secret")),
            box=X25519PrivateKey.from_private_bytes(_decode(fields, "box_secret")),
        )


def _encode(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _decode(fields: dict[str, str], name: str) -> bytes:
    try:
        raw = base64.b64decode(fields[name], validate=True)
    except KeyError:
        raise IdentityKeyError(f"missing key {name!r}") from None
    except (binascii.Error, TypeError):
        raise IdentityKeyError(f"key {name!r} is not base64") from None
    if len(raw) != 32:
        raise IdentityKeyError(f"key {name!r} has {len(raw)} bytes, expected 32")
    return raw


def _raw_public(key: Ed25519PublicKey | X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _raw_private(key: Ed25519PrivateKey | X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
