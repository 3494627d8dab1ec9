"""One round of the one-time-key secure sum, every party in-process with real SEAL and real sealed boxes.

The server's part is played by ``SumRound`` or by a test that deviates from it; each hospital is a
``HospitalRound``. What crosses between them is exactly what the design's messages carry.
"""

from dataclasses import replace

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.bfv_parameters import select_bfv_parameters
from consilium.crypto.key_shares import Release, rebuild
from consilium.crypto.one_time_keys import check_zero_slots, decrypt_sum, pack_ring, sum_uploads, unpack_ring
from consilium.crypto.sealed_box import box_key, certify_key, seal
from consilium.protocol.secure_round.checks import check_opening
from consilium.protocol.secure_round.hospital_round import HospitalRound
from consilium.protocol.secure_round.statement import (
    Proved,
    Released,
    RoundRefused,
    RoundSetting,
    box_context,
    box_key_context,
    check_threshold,
    endorsement_message,
    proof_message,
    release_commitment,
    release_message,
    share_bytes,
)
from consilium.protocol.secure_round.sum_round import SumRound

LENGTH = 2000
NAMES = ("h1", "h2", "h3")
STATE = dict(round_state={"v": 1.0}, previous_result=b"p" * 32)


@pytest.fixture(scope="module")
def public():
    return PublicContext(select_bfv_parameters(max_contributors=3, vector_length=LENGTH, sum_bound=2**12))


class Federation:
    """Three hospitals and an honest server, played step by step."""

    def __init__(self, public, round_number=1):
        params = public.params
        self.public = public
        self.setting = RoundSetting("run-x", round_number, NAMES, threshold=2, quorum=3, params=params)
        self.signing = {name: Ed25519PrivateKey.generate() for name in NAMES}
        self.box = {name: X25519PrivateKey.generate() for name in NAMES}
        self.identities = {name: key.public_key() for name, key in self.signing.items()}
        self.box_keys = {
            name: certify_key(
                self.box[name].public_key(),
                signer=self.signing[name],
                context=box_key_context("run-x", name, round_number),
            )
            for name in NAMES
        }
        self.hospitals = {
            name: HospitalRound(self.setting, public, name=name, signing=self.signing[name], box=self.box[name])
            for name in NAMES
        }
        rng = np.random.default_rng()
        self.values = {name: rng.integers(-500, 500, size=LENGTH) for name in NAMES}
        self.server = SumRound(self.setting, public)
        self.uploads, self.boxes = {}, {}
        for name, hospital in self.hospitals.items():
            self.uploads[name], self.boxes[name] = hospital.upload(
                self.slots(self.values[name]), self.box_keys, self.identities
            )
            self.server.add(name, self.uploads[name])
        self.dealings = {name: hospital._key.dealing for name, hospital in self.hospitals.items()}
        self.total = self.server.total(NAMES, self.box_keys, **STATE)

    def slots(self, values):
        params = self.setting.params
        slots = params.slots_of(values)
        return slots

    def boxes_for(self, recipient):
        return {dealer: self.boxes[dealer][recipient] for dealer in NAMES}

    def endorse(self, total=None, names=NAMES):
        return {
            name: self.hospitals[name].endorse(
                NAMES, self.server.digests, total or self.total, self.boxes_for(name), self.identities, **STATE
            )
            for name in names
        }

    def prove(self, endorsements):
        self.server.endorsed(endorsements, self.identities)
        return {name: h.prove(endorsements, self.identities) for name, h in self.hospitals.items()}

    def release(self, endorsements):
        proofs = self.prove(endorsements)
        self.server.proved(proofs, self.identities)
        return {name: h.release(proofs, self.identities) for name, h in self.hospitals.items()}

    def signed(self, name, release):
        opened = self.hospitals[name]._opened
        message = release_message(opened.statement, opened.seed, opened.proofs_digest, release)
        return Released(release, self.signing[name].sign(message))

    def decoded(self, slots):
        params = self.setting.params
        return params.digits.from_slots(slots[: params.digits.slots_for(LENGTH)], LENGTH)


