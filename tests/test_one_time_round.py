"""One round of the one-time-key secure sum, every party in-process with real SEAL and real sealed boxes.

The server's part is played by ``SumRound`` or by a test that deviates from it; each hospital is a
``HospitalRound``. What crosses between them is exactly what the design's messages carry.
"""

from dataclasses import replace

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from crypto.bfv import BfvError, PublicContext
from crypto.bfv_parameters import select_bfv_parameters
from crypto.key_shares import Release, rebuild
from crypto.one_time_keys import check_zero_slots, decrypt_sum, pack_ring, sum_uploads, unpack_ring
from crypto.sealed_box import box_key, seal
from protocol.one_time_round import (
    HospitalRound,
    Released,
    RoundRefused,
    RoundSetting,
    SumRound,
    _challenges,
    _endorsement_message,
    _release_message,
    _share_bytes,
    box_context,
    check_opening,
    check_threshold,
    release_commitment,
)

LENGTH = 2000
NAMES = ("h1", "h2", "h3")
STATE = dict(round_state={"v": 1.0}, box_keys_digest=b"k" * 32, previous_result=b"p" * 32)


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
        self.signers = {name: key.public_key() for name, key in self.signing.items()}
        self.hospitals = {
            name: HospitalRound(self.setting, public, name=name, signing=self.signing[name], box=self.box[name])
            for name in NAMES
        }
        rng = np.random.default_rng()
        self.values = {name: rng.integers(-500, 500, size=LENGTH) for name in NAMES}
        self.server = SumRound(self.setting, public)
        self.uploads, self.boxes = {}, {}
        for name, hospital in self.hospitals.items():
            slots = np.zeros(params.chunk_count * params.poly_modulus_degree, dtype=np.int64)
            digits = params.digits.to_slots(self.values[name])
            slots[: digits.size] = digits
            box_keys = {n: k.public_key() for n, k in self.box.items()}
            self.uploads[name], self.boxes[name] = hospital.upload(slots, box_keys)
            self.server.add(name, self.uploads[name])
        self.dealings = {name: hospital._key.dealing for name, hospital in self.hospitals.items()}
        self.total = self.server.total(NAMES)
        self.server.statement(**STATE)

    def boxes_for(self, recipient):
        return {dealer: self.boxes[dealer][recipient] for dealer in NAMES}

    def endorse(self, total=None):
        return {
            name: hospital.endorse(
                NAMES, self.server.digests, total or self.total, self.boxes_for(name), self.signers, **STATE
            )
            for name, hospital in self.hospitals.items()
        }

    def prove(self, endorsements):
        self.server.endorsed(endorsements, self.signers)
        return {name: h.prove(endorsements, self.signers) for name, h in self.hospitals.items()}

    def release(self, endorsements):
        proofs = self.prove(endorsements)
        self.server.proved(proofs, self.signers)
        return {name: h.release(proofs, self.signers) for name, h in self.hospitals.items()}

    def signed(self, name, release):
        opened = self.hospitals[name]._opened
        return Released(release, self.signing[name].sign(_release_message(opened.statement, opened.seed, release)))

    def decoded(self, slots):
        params = self.setting.params
        return params.digits.from_slots(slots[: params.digits.slots_for(LENGTH)], LENGTH)


def test_every_party_opens_exactly_the_sum(public):
    federation = Federation(public)
    releases = federation.release(federation.endorse())
    expected = sum(federation.values.values())
    assert np.array_equal(federation.decoded(federation.server.open(releases, federation.signers)), expected)
    for hospital in federation.hospitals.values():
        assert np.array_equal(federation.decoded(hospital.open(releases, federation.signers)), expected)


def test_the_server_with_one_hospital_opens_the_sum_and_no_other_update(public):
    """The server's whole view plus every secret of h3 (its shares, its key's dealing, its values):
    the sum decrypts; neither h1's nor h2's upload does under any key that view can rebuild."""
    federation = Federation(public)
    releases = federation.release(federation.endorse())
    q, h3, dealt = public.params.ciphertext_modulus, federation.hospitals["h3"], federation.dealings["h3"]
    assert np.array_equal(
        federation.decoded(federation.server.open(releases, federation.signers)), sum(federation.values.values())
    )
    own_key = rebuild({1: dealt.shares[0].share, 2: dealt.shares[1].share}, 2, q)
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


