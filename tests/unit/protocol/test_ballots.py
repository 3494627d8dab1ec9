"""Sealed vote shares: only the tallier they were sealed to opens them, for that run, round and hospital."""

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from consilium.crypto.checked_shares import CheckedLayout
from consilium.crypto.identity import PrivateIdentity
from consilium.crypto.mpc_field import MpcField
from consilium.crypto.secret_sharing import reconstruct
from consilium.protocol.voting.ballots import BallotError, box_bytes, open_share, seal_ballot

LAYOUT = CheckedLayout(12, -50, 50)
FIELD = MpcField.for_bound(LAYOUT.totals_bound(1))
TALLIERS = ("tallier-1", "tallier-2", "tallier-3")


@pytest.fixture(scope="module")
def ballot():
    keys = {name: X25519PrivateKey.generate() for name in TALLIERS}
    hospital = PrivateIdentity.generate()
    votes = np.random.default_rng().integers(-50, 50, size=12)
    boxes = seal_ballot(
        votes,
        tallier_keys={n: k.public_key() for n, k in keys.items()},
        field=FIELD,
        layout=LAYOUT,
        sender=hospital.signing,
        run="run:abc",
        round_number=3,
        hospital="hospital-1",
    )
    return votes, keys, hospital, boxes


def _open(ballot, tallier="tallier-1", box=None, **changes):
    votes, keys, hospital, boxes = ballot
    settings = dict(
        field=FIELD, values=LAYOUT.values, run="run:abc", round_number=3, hospital="hospital-1", tallier=tallier
    )
    settings.update(changes)
    return open_share(box or boxes[tallier], recipient=keys[tallier], hospital_key=hospital.public.signing, **settings)


def test_the_talliers_shares_add_up_to_the_votes_bits(ballot):
    votes, _, _, boxes = ballot
    assert all(len(box) == box_bytes(LAYOUT.values) for box in boxes.values())
    whole = reconstruct([_open(ballot, name) for name in TALLIERS], FIELD.modulus)
    bits, _, _ = LAYOUT.split(whole)
    assert np.array_equal(LAYOUT.low + bits @ np.array(LAYOUT.weights), votes)


@pytest.mark.parametrize(
    "changes",
    [{"round_number": 4}, {"hospital": "hospital-2"}, {"run": "run:abd"}, {"values": LAYOUT.values + 1}],
    ids=str,
)
def test_a_share_opened_for_another_round_hospital_run_or_length_is_refused(ballot, changes):
    with pytest.raises(BallotError, match="refused"):
        _open(ballot, **changes)


def test_a_box_for_another_tallier_does_not_open(ballot):
    with pytest.raises(BallotError, match="refused"):
        _open(ballot, "tallier-1", box=ballot[3]["tallier-2"])