def test_every_party_opens_exactly_the_sum(public):
    federation = Federation(public)
    releases = federation.release(federation.endorse())
    expected = sum(federation.values.values())
    assert np.array_equal(federation.decoded(federation.server.open(releases, federation.identities)), expected)
    for hospital in federation.hospitals.values():
        assert np.array_equal(federation.decoded(hospital.open(releases, federation.identities)), expected)


def test_the_server_with_one_hospital_opens_the_sum_and_no_other_update(public):
    """The server's whole view plus every secret of h3 (its shares, its key's dealing, its values):
    the sum decrypts; neither h1's nor h2's upload does under any key that view can rebuild."""
    federation = Federation(public)
    dealt = federation.dealings["h3"].shares
    releases = federation.release(federation.endorse())
    q, h3 = public.params.ciphertext_modulus, federation.hospitals["h3"]
    assert np.array_equal(
        federation.decoded(federation.server.open(releases, federation.identities)), sum(federation.values.values())
    )
    own_key = rebuild({1: dealt[0].share, 2: dealt[1].share}, 2, q)
    sum_key = rebuild({1: releases["h1"].release.share, 2: releases["h2"].release.share}, 2, q)
    others = ((sum_key.astype(object) - own_key.astype(object)) % q).astype(np.uint64)  # k1 + k2
    a = federation.setting.public_polynomials
    data_slots = public.params.digits.slots_for(LENGTH)
    for name in ("h1", "h2"):
        upload = unpack_ring(public, federation.uploads[name], "upload")
        for guess in (others, h3._shares[name].share, sum_key):
            with pytest.raises(BfvError, match="zero slots"):
                check_zero_slots(public, decrypt_sum(public, upload, guess, a), data_slots)
    honest = sum_uploads(public, [unpack_ring(public, federation.uploads[n], "upload") for n in ("h1", "h2")])
    opened = decrypt_sum(public, honest, others, a)
    assert np.array_equal(federation.decoded(opened), federation.values["h1"] + federation.values["h2"])


@pytest.mark.parametrize("change", ["shifted", "dropped", "doubled", "extra ciphertext"])
def test_a_sum_the_server_changed_is_refused_before_any_release(public, change):
    federation = Federation(public)
    q, delta = public.params.ciphertext_modulus, public.params.ciphertext_modulus // public.params.plain_modulus
    total = unpack_ring(public, federation.total, "sum")
    h1 = unpack_ring(public, federation.uploads["h1"], "upload")
    if change == "extra ciphertext":
        forged = federation.total + [pack_ring(public, np.zeros((1, public.params.poly_modulus_degree)))[0]]
        for name, hospital in federation.hospitals.items():
            with pytest.raises(RoundRefused, match="ciphertexts") as refused:
                hospital.endorse(
                    NAMES, federation.server.digests, forged, federation.boxes_for(name), federation.identities, **STATE
                )
            assert refused.value.named == ("server",)
        return
    if change == "shifted":  # plus Delta in one slot: it would decrypt one higher there, zero slots intact
        total[0, 3] = (int(total[0, 3]) + delta) % q
    elif change == "dropped":
        total = ((total.astype(object) - h1.astype(object)) % q).astype(np.uint64)
    else:
        total = sum_uploads(public, [total, h1])
    endorsements = federation.endorse(total=pack_ring(public, total))
    for hospital in federation.hospitals.values():
        with pytest.raises(RoundRefused, match="not the members' uploads") as refused:
            hospital.prove(endorsements, federation.identities)
        assert refused.value.named == ("server",)


