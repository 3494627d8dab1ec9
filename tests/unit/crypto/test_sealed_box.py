import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from consilium.crypto.identity import IdentityKeyError, PrivateIdentity, PublicIdentity
from consilium.crypto.sealed_box import (
    _VERSION,
    SealedBoxError,
    _certified_message,
    _signed_message,
    open_box,
    seal,
    verify_box,
    verify_certified_key,
)

CONTEXT = b"consilium/test|run|hospital-2"


@pytest.fixture(scope="module")
def parties():
    return PrivateIdentity.generate(), PrivateIdentity.generate(), PrivateIdentity.generate()


def _seal(sender, recipient, message=b"the BFV secret context"):
    return seal(message, recipient=recipient.public.box, sender=sender.signing, context=CONTEXT)


def _open(box, sender, recipient, context=CONTEXT):
    return open_box(box, recipient=recipient.box, sender=sender.public.signing, context=context)


def test_the_recipient_opens_what_the_sender_sealed(parties):
    sender, recipient, _ = parties
    assert _open(_seal(sender, recipient), sender, recipient) == b"the BFV secret context"


def test_the_plaintext_does_not_appear_in_the_box(parties):
    sender, recipient, _ = parties
    secret = b"0123456789abcdef" * 8
    assert secret not in _seal(sender, recipient, secret)


def test_every_altered_byte_is_detected(parties):
    sender, recipient, _ = parties
    box = _seal(sender, recipient)
    for position in range(len(box)):
        tampered = bytearray(box)
        tampered[position] ^= 0x01
        with pytest.raises(SealedBoxError):
            _open(bytes(tampered), sender, recipient)


@pytest.mark.parametrize("case", ["other recipient", "other sender", "other context", "truncated"])
def test_a_box_opens_only_as_sealed(parties, case):
    sender, recipient, stranger = parties
    box = _seal(sender, recipient)
    with pytest.raises(SealedBoxError):
        if case == "other recipient":
            _open(box, sender, stranger)
        elif case == "other sender":
            _open(box, stranger, recipient)
        elif case == "other context":
            _open(box, sender, recipient, context=b"consilium/test|run|hospital-3")
        else:
            _open(box[:50], sender, recipient)


def test_a_box_signed_by_the_right_sender_for_someone_else_cannot_be_redirected(parties):
    """The signature covers the recipient: a relay cannot re-address a box."""
    sender, recipient, stranger = parties
    box_for_stranger = _seal(sender, stranger)
    with pytest.raises(SealedBoxError):
        _open(box_for_stranger, sender, recipient)


def test_identity_keys_round_trip_and_bad_keys_are_named(parties):
    identity = parties[0]
    restored = PrivateIdentity.from_text(identity.to_text())
    assert restored.public.to_text() == identity.public.to_text()
    assert PublicIdentity.from_text(identity.public.to_text()).to_text() == identity.public.to_text()
    with pytest.raises(IdentityKeyError, match="sign_public"):
        PublicIdentity.from_text({"sign_public": "not base64!", "box_public": identity.public.to_text()["box_public"]})
    with pytest.raises(IdentityKeyError, match="box_secret"):
        PrivateIdentity.from_text({"sign_secret": identity.to_text()["sign_secret"]})


