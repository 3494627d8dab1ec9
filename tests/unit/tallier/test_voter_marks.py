"""Step 1's rules: from every tallier's opened marks, who votes, who is refused and named, which box is disputed, and
when the round is void. (Between real talliers: tests/end_to_end/test_box_disputes.py.)"""

import pytest

from consilium.protocol.voting.ballots import BAD, NONE, OK
from consilium.tallier.authenticated import DeviationError
from consilium.tallier.voter_marks import DIGEST_BYTES, DisputeError, VoterError, decide, marks_input

HOSPITALS = ("hospital-1", "hospital-2", "hospital-3")
TALLIERS = ("tallier-1", "tallier-2", "tallier-3")
DIGEST = bytes(range(DIGEST_BYTES))


def _rows(*marks_by_tallier, round_number=4):
    """Each tallier's input from its marks of the three hospitals' boxes (a BAD one with ``DIGEST``)."""
    rows = []
    for marks in marks_by_tallier:
        shares = {h for h, mark in zip(HOSPITALS, marks) if mark == OK}
        bad = {h: DIGEST for h, mark in zip(HOSPITALS, marks) if mark == BAD}
        rows.append(marks_input(round_number, HOSPITALS, shares, bad))
    return rows


def _decide(rows, quorum=2):
    return decide(rows, round_number=4, hospitals=HOSPITALS, talliers=TALLIERS, quorum=quorum)


def test_the_voters_are_the_hospitals_every_tallier_holds_a_share_from_and_none_is_no_voter():
    agreed = _decide(_rows((OK, OK, NONE), (OK, OK, NONE), (OK, OK, NONE)))
    assert agreed.voters == ("hospital-1", "hospital-2") and agreed.refused == {}


def test_a_box_more_than_t_talliers_mark_bad_refuses_its_hospital_named_and_the_round_goes_on():
    agreed = _decide(_rows((OK, OK, BAD), (OK, OK, BAD), (OK, OK, OK)))
    assert agreed.voters == ("hospital-1", "hospital-2")
    assert agreed.refused == {"hospital-3": "its boxes to tallier-1, tallier-2 do not open to a share"}


@pytest.mark.parametrize("third", [OK, NONE], ids=["beside-ok", "beside-none"])
def test_a_box_t_talliers_mark_bad_voids_the_round_and_is_disputed_with_its_digest(third):
    with pytest.raises(DisputeError, match="tallier-2 marked hospital-3's box BAD") as caught:
        _decide(_rows((OK, OK, OK), (OK, OK, BAD), (OK, OK, third)))
    nones = (("hospital-3", "tallier-3", None),) if third == NONE else ()  # disputed too: the server names it
    assert caught.value.disputes == (("hospital-3", "tallier-2", DIGEST), *nones)
    assert isinstance(caught.value, VoterError)  # void: before any output


def test_a_tallier_that_says_it_holds_no_box_beside_others_that_hold_it_voids_the_round_and_is_disputed():
    """It cannot leave an honest hospital out of the count: the round is void, and its NONE is disputed (the server,
    which relayed the box, names it)."""
    with pytest.raises(DisputeError, match="tallier-2 says it holds no box from hospital-1") as caught:
        _decide(_rows((OK, OK, OK), (NONE, OK, OK), (OK, OK, OK)))
    assert caught.value.disputes == (("hospital-1", "tallier-2", None),)


def test_a_mark_that_is_no_mark_names_its_tallier_and_talliers_in_other_rounds_void_it():
    rows = _rows((OK, OK, OK), (OK, OK, OK), (OK, OK, OK))
    rows[2][1] = 3
    with pytest.raises(DeviationError, match="tallier-3 marked hospital-1's box with what is no mark"):
        _decide(rows)
    rows = _rows((OK, OK, OK), (OK, OK, OK)) + _rows((OK, OK, OK), round_number=5)
    with pytest.raises(VoterError, match="not all in round 4"):
        _decide(rows)


def test_fewer_voters_than_the_quorum_void_the_round_naming_the_refused():
    with pytest.raises(VoterError, match="from 2 hospitals, fewer than the quorum of 3; hospital-3 refused"):
        _decide(_rows((OK, OK, BAD), (OK, OK, BAD), (OK, OK, BAD)), quorum=3)