def test_the_server_names_a_member_whose_hashes_are_not_of_its_upload(public):
    federation = Federation(public)
    endorsements = federation.endorse()
    h2 = federation.hospitals["h2"]
    hashes = (endorsements["h2"].hashes[0] ^ 1,) + endorsements["h2"].hashes[1:]
    message = endorsement_message(h2._opened.statement, hashes, endorsements["h2"].commitment)
    lying = replace(endorsements["h2"], hashes=hashes, signature=federation.signing["h2"].sign(message))
    with pytest.raises(RoundRefused, match="h2 signed hashes of another upload") as refused:
        federation.server.endorsed(dict(endorsements, h2=lying), federation.identities)
    assert refused.value.named == ("h2",)


def test_a_replayed_upload_or_box_or_a_box_key_of_another_round_is_refused_and_blames_the_relay(public):
    old, new = Federation(public, round_number=1), Federation(public, round_number=2)
    replayed = dict(new.server.digests, h1=old.server.digests["h1"])
    with pytest.raises(RoundRefused, match="uploads listed") as refused:  # h1 sees another digest than its own
        new.hospitals["h1"].endorse(NAMES, replayed, new.total, new.boxes_for("h1"), new.identities, **STATE)
    assert refused.value.named == ("server",)
    boxes = dict(new.boxes_for("h2"), h1=old.boxes["h1"]["h2"])
    with pytest.raises(RoundRefused, match="from h1 does not verify") as refused:
        new.hospitals["h2"].endorse(NAMES, new.server.digests, new.total, boxes, new.identities, **STATE)
    assert refused.value.named == ("server",)
    fresh = HospitalRound(new.setting, public, name="h1", signing=new.signing["h1"], box=new.box["h1"])
    stale = dict(new.box_keys, h2=old.box_keys["h2"])  # certified by h2, but for round 1 (review F3)
    with pytest.raises(RoundRefused, match="not certified for this round") as refused:
        fresh.upload(new.slots(new.values["h1"]), stale, new.identities)
    assert refused.value.named == ("server",)


def test_a_release_off_its_commitment_names_its_member_and_a_changed_one_the_relay(public):
    federation = Federation(public)
    releases = federation.release(federation.endorse())
    share = releases["h2"].release.share.copy()
    share[0] = (int(share[0]) + 1) % public.params.ciphertext_modulus
    wrong = Release(share, releases["h2"].release.masks)
    with pytest.raises(RoundRefused, match="h2 released wrong values") as refused:
        federation.server.open(dict(releases, h2=federation.signed("h2", wrong)), federation.identities)
    assert refused.value.named == ("h2",)
    # The server catches it as the release arrives, not only once every member released (review 5, finding 3).
    assert federation.server.release_refusal("h1", releases["h1"], federation.identities["h1"]) == ""
    with pytest.raises(RoundRefused, match="h2 released wrong values, which it signed") as refused:
        federation.server.release_refusal("h2", federation.signed("h2", wrong), federation.identities["h2"])
    assert refused.value.named == ("h2",)
    moved = Release(
        np.append(releases["h2"].release.share[1:], releases["h2"].release.masks[0]).astype(np.uint64),
        (int(releases["h2"].release.share[0]),) + releases["h2"].release.masks[1:],
    )
    for changed in (
        Released(wrong, releases["h2"].signature),
        replace(releases["h2"], release=moved),
    ):
        with pytest.raises(RoundRefused, match="not its signed release") as refused:  # the relay changed it
            federation.hospitals["h1"].open(dict(releases, h2=changed), federation.identities)
        assert refused.value.named == ("server",)
        federation = Federation(public)
        releases = federation.release(federation.endorse())
    with pytest.raises(RoundRefused, match="not from every member"):
        federation.server.open({n: r for n, r in releases.items() if n != "h3"}, federation.identities)


