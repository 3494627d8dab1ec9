"""Sealed ballots: votes and noise in checked shares that only the tallier they were sealed to opens, for that run,
round and hospital; a ballot whose votes are not votes, or whose noise misses its bounds, is not sealed."""

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from consilium.crypto.identity import PrivateIdentity
from consilium.protocol.voting.ballots import (
    BAD,
    NONE,
    OK,
    BallotError,
    BallotLayout,
    _share_context,
    box_bytes,
    mark_box,
    revealed_share,
    seal_ballot,
    share_ballot,
    verify_ballot,
)
from consilium.crypto.sealed_box import seal_revealable
from consilium.crypto.secret_sharing import ShareError, reconstruct
from consilium.crypto.mpc_field import MpcField

LAYOUT = BallotLayout(queries=4, classes=3, votes_per_query=5, abstains=False, noise_range=50, energy_cap=10_000)
FIELD = MpcField.for_bound(LAYOUT.totals_bound(1))
TALLIERS = ("tallier-1", "tallier-2", "tallier-3")


@pytest.fixture(scope="module")
def ballot():
    keys = {name: X25519PrivateKey.generate() for name in TALLIERS}
    hospital = PrivateIdentity.generate()
    generator = np.random.default_rng()
    votes = generator.multinomial(5, [0.2, 0.3, 0.5], size=4)
    noise = generator.integers(-28, 29, size=12)
    boxes, secrets = seal_ballot(
        votes,
        noise,
        tallier_keys={n: k.public_key() for n, k in keys.items()},
        field=FIELD,
        layout=LAYOUT,
        sender=hospital.signing,
        run="run:abc",
        round_number=3,
        hospital="hospital-1",
    )
    return (votes, noise), keys, hospital, boxes, secrets


SETTINGS = dict(field=FIELD, values=LAYOUT.values, run="run:abc", round_number=3, hospital="hospital-1")


def _mark(ballot, tallier="tallier-1", box=None, **changes):
    _, keys, hospital, boxes, _ = ballot
    settings = {**SETTINGS, "tallier": tallier, **changes}
    return mark_box(box or boxes[tallier], recipient=keys[tallier], hospital_key=hospital.public.signing, **settings)


def _open(ballot, tallier="tallier-1"):
    marked = _mark(ballot, tallier)
    assert marked.mark == OK, marked.reason
    return marked.share


def test_the_talliers_shares_add_up_to_the_votes_the_noise_and_the_slack_in_bits(ballot):
    (votes, noise), _, _, boxes, _ = ballot
    assert all(len(box) == box_bytes(LAYOUT.values) for box in boxes.values())
    whole = reconstruct([_open(ballot, name) for name in TALLIERS], FIELD.modulus)
    rebuilt = [
        part.low + bits @ np.array(part.weights) for part, (bits, _, _) in zip(LAYOUT.parts, LAYOUT.split(whole))
    ]
    assert np.array_equal(rebuilt[0], votes.reshape(-1)) and np.array_equal(rebuilt[1], noise)
    assert rebuilt[2][0] == LAYOUT.energy_cap - noise @ noise


@pytest.mark.parametrize(
    "votes, noise, reason",
    [
        ([[5, 0, 0], [0, 5, 0], [1, 1, 1], [0, 0, 5]], np.zeros(12), "5 to a row"),  # a query of 3 votes
        ([[6, -1, 0]] * 4, np.zeros(12), "outside \\[0, 5\\]"),
        ([[5, 0, 0]] * 4, np.eye(1, 12, 4)[0] * 51, "outside \\[-50, 50\\]"),
        ([[5, 0, 0]] * 4, np.full(12, 30), "energy exceeds its cap of 10000"),  # 12 x 900
    ],
)
def test_votes_that_are_not_votes_or_noise_beyond_its_bounds_are_not_shared(votes, noise, reason):
    with pytest.raises(ShareError, match=reason):
        share_ballot(np.array(votes), noise.astype(np.int64), LAYOUT, 3, FIELD.modulus)


