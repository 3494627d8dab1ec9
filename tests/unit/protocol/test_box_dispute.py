"""Box disputes, their pure parts: a hospital reveals a box's secret only on t + 1 talliers' word, for its last ballot
and at most t boxes of it, and a verdict names the tallier whose BAD box opens, or the hospital whose box does not.
(The round trip between real processes: tests/end_to_end/test_box_disputes.py.)"""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from consilium.crypto.identity import PrivateIdentity
from consilium.crypto.sealed_box import certify_key, seal_revealable
from consilium.protocol.voting.ballots import (
    BAD,
    NONE,
    OK,
    _share_context,
    box_digest,
    seal_ballot,
    tallier_key_context,
)
from consilium.protocol.voting.box_dispute import (
    AttestedDispute,
    SealedBallot,
    attested_disputes,
    dispute_key,
    judge,
    reveal_for,
    sign_dispute,
    unrelayed_marks,
)
from consilium.protocol.wire.messages import Dispute, ProtocolError, Verdict
from consilium.training.voting.vote_privacy import VotingSettings
from test_voting_config import _config

RUN = "run:abc"
TALLIERS = ("tallier-1", "tallier-2", "tallier-3")
CONFIG = _config(queries_per_round=4, voting=VotingSettings("knn-dpfl", noise_std=3.0, quorum=3, neighbours=5))


@pytest.fixture(scope="module")
def federation():
    """Identities for every party (a roster that names them, no more), each tallier's run key, one sealed ballot."""
    identities = {name: PrivateIdentity.generate() for name in (*CONFIG.hospitals, *TALLIERS)}
    roster = SimpleNamespace(party=lambda name: SimpleNamespace(identity=identities[name].public))
    box_keys = {name: X25519PrivateKey.generate() for name in TALLIERS}
    certified = {
        name: certify_key(key.public_key(), signer=identities[name].signing, context=tallier_key_context(RUN, name))
        for name, key in box_keys.items()
    }
    layout = CONFIG.ballot_layout()
    votes = np.zeros((layout.queries, layout.vote_columns), dtype=np.int64)
    votes[:, 0] = layout.votes_per_query
    boxes, secrets = seal_ballot(
        votes,
        np.zeros(layout.pool_values, dtype=np.int64),
        tallier_keys={name: key.public_key() for name, key in box_keys.items()},
        field=CONFIG.field(),
        layout=layout,
        sender=identities["hospital-1"].signing,
        run=RUN,
        round_number=2,
        hospital="hospital-1",
    )
    return SimpleNamespace(
        identities=identities, roster=roster, box_keys=box_keys, certified=certified, boxes=boxes, secrets=secrets
    )


def _signed(federation, box, signers, *, tallier="tallier-2", round_number=2):
    key = dispute_key("hospital-1", tallier, BAD, box_digest(box))
    signing = federation.identities
    return {name: sign_dispute(signing[name].signing, run=RUN, round_number=round_number, key=key) for name in signers}


def _reveal(federation, dispute, sealed=None):
    sealed = sealed or SealedBallot(2, federation.boxes, federation.secrets)
    return reveal_for(
        dispute,
        sealed,
        signing=federation.identities["hospital-1"].signing,
        hospital="hospital-1",
        roster=federation.roster,
        config=CONFIG,
        run=RUN,
    )


def _dispute(federation, signers=("tallier-1", "tallier-2"), tallier="tallier-2", box=None, round_number=2):
    box = box or federation.boxes[tallier]
    signatures = _signed(federation, box, signers, tallier=tallier, round_number=round_number)
    return Dispute(round=round_number, tallier=tallier, box=box, signatures=signatures)


def _verdict(federation, dispute, reveal, **changes):
    verdict = Verdict(
        round=dispute.round,
        hospital="hospital-1",
        tallier=dispute.tallier,
        tallier_key=federation.certified[dispute.tallier],
        box=dispute.box,
        signatures=dispute.signatures,
        ephemeral=reveal.ephemeral,
        reveal_signature=reveal.signature,
    )
    return replace(verdict, **changes)