@pytest.mark.parametrize("wrong", ["off by 7", "at or above q"])
def test_a_release_committed_wrong_from_the_start_is_named(public, wrong):
    """h2 endorses a commitment to a wrong release and releases exactly that: only the proofs catch a
    value off by 7; a value padded by q, which would hash and rebuild as the honest one, is refused
    before (review 3, finding 4)."""
    federation = Federation(public)
    h2 = federation.hospitals["h2"]
    endorse = h2._do_endorse

    def endorse_wrong(*args):
        endorsed = endorse(*args)
        share = h2._release.share.copy()
        share[5] += np.uint64(7 if wrong == "off by 7" else public.params.ciphertext_modulus)
        share[5] %= np.uint64(public.params.ciphertext_modulus if wrong == "off by 7" else 2**63)
        h2._release = Release(share, h2._release.masks)
        commitment = release_commitment(federation.setting, "h2", h2._release)
        message = endorsement_message(h2._opened.statement, endorsed.hashes, commitment)
        return replace(endorsed, commitment=commitment, signature=federation.signing["h2"].sign(message))

    h2._do_endorse = endorse_wrong
    releases = federation.release(federation.endorse())
    for party in (federation.server, federation.hospitals["h1"]):
        with pytest.raises(RoundRefused, match="h2 released wrong values") as refused:
            party.open(releases, federation.identities)
        assert refused.value.named == ("h2",)


def _resealed(federation, dealer, recipient, payload):
    context = box_context(federation.setting, dealer, recipient, federation.server.digests[dealer])
    return seal(
        payload, recipient=federation.box[recipient].public_key(), sender=federation.signing[dealer], context=context
    )


def test_a_dealer_that_deals_one_recipient_off_its_polynomial_is_named_with_an_opening(public):
    federation = Federation(public)
    dealing = federation.dealings["h3"]
    bad = dealing.shares[0].share.copy()
    bad[9] = (int(bad[9]) + 1) % public.params.ciphertext_modulus
    # h3 seals h1 a share off the polynomial it will prove, as a dishonest dealer would.
    federation.boxes["h3"]["h1"] = _resealed(
        federation, "h3", "h1", share_bytes(public, replace(dealing.shares[0], share=bad))
    )
    proofs = federation.prove(federation.endorse())
    statement = federation.hospitals["h1"]._opened.statement
    assert federation.hospitals["h2"].release(proofs, federation.identities)  # h2's share is on h3's proof
    with pytest.raises(RoundRefused, match="not on the polynomials") as refused:
        federation.hospitals["h1"].release(proofs, federation.identities)  # before h1 releases anything
    assert refused.value.named == ("h3",)
    evidence = dict(
        statement=statement,
        recipient="h1",
        recipient_box_key=federation.box_keys["h1"],
        identities=federation.identities,
    )
    assert check_opening(
        federation.setting,
        public,
        dealer="h3",
        box=federation.boxes["h3"]["h1"],
        key=refused.value.openings["h3"],
        dealer_upload=federation.server.digests["h3"],
        proved=proofs["h3"],
        **evidence,
    )
    honest = dict(
        dealer="h2",
        box=federation.boxes["h2"]["h1"],
        key=box_key(federation.boxes["h2"]["h1"], recipient=federation.box["h1"]),
        dealer_upload=federation.server.digests["h2"],
    )
    # A false complaint against an honest dealer shows its share on its proof: it convicts nobody.
    assert not check_opening(federation.setting, public, proved=proofs["h2"], **honest, **evidence)
    # Nor does a proof the dealer never signed (review 3, finding 3).
    unsigned = replace(proofs["h2"], proof=tuple((1,) * 2 for _ in proofs["h2"].proof))
    assert not check_opening(federation.setting, public, proved=unsigned, **honest, **evidence)


def test_a_dealer_s_signed_box_that_holds_no_share_names_the_dealer(public):
    federation = Federation(public)
    federation.boxes["h3"]["h1"] = _resealed(federation, "h3", "h1", b"not a share")
    with pytest.raises(RoundRefused, match="h3 sealed us no share") as refused:
        federation.endorse(names=("h1",))
    assert refused.value.named == ("h3",) and set(refused.value.openings) == {"h3"}