def test_an_abstaining_ballot_carries_no_class_in_a_last_column():
    layout = BallotLayout(queries=2, classes=3, votes_per_query=1, abstains=True, noise_range=5, energy_cap=100)
    assert layout.with_abstentions(np.array([[0, 1, 0], [0, 0, 0]])).tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]
    assert layout.parts[0].entries == 8 and layout.parts[1].entries == 6


@pytest.mark.parametrize("changes", [{"round_number": 4}, {"hospital": "hospital-2"}, {"run": "run:abd"}], ids=str)
def test_a_box_marked_for_another_round_hospital_or_run_is_marked_none_not_its_hospital_s(ballot, changes):
    marked = _mark(ballot, **changes)
    assert marked.mark == NONE and marked.share is None and "is not its" in marked.reason


def test_a_box_for_another_tallier_is_marked_none(ballot):
    assert _mark(ballot, "tallier-1", box=ballot[3]["tallier-2"]).mark == NONE


def test_a_box_its_hospital_signed_that_holds_no_share_is_marked_bad_and_its_secret_shows_it(ballot):
    """Only the hospital could have made it: it verifies, and does not open to a share (another length, or a value
    outside the field); its revealed secret opens it to the same failure, and a good box's to a share."""
    _, keys, hospital, boxes, secrets = ballot
    assert _mark(ballot, values=LAYOUT.values + 1).mark == BAD  # read as another length
    context = _share_context("run:abc", 3, "hospital-1", "tallier-2")
    garbage, secret = seal_revealable(
        b"\xff" * 8 * LAYOUT.values, recipient=keys["tallier-2"].public_key(), sender=hospital.signing, context=context
    )
    marked = _mark(ballot, "tallier-2", box=garbage)
    assert marked.mark == BAD and "outside the field" in marked.reason
    shown = dict(hospital_key=hospital.public.signing, tallier="tallier-2", **SETTINGS)
    key = keys["tallier-2"].public_key()
    assert "outside the field" in revealed_share(garbage, ephemeral=secret, tallier_key=key, **shown)
    assert revealed_share(boxes["tallier-2"], ephemeral=secrets["tallier-2"], tallier_key=key, **shown) == ""
    assert "not the box's" in revealed_share(boxes["tallier-2"], ephemeral=secret, tallier_key=key, **shown)
    with pytest.raises(BallotError, match="not one hospital-1 sealed to tallier-2"):
        revealed_share(boxes["tallier-1"], ephemeral=secrets["tallier-1"], tallier_key=key, **shown)


def _verify(ballot, boxes=None, **changes):
    _, keys, hospital, sealed, _ = ballot
    settings = dict(run="run:abc", round_number=3, hospital="hospital-1", hospital_key=hospital.public.signing)
    settings.update(changes)
    verify_ballot(boxes or sealed, tallier_keys={n: k.public_key() for n, k in keys.items()}, **settings)


@pytest.mark.parametrize(
    "changes",
    [
        {"round_number": 4},
        {"hospital": "hospital-2"},
        {"run": "run:abd"},
        {"hospital_key": PrivateIdentity.generate().public.signing},
    ],
    ids=["round", "hospital", "run", "signer"],
)
def test_a_relay_verifies_a_ballot_only_for_its_hospital_run_and_round(ballot, changes):
    _verify(ballot)  # what the server checks before it relays a ballot
    with pytest.raises(BallotError, match="its box to tallier-1 for round .* is refused"):
        _verify(ballot, **changes)


def test_a_relay_refuses_boxes_swapped_between_talliers(ballot):
    boxes = ballot[3]
    with pytest.raises(BallotError, match="its box to tallier-1 .* is refused"):
        _verify(ballot, boxes={**boxes, "tallier-1": boxes["tallier-2"], "tallier-2": boxes["tallier-1"]})