def test_t_plus_1_talliers_signatures_attest_a_dispute_and_fewer_do_not(federation):
    box = federation.boxes["tallier-2"]
    key = dispute_key("hospital-1", "tallier-2", BAD, box_digest(box))
    signed = _signed(federation, box, TALLIERS)
    claims = {name: {key: signature} for name, signature in signed.items()}
    (attested,) = attested_disputes(claims, roster=federation.roster, config=CONFIG, run=RUN, round_number=2)
    assert (attested.hospital, attested.tallier, attested.digest) == ("hospital-1", "tallier-2", box_digest(box))
    one = {"tallier-2": claims["tallier-2"]}
    assert attested_disputes(one, roster=federation.roster, config=CONFIG, run=RUN, round_number=2) == []
    forged = {**one, "tallier-3": {key: signed["tallier-2"]}}  # tallier-2's signature, claimed as tallier-3's
    assert attested_disputes(forged, roster=federation.roster, config=CONFIG, run=RUN, round_number=2) == []
    other_round = {
        name: {key: signature} for name, signature in _signed(federation, box, TALLIERS, round_number=1).items()
    }
    assert attested_disputes(other_round, roster=federation.roster, config=CONFIG, run=RUN, round_number=2) == []


def test_a_hospital_reveals_a_box_s_secret_only_on_t_plus_1_talliers_word_for_its_last_ballot(federation):
    reveal = _reveal(federation, _dispute(federation))
    assert reveal.ephemeral == federation.secrets["tallier-2"]
    with pytest.raises(ProtocolError, match="1 talliers of the run signed"):
        _reveal(federation, _dispute(federation, signers=("tallier-2",)))  # a server alone, or with the tallier
    with pytest.raises(ProtocolError, match="not over this hospital's last ballot"):
        _reveal(federation, _dispute(federation, round_number=1))
    with pytest.raises(ProtocolError, match="not over this hospital's last ballot"):
        _reveal(federation, _dispute(federation), sealed=SealedBallot(3, federation.boxes, federation.secrets))
    with pytest.raises(ProtocolError, match="not the one this hospital sealed to 'tallier-2'"):
        _reveal(federation, _dispute(federation, box=federation.boxes["tallier-1"]))


def test_a_hospital_reveals_at_most_t_boxes_of_a_ballot(federation):
    """With t = 1 a second box of the same ballot would give, with the first, a whole ballot to two talliers."""
    sealed = SealedBallot(2, federation.boxes, federation.secrets)
    _reveal(federation, _dispute(federation), sealed)
    _reveal(federation, _dispute(federation), sealed)  # the same box again shows nothing new
    with pytest.raises(ProtocolError, match="more than 1 boxes"):
        _reveal(federation, _dispute(federation, tallier="tallier-3", signers=TALLIERS), sealed)


def test_a_verdict_over_a_box_that_opens_names_the_tallier_and_one_that_does_not_the_hospital(federation):
    dispute = _dispute(federation)
    finding = judge(
        _verdict(federation, dispute, _reveal(federation, dispute)), roster=federation.roster, config=CONFIG, run=RUN
    )
    assert finding.named == "tallier-2" and "tallier-2 deviated" in finding.reason
    context = _share_context(RUN, 2, "hospital-1", "tallier-2")
    garbage, secret = seal_revealable(
        b"\xff" * 8 * CONFIG.ballot_layout().values,
        recipient=federation.box_keys["tallier-2"].public_key(),
        sender=federation.identities["hospital-1"].signing,
        context=context,
    )
    bad = _dispute(federation, box=garbage)
    sealed = SealedBallot(2, {**federation.boxes, "tallier-2": garbage}, {**federation.secrets, "tallier-2": secret})
    finding = judge(
        _verdict(federation, bad, _reveal(federation, bad, sealed)), roster=federation.roster, config=CONFIG, run=RUN
    )
    assert finding.named == "hospital-1" and "does not open to a share" in finding.reason