def test_proofs_reshaped_split_or_unsigned_end_the_round_without_opening_anything(public):
    """A relay that re-shapes, re-types or swaps a signed proof, or shows members different
    endorsements, is named, and no share is opened (reviews 2 R1, R2; 3 finding 1)."""
    federation = Federation(public)
    proofs = federation.prove(federation.endorse())
    p = proofs["h2"].proof
    for changed, refusal in (
        (replace(proofs["h2"], seed=bytes(32)), "other challenges"),
        (replace(proofs["h2"], proof=proofs["h3"].proof), "h2's proof is not its signed proof"),
        (replace(proofs["h2"], proof=(p[0] + (p[1][0],), p[1][1:]) + p[2:]), "h2's proof is not its signed proof"),
        (replace(proofs["h2"], proof=((np.int64(p[0][0]),) + p[0][1:],) + p[1:]), "h2's proof is not its signed proof"),
    ):
        hospital = HospitalRound(
            federation.setting, public, name="h1", signing=federation.signing["h1"], box=X25519PrivateKey.generate()
        )
        hospital._steps._done, hospital._opened = 3, federation.hospitals["h1"]._opened
        hospital._shares, hospital._openings = federation.hospitals["h1"]._shares, federation.hospitals["h1"]._openings
        with pytest.raises(RoundRefused, match=refusal) as refused:
            hospital.release(dict(proofs, h2=changed), federation.identities)
        assert refused.value.named == ("server",) and not refused.value.openings


def test_a_dealer_that_signs_two_proofs_splits_no_verdict_onto_an_honest_releaser(public):
    """h3 signs a second proof that agrees with h2's share but not h1's; the relay shows it to h2 only.
    h2 releases over other proofs than h1 holds: h1 names the relay, never h2 (review 3, finding 2)."""
    federation = Federation(public)
    proofs = federation.prove(federation.endorse())
    q, statement, seed = (
        public.params.ciphertext_modulus,
        federation.hospitals["h2"]._opened.statement,
        proofs["h3"].seed,
    )
    half = pow(2, -1, q)  # P'(x) = P(x) + (1 - x / 2): equal at h2's point x = 2
    other = tuple(((row[0] + 1) % q, (row[1] - half) % q) for row in proofs["h3"].proof)
    second = Proved(seed, other, federation.signing["h3"].sign(proof_message(statement, seed, other)))
    releases = {
        "h1": federation.hospitals["h1"].release(proofs, federation.identities),  # h1 holds the first proof
        "h2": federation.hospitals["h2"].release(dict(proofs, h3=second), federation.identities),
        "h3": federation.hospitals["h3"].release(proofs, federation.identities),
    }
    with pytest.raises(RoundRefused, match="h2's release is not its signed release over the proofs we hold") as refused:
        federation.hospitals["h1"].open(releases, federation.identities)
    assert refused.value.named == ("server",)


@pytest.mark.parametrize(
    "field, value",
    [("hashes", (-1,)), ("hashes", (2**64,)), ("hashes", ("x",)), ("commitment", "c" * 32), ("signature", None)],
)
def test_malformed_endorsement_fields_raise_a_refusal_and_nothing_else(public, field, value):
    federation = Federation(public)
    endorsements = federation.endorse()
    bad = replace(endorsements["h2"], **{field: value if field != "hashes" else value + endorsements["h2"].hashes[1:]})
    with pytest.raises(RoundRefused, match="h2's endorsement is not its signature"):
        federation.hospitals["h1"].prove(dict(endorsements, h2=bad), federation.identities)