@pytest.mark.parametrize("change", ["shifted", "dropped", "doubled"])
def test_a_sum_the_server_changed_is_refused_before_any_release(public, change):
    federation = Federation(public)
    q, delta = public.params.ciphertext_modulus, public.params.ciphertext_modulus // public.params.plain_modulus
    total = unpack_ring(public, federation.total, "sum")
    h1 = unpack_ring(public, federation.uploads["h1"], "upload")
    if change == "shifted":  # plus Delta in one slot: it would decrypt one higher there, zero slots intact
        total[0, 3] = (int(total[0, 3]) + delta) % q
    elif change == "dropped":
        total = ((total.astype(object) - h1.astype(object)) % q).astype(np.uint64)
    else:
        total = sum_uploads(public, [total, h1])
    endorsements = federation.endorse(total=pack_ring(public, total))
    for hospital in federation.hospitals.values():
        with pytest.raises(RoundRefused, match="not the members' uploads") as refused:
            hospital.prove(endorsements, federation.signers)
        assert refused.value.named == ("server",)


def test_a_replayed_upload_or_box_is_refused_and_blames_the_relay(public):
    old, new = Federation(public, round_number=1), Federation(public, round_number=2)
    replayed = dict(new.server.digests, h1=old.server.digests["h1"])
    with pytest.raises(RoundRefused, match="uploads listed") as refused:  # h1 sees another digest than its own
        new.hospitals["h1"].endorse(NAMES, replayed, new.total, new.boxes_for("h1"), new.signers, **STATE)
    assert refused.value.named == ("server",)
    boxes = dict(new.boxes_for("h2"), h1=old.boxes["h1"]["h2"])
    with pytest.raises(RoundRefused, match="from h1 does not open") as refused:
        new.hospitals["h2"].endorse(NAMES, new.server.digests, new.total, boxes, new.signers, **STATE)
    assert refused.value.named == ("server",)


def test_a_release_off_its_commitment_names_its_member_and_an_unsigned_one_the_relay(public):
    federation = Federation(public)
    releases = federation.release(federation.endorse())
    share = releases["h2"].release.share.copy()
    share[0] = (int(share[0]) + 1) % public.params.ciphertext_modulus
    wrong = Release(share, releases["h2"].release.masks)
    with pytest.raises(RoundRefused, match="h2 released wrong values") as refused:
        federation.server.open(dict(releases, h2=federation.signed("h2", wrong)), federation.signers)
    assert refused.value.named == ("h2",)
    with pytest.raises(RoundRefused, match="not signed by h2") as refused:  # the relay changed it
        federation.hospitals["h1"].open(
            dict(releases, h2=Released(wrong, releases["h2"].signature)), federation.signers
        )
    assert refused.value.named == ("server",)
    with pytest.raises(RoundRefused, match="not from every member"):
        federation.server.open({n: r for n, r in releases.items() if n != "h3"}, federation.signers)


def test_a_release_committed_wrong_from_the_start_fails_the_proofs_and_names_its_member(public):
    """h2 endorses a commitment to a wrong release and releases exactly that: only the proofs catch it."""
    federation = Federation(public)
    h2 = federation.hospitals["h2"]
    endorse = h2.endorse

    def endorse_wrong(*args, **kwargs):
        endorsed = endorse(*args, **kwargs)
        share = h2._release.share.copy()
        share[5] = (int(share[5]) + 7) % public.params.ciphertext_modulus
        h2._release = Release(share, h2._release.masks)
        commitment = release_commitment(federation.setting, "h2", h2._release)
        message = _endorsement_message(h2._opened.statement, endorsed.hashes, commitment)
        return replace(endorsed, commitment=commitment, signature=federation.signing["h2"].sign(message))

    h2.endorse = endorse_wrong
    releases = federation.release(federation.endorse())
    for party in (federation.server, federation.hospitals["h1"]):
        with pytest.raises(RoundRefused, match="h2 released wrong values") as refused:
            party.open(releases, federation.signers)
        assert refused.value.named == ("h2",)


