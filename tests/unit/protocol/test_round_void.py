"""A round void: signed by every tallier, for this run and round, naming the box keys the ballot was sealed to."""

import pytest
from consilium.crypto.identity import PrivateIdentity
from consilium.protocol.voting.round_void import MAX_VOIDS, VoidError, check_void, sign_void, void_signers
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

TALLIERS = ("tallier-1", "tallier-2", "tallier-3")


@pytest.fixture(scope="module")
def talliers():
    identities = {name: PrivateIdentity.generate() for name in TALLIERS}
    box_keys = {name: X25519PrivateKey.generate().public_key() for name in TALLIERS}
    return identities, box_keys


def _signatures(talliers, *, run="run:abc", round_number=2, box_keys=None):
    identities, keys = talliers
    keys = box_keys or keys
    return {
        name: sign_void(identity.signing, run=run, round_number=round_number, tallier=name, box_key=keys[name])
        for name, identity in identities.items()
    }


def _check(talliers, signatures, round_number=2, *, last_round=2, voids=0):
    identities, box_keys = talliers
    check_void(
        signatures,
        round_number=round_number,
        last_ballot=(last_round, box_keys),
        voids=voids,
        identities={name: identity.public.signing for name, identity in identities.items()},
        run="run:abc",
    )


def test_every_tallier_s_signature_over_this_run_round_and_box_keys_makes_a_void(talliers):
    _check(talliers, _signatures(talliers))


def test_a_void_of_another_run_or_round_from_fewer_talliers_or_under_other_box_keys_is_refused(talliers):
    with pytest.raises(VoidError, match="does not verify"):
        _check(talliers, _signatures(talliers, run="run:abd"))
    with pytest.raises(VoidError, match="does not verify"):
        _check(talliers, _signatures(talliers), round_number=3, last_round=3)
    with pytest.raises(VoidError, match="not of round 3, this hospital's last ballot"):  # a round before its last
        _check(talliers, _signatures(talliers), last_round=3)
    with pytest.raises(VoidError, match=f"{MAX_VOIDS} rounds of this run were void already"):
        _check(talliers, _signatures(talliers), voids=MAX_VOIDS)
    with pytest.raises(VoidError, match="not by every tallier"):
        _check(talliers, {k: v for k, v in _signatures(talliers).items() if k != "tallier-2"})
    # A tallier state made afresh (a run begun again after Finish, a lost state file) has a new box key: its
    # void does not name the key this hospital sealed to, and is refused (void-rounds review 1, finding 1).
    fresh = {name: X25519PrivateKey.generate().public_key() for name in TALLIERS}
    with pytest.raises(VoidError, match="under the box key this hospital sealed to"):
        _check(talliers, _signatures(talliers, box_keys=fresh))
    forged = _signatures(talliers)
    forged["tallier-3"] = _signatures(talliers)["tallier-1"]
    with pytest.raises(VoidError, match="tallier-3's signature"):
        _check(talliers, forged)


def test_the_server_counts_as_signers_only_the_talliers_whose_void_verifies(talliers):
    identities, box_keys = talliers
    public = {name: identity.public.signing for name, identity in identities.items()}
    signatures = _signatures(talliers)
    settings = dict(run="run:abc", round_number=2, identities=public, box_keys=box_keys)
    assert void_signers(signatures, **settings) == set(TALLIERS)
    withheld = {**signatures, "tallier-1": bytes(64)}  # no signature: bytes of its length
    del withheld["tallier-2"]
    assert void_signers(withheld, **settings) == {"tallier-3"}
    swapped = {"tallier-1": signatures["tallier-2"], "tallier-2": signatures["tallier-1"], "stranger": b"x"}
    assert void_signers(swapped, **settings) == set()  # each signs its own statement only
    assert void_signers(signatures, **{**settings, "round_number": 3}) == set()