def test_each_step_happens_once_in_order_and_none_after_a_refusal(public):
    federation = Federation(public)
    hospital = federation.hospitals["h1"]
    with pytest.raises(RoundRefused, match="out of order, or a second time"):
        hospital.upload(np.zeros(1), federation.box_keys, federation.identities)
    with pytest.raises(RoundRefused, match="out of order"):
        hospital.prove({}, federation.identities)
    endorsements = federation.endorse()
    with pytest.raises(RoundRefused, match="out of order, or a second time"):
        federation.endorse()
    proofs = federation.prove(endorsements)
    with pytest.raises(RoundRefused, match="out of order, or a second time"):  # a second proof would unmask the key
        hospital.prove(endorsements, federation.identities)
    with pytest.raises(RoundRefused, match="not from every member"):
        hospital.release({}, federation.identities)
    with pytest.raises(RoundRefused, match="was refused"):
        hospital.release(proofs, federation.identities)
    with pytest.raises(RoundRefused, match="out of order"):
        SumRound(federation.setting, public).open({}, federation.identities)
    with pytest.raises(BfvError, match="no upload is taken"):
        federation.server.add("h1", federation.uploads["h1"])


def test_an_endorsement_set_missing_a_member_or_a_forged_signature_is_refused(public):
    for forge in ("missing", "forged"):
        federation = Federation(public)
        endorsements = federation.endorse()
        if forge == "missing":
            given, refusal = {n: e for n, e in endorsements.items() if n != "h2"}, "not from every member"
        else:
            given, refusal = (
                dict(endorsements, h2=replace(endorsements["h2"], commitment=bytes(32))),
                "h2's endorsement",
            )
        with pytest.raises(RoundRefused, match=refusal):
            federation.hospitals["h1"].prove(given, federation.identities)


@pytest.mark.parametrize(
    "hospitals, threshold, quorum, refusal",
    [
        (2, 2, 2, "at least 3 hospitals"),
        (5, 2, 5, "between 3 and 5"),
        (5, 3, 3, "at least the threshold plus one"),
        (3, 2, 2, "at least the threshold plus one"),  # review F1: a quorum of tau lets the server isolate a hospital
    ],
)
def test_thresholds_below_the_guarantee_are_refused(public, hospitals, threshold, quorum, refusal):
    with pytest.raises(ValueError, match=refusal):
        check_threshold(hospitals, threshold, quorum)
    names = tuple(f"h{i}" for i in range(1, hospitals + 1))
    with pytest.raises(ValueError, match=refusal):
        RoundSetting("run-x", 1, names, threshold=threshold, quorum=quorum, params=public.params)
    check_threshold(3, 2, 3)
    check_threshold(5, 3, 4)


def test_a_signed_box_that_does_not_decrypt_names_its_dealer_and_the_server_refuses_unsigned_boxes(public):
    """The server checks every dealer's signatures before it relays (review 4, finding 1): a box that
    does not verify is refused with its upload, so a hospital that gets one names the relay; a box the
    dealer signed but that does not decrypt is the dealer's."""
    federation = Federation(public)
    box = federation.boxes["h3"]["h1"]
    garbled = box[:60] + bytes([box[60] ^ 1]) + box[61:]
    assert "" == federation.server.box_refusal(
        "h3", federation.uploads["h3"], federation.boxes["h3"], federation.box_keys, federation.identities
    )
    fresh = SumRound(federation.setting, public)
    refusal = fresh.box_refusal(
        "h3",
        federation.uploads["h3"],
        dict(federation.boxes["h3"], h1=garbled),
        federation.box_keys,
        federation.identities,
    )
    assert refusal.startswith("the share h3 sealed to h1 does not verify")
    # Signed by h3 over a ciphertext whose tag fails: the signature holds, the box does not open.
    from consilium.crypto.sealed_box import _signed_message, _SIGNATURE_BYTES

    body = bytearray(box[:-_SIGNATURE_BYTES])
    body[-1] ^= 1
    context = box_context(federation.setting, "h3", "h1", federation.server.digests["h3"])
    message = _signed_message(bytes(body), context, federation.box["h1"].public_key().public_bytes_raw())
    federation.boxes["h3"]["h1"] = bytes(body) + federation.signing["h3"].sign(message)
    with pytest.raises(RoundRefused, match="h3 signed a share that does not open") as refused:
        federation.endorse(names=("h1",))
    assert refused.value.named == ("h3",) and set(refused.value.openings) == {"h3"}