def test_a_box_s_own_key_opens_it_for_anyone_and_no_other_box():
    """A recipient shows what a sender sealed to it, and only that box, by revealing that box's key."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from consilium.crypto.sealed_box import box_key, open_with_box_key

    sender, recipient = Ed25519PrivateKey.generate(), X25519PrivateKey.generate()
    boxes = [
        seal(b"share " + i, recipient=recipient.public_key(), sender=sender, context=b"round 3") for i in (b"1", b"2")
    ]
    key = box_key(boxes[0], recipient=recipient)
    shown = dict(recipient=recipient.public_key(), sender=sender.public_key(), context=b"round 3")
    assert open_with_box_key(boxes[0], key=key, **shown) == b"share 1"
    with pytest.raises(SealedBoxError, match="does not decrypt"):
        open_with_box_key(boxes[1], key=key, **shown)
    with pytest.raises(
        SealedBoxError, match="does not decrypt"
    ):  # a made-up key cannot pin other contents on the sender
        open_with_box_key(boxes[0], key=bytes(32), **shown)
    with pytest.raises(SealedBoxError, match="signature"):
        open_with_box_key(boxes[0], key=key, **{**shown, "context": b"round 4"})


def test_a_low_order_point_is_refused_as_a_certified_key_as_a_recipient_and_in_a_signed_box(parties):
    """An exchange with a low-order point gives the all-zero secret, which cryptography refuses with a
    ValueError: signed, such a key would pass every signature check and then fail every exchange
    (review 5, finding 1). Each place names it instead."""
    sender, recipient, _ = parties
    low_order = bytes(32)
    certified = low_order + sender.signing.sign(_certified_message(low_order, CONTEXT))
    with pytest.raises(SealedBoxError, match="certified key is a low-order point"):
        verify_certified_key(certified, signer=sender.public.signing, context=CONTEXT)
    with pytest.raises(SealedBoxError, match="low-order point"):
        seal(b"x", recipient=X25519PublicKey.from_public_bytes(low_order), sender=sender.signing, context=CONTEXT)
    body = _VERSION + low_order + bytes(12) + bytes(16 + 8)  # ephemeral key 0, a nonce, a tagged body
    recipient_public = recipient.public.box
    raw_recipient = recipient_public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    box = body + sender.signing.sign(_signed_message(body, CONTEXT, raw_recipient))
    with pytest.raises(SealedBoxError, match="ephemeral key is a low-order point"):
        verify_box(box, recipient=recipient_public, sender=sender.public.signing, context=CONTEXT)
    with pytest.raises(SealedBoxError):  # a one-line reason, not a ValueError from inside cryptography
        _open(box, sender, recipient)


def test_a_sender_s_kept_ephemeral_secret_opens_its_box_and_no_other(parties):
    """Revealed, ``e`` opens the box it sealed and no other box of the same sender to the same recipient."""
    from consilium.crypto.sealed_box import open_with_ephemeral, seal_revealable

    sender, recipient, _ = parties
    sealed = [
        seal_revealable(b"share " + i, recipient=recipient.public.box, sender=sender.signing, context=CONTEXT)
        for i in (b"1", b"2")
    ]
    shown = dict(recipient=recipient.public.box, sender=sender.public.signing, context=CONTEXT)
    assert open_with_ephemeral(sealed[0][0], ephemeral=sealed[0][1], **shown) == b"share 1"
    assert _open(sealed[1][0], sender, recipient) == b"share 2"  # the recipient opens it as any box
    with pytest.raises(SealedBoxError, match="not the box's"):
        open_with_ephemeral(sealed[1][0], ephemeral=sealed[0][1], **shown)
    with pytest.raises(SealedBoxError, match="32 bytes"):
        open_with_ephemeral(sealed[0][0], ephemeral=sealed[0][1][:31], **shown)


def test_a_box_its_sender_encrypted_under_a_key_of_its_own_does_not_open_with_its_ephemeral_secret(parties):
    """A sender that signs a box encrypted under a key of its own making (which the recipient cannot derive) cannot
    show it as one the recipient should have opened: the revealed ``e`` gives the recipient's key, not its own."""
    import os

    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    from consilium.crypto.sealed_box import open_with_ephemeral

    sender, recipient, _ = parties
    ephemeral, own_key, nonce = X25519PrivateKey.generate(), os.urandom(32), os.urandom(12)
    public = ephemeral.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    body = _VERSION + public + nonce + ChaCha20Poly1305(own_key).encrypt(nonce, b"a share", CONTEXT)
    recipient_raw = recipient.public.box.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    box = body + sender.signing.sign(_signed_message(body, CONTEXT, recipient_raw))
    secret = ephemeral.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    verify_box(box, recipient=recipient.public.box, sender=sender.public.signing, context=CONTEXT)  # it is the sender's
    with pytest.raises(SealedBoxError, match="does not decrypt"):
        _open(box, sender, recipient)
    with pytest.raises(SealedBoxError, match="does not decrypt"):
        open_with_ephemeral(
            box, ephemeral=secret, recipient=recipient.public.box, sender=sender.public.signing, context=CONTEXT
        )