def test_a_dealer_that_deals_one_recipient_off_its_polynomial_is_named_with_an_opening(public):
    federation = Federation(public)
    dealing = federation.dealings["h3"]
    bad = dealing.shares[0].share.copy()
    bad[9] = (int(bad[9]) + 1) % public.params.ciphertext_modulus
    dealing.shares = (replace(dealing.shares[0], share=bad),) + dealing.shares[1:]
    # h3 seals again what its tampered dealing now says it dealt h1, as a dishonest dealer would have.
    context = box_context(federation.setting, "h3", "h1", federation.server.digests["h3"])
    federation.boxes["h3"]["h1"] = seal(
        _share_bytes(public, dealing.shares[0]),
        recipient=federation.box["h1"].public_key(),
        sender=federation.signing["h3"],
        context=context,
    )
    proofs = federation.prove(federation.endorse())
    assert federation.hospitals["h2"].release(proofs, federation.signers)  # h2's share is on h3's proof
    with pytest.raises(RoundRefused, match="not on the polynomials") as refused:
        federation.hospitals["h1"].release(proofs, federation.signers)  # before h1 releases anything
    assert refused.value.named == ("h3",)
    evidence = dict(
        recipient="h1",
        recipient_box=federation.box["h1"].public_key(),
        challenges=_challenges(federation.setting, proofs["h3"].seed),
    )
    assert check_opening(
        federation.setting,
        public,
        dealer="h3",
        box=federation.boxes["h3"]["h1"],
        key=refused.value.openings["h3"],
        dealer_upload=federation.server.digests["h3"],
        dealer_signing=federation.signers["h3"],
        proof=proofs["h3"].proof,
        **evidence,
    )
    # A false complaint against an honest dealer shows its share on the proof: it names nobody.
    assert not check_opening(
        federation.setting,
        public,
        dealer="h2",
        box=federation.boxes["h2"]["h1"],
        key=box_key(federation.boxes["h2"]["h1"], recipient=federation.box["h1"]),
        dealer_upload=federation.server.digests["h2"],
        dealer_signing=federation.signers["h2"],
        proof=proofs["h2"].proof,
        **evidence,
    )


def test_proofs_under_split_challenges_or_unsigned_end_the_round_without_opening_anything(public):
    """The relay showing members different endorsements (or a member that endorsed twice) yields proofs
    under other challenges, and a relay may swap a dealer's proof: either way the round ends naming
    the relay, and no share is opened (review 2, R1 and R2)."""
    federation = Federation(public)
    proofs = federation.prove(federation.endorse())
    for changed, refusal in (
        (replace(proofs["h2"], seed=bytes(32)), "other challenges"),
        (replace(proofs["h2"], proof=proofs["h3"].proof), "h2's proof is not signed by h2"),
    ):
        with pytest.raises(RoundRefused, match=refusal) as refused:
            federation.hospitals["h1"].release(dict(proofs, h2=changed), federation.signers)
        assert refused.value.named == ("server",) and not refused.value.openings


def test_each_step_happens_once_and_in_order(public):
    federation = Federation(public)
    hospital = federation.hospitals["h1"]
    keys = {n: k.public_key() for n, k in federation.box.items()}
    with pytest.raises(RoundRefused, match="uploads once"):
        hospital.upload(np.zeros(1), keys)
    with pytest.raises(RoundRefused, match="after endorsing"):
        hospital.prove({}, federation.signers)
    with pytest.raises(RoundRefused, match="after its proof"):
        hospital.release({}, federation.signers)
    endorsements = federation.endorse()
    with pytest.raises(RoundRefused, match="endorses once"):
        federation.endorse()
    proofs = federation.prove(endorsements)
    with pytest.raises(RoundRefused, match="proves its dealing once"):  # a second proof would unmask the key
        hospital.prove(endorsements, federation.signers)
    hospital.release(proofs, federation.signers)
    with pytest.raises(RoundRefused, match="releases once"):
        hospital.release(proofs, federation.signers)


def test_an_endorsement_set_missing_a_member_or_a_forged_signature_is_refused(public):
    federation = Federation(public)
    endorsements = federation.endorse()
    hospital = federation.hospitals["h1"]
    with pytest.raises(RoundRefused, match="not from every member"):
        hospital.prove({n: e for n, e in endorsements.items() if n != "h2"}, federation.signers)
    forged = dict(endorsements, h2=replace(endorsements["h2"], commitment=bytes(32)))
    with pytest.raises(RoundRefused, match="h2's endorsement is not its signature"):
        hospital.prove(forged, federation.signers)


@pytest.mark.parametrize(
    "hospitals, threshold, quorum, refusal",
    [(2, 2, 2, "at least 3 hospitals"), (5, 2, 5, "between 3 and 5"), (5, 3, 3, "at least the threshold plus one")],
)
def test_thresholds_below_the_guarantee_are_refused(hospitals, threshold, quorum, refusal):
    with pytest.raises(ValueError, match=refusal):
        check_threshold(hospitals, threshold, quorum)
    check_threshold(3, 2, 3)
    check_threshold(5, 3, 4)