def test_a_verdict_that_proves_nothing_names_no_one(federation):
    """A server cannot pin a secret on the hospital it did not sign, swap the box, or name a tallier on its own word."""
    dispute = _dispute(federation)
    reveal = _reveal(federation, dispute)
    wrong_secret = _verdict(federation, dispute, reveal, ephemeral=federation.secrets["tallier-1"])
    swapped = _verdict(federation, dispute, reveal, box=federation.boxes["tallier-3"])
    unattested = _verdict(federation, dispute, reveal, signatures={"tallier-1": dispute.signatures["tallier-1"]})
    other_key = _verdict(federation, dispute, reveal, tallier_key=federation.certified["tallier-3"])
    for verdict, reason in [
        (wrong_secret, "not hospital-1's"),
        (swapped, "signed the dispute"),
        (unattested, "1 talliers of the run signed"),
        (other_key, "proves nothing"),
    ]:
        with pytest.raises(ProtocolError, match=reason):
            judge(verdict, roster=federation.roster, config=CONFIG, run=RUN)


def test_a_secret_the_hospital_signed_that_is_not_the_box_s_names_the_hospital(federation):
    """A hospital that reveals another box's secret for the disputed one (a dishonest hospital framing the tallier) has
    signed that it is the box's: the verdict names the hospital."""
    dispute = _dispute(federation)
    swapped = {**federation.secrets, "tallier-2": federation.secrets["tallier-1"]}
    reveal = _reveal(federation, dispute, SealedBallot(2, federation.boxes, swapped))
    finding = judge(_verdict(federation, dispute, reveal), roster=federation.roster, config=CONFIG, run=RUN)
    assert finding.named == "hospital-1" and "not the box's" in finding.reason


def test_the_server_names_a_tallier_whose_attested_mark_contradicts_what_it_relayed(federation):
    """A NONE for a box the server verified and relayed to it, an OK or a BAD for a box it did not relay, or a BAD whose
    digest is not the relayed box's; a BAD or an OK of the box it relayed, or a NONE where it relayed none, names no
    one yet."""
    box = federation.boxes["tallier-2"]
    ballots = {"hospital-1": federation.boxes}
    marks = [
        AttestedDispute("hospital-1", "tallier-2", NONE, b"", {}),
        AttestedDispute("hospital-2", "tallier-2", BAD, box_digest(b""), {}),  # a hospital whose ballot was not relayed
        AttestedDispute("hospital-2", "tallier-1", OK, b"", {}),
        AttestedDispute("hospital-1", "tallier-3", BAD, box_digest(box), {}),  # tallier-2's box, claimed by tallier-3
        AttestedDispute("hospital-1", "tallier-2", BAD, box_digest(box), {}),
        AttestedDispute("hospital-1", "tallier-1", OK, b"", {}),
        AttestedDispute("hospital-2", "tallier-2", NONE, b"", {}),
    ]
    assert unrelayed_marks(marks, ballots, 2) == [
        "round 2: tallier-2 said it holds no box from hospital-1, which the server verified and relayed to it: it deviated",
        "round 2: tallier-2 marked a box from hospital-2 that the server did not relay to it: it deviated",
        "round 2: tallier-1 marked a box from hospital-2 that the server did not relay to it: it deviated",
        "round 2: tallier-3 marked BAD a box from hospital-1 that is not the one the server relayed to it: it deviated",
    ]


def test_a_none_mark_is_attested_as_any_dispute_and_a_flood_of_claims_counts_for_nothing(federation):
    key = dispute_key("hospital-1", "tallier-2", NONE)
    signing = federation.identities
    claims = {name: {key: sign_dispute(signing[name].signing, run=RUN, round_number=2, key=key)} for name in TALLIERS}
    (attested,) = attested_disputes(claims, roster=federation.roster, config=CONFIG, run=RUN, round_number=2)
    assert attested.mark == NONE and key.endswith("|none") and dispute_key("h", "t", OK) == "h|t|ok"
    flood = {f"hospital-1|tallier-2|{i:064x}": b"s" * 64 for i in range(10)}  # more than 3 x 3 marks
    flooded = {**claims, "tallier-1": {**claims["tallier-1"], **flood}}
    assert attested_disputes(flooded, roster=federation.roster, config=CONFIG, run=RUN, round_number=2)[
        0
    ].signatures.keys() == {"tallier-2", "tallier-3"}
    for spelling in ["hospital-1|tallier-2|NONE", f"hospital-1|tallier-2|{'AB' * 32}", "hospital-1|tallier-2|ab"]:
        claims = {name: {spelling: b"s" * 64} for name in TALLIERS}
        assert attested_disputes(claims, roster=federation.roster, config=CONFIG, run=RUN, round_number=2) == []
