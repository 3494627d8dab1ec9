"""Step 1's rules: from every tallier's opened marks, who votes, who is refused and named, which box is disputed, and
when the round is void. (Between real talliers: tests/end_to_end/test_box_disputes.py.)"""

import pytest

from consilium.protocol.voting.ballots import BAD, NONE, OK
from consilium.tallier.authenticated import DeviationError
from consilium.tallier.voter_marks import DIGEST_BYTES, MARKS, DisputeError, VoterError, decide, marks_input

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
def test_a_box_t_talliers_mark_bad_voids_the_round_and_every_mark_of_it_is_disputed(third):
    """Every mark of it, OK and NONE too: the server names a tallier whose mark contradicts what it relayed."""
    with pytest.raises(
        DisputeError, match=f"hospital-3's box: tallier-1 OK, tallier-2 BAD, tallier-3 {MARKS[third]}"
    ) as caught:
        _decide(_rows((OK, OK, OK), (OK, OK, BAD), (OK, OK, third)))
    zeros = bytes(DIGEST_BYTES)
    assert caught.value.disputes == (
        ("hospital-3", "tallier-1", OK, zeros),
        ("hospital-3", "tallier-2", BAD, DIGEST),
        ("hospital-3", "tallier-3", third, zeros),
    )
    assert isinstance(caught.value, VoterError)  # void: before any output


@pytest.mark.parametrize("marks", [(NONE, OK, OK), (OK, NONE, NONE)], ids=["one-none", "one-ok"])
def test_a_tallier_whose_mark_of_a_box_differs_from_the_others_voids_the_round_and_every_mark_is_disputed(marks):
    """It cannot leave an honest hospital out of the count (one NONE), nor void the round unnamed by an OK of a box
    that was not relayed: the server, which knows what it relayed, names whoever contradicts it."""
    rows = _rows(*[(mark, OK, OK) for mark in marks])
    with pytest.raises(DisputeError, match="the talliers' marks differ") as caught:
        _decide(rows)
    assert [(h, t, m) for h, t, m, _ in caught.value.disputes] == [
        ("hospital-1", t, m) for t, m in zip(TALLIERS, marks)
    ]


def test_a_mark_that_is_no_mark_names_its_tallier_and_talliers_in_other_rounds_stop_the_run():
    rows = _rows((OK, OK, OK), (OK, OK, OK), (OK, OK, OK))
    rows[2][1] = 3
    with pytest.raises(DeviationError, match="tallier-3 marked hospital-1's box with what is no mark"):
        _decide(rows)
    rows = _rows((OK, OK, OK), (OK, OK, OK)) + _rows((OK, OK, OK), round_number=5)
    with pytest.raises(DeviationError, match="not all in round 4"):  # never a void, which one tallier could force
        _decide(rows)


def test_fewer_voters_than_the_quorum_void_the_round_naming_the_refused():
    with pytest.raises(VoterError, match="from 2 hospitals, fewer than the quorum of 3; hospital-3 refused"):
        _decide(_rows((OK, OK, BAD), (OK, OK, BAD), (OK, OK, BAD)), quorum=3)
