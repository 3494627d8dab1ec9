"""A tallier's sealed run state: it opens only for its own tallier and run, and keeps the round rule."""

import pytest
import dataclasses
from cryptography.hazmat.primitives import serialization

import msgpack
from consilium.crypto.identity import PrivateIdentity
from consilium.crypto.sealed_box import seal
from consilium.protocol.voting.ballots import tallier_key_context
from consilium.protocol.run.checkpoint import CheckpointError
import numpy as np
from consilium.tallier.run_state import MAX_TALLIES, RUN_STATE_FILE, KeptOutput, RunState, RunStateFile, boxes_digest

RUN = "a" * 64
KEPT = KeptOutput(
    placement=-(2**39) + 7,
    voters=("hospital-1",),
    refused={"hospital-2": "its bits are not bits"},
    totals=np.array([0, 1, 2**63 + 5], dtype=np.uint64),
)


def _same(kept: KeptOutput, other: KeptOutput) -> bool:
    return (kept.placement, kept.voters, kept.refused) == (other.placement, other.voters, other.refused) and (
        np.array_equal(kept.totals, other.totals)
    )


def _raw(state: RunState) -> bytes:
    return state.box_key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def test_the_state_comes_back_whole_and_its_box_key_is_never_on_disk_in_the_clear(tmp_path):
    identity = PrivateIdentity.generate()
    files = RunStateFile(tmp_path, name="tallier-1", identity=identity)
    state = RunState.new(RUN, identity=identity, context=tallier_key_context(RUN, "tallier-1"))
    state = state.tallying(4, boxes_digest({"hospital-1": b"box"})).agreed(("hospital-1",)).keeping(KEPT)
    disputes = {"hospital-1|tallier-2|none": b"s" * 64}  # sent again with the void (a retry, a resumed server)
    state = dataclasses.replace(state, voided=True, disputes=disputes).deviated("a check failed")  # every pin travels
    files.save(state)
    on_disk = (tmp_path / RUN_STATE_FILE).read_bytes()
    assert _raw(state) not in on_disk and (tmp_path / RUN_STATE_FILE).stat().st_mode & 0o777 == 0o600
    loaded = files.load(RUN)
    assert _raw(loaded) == _raw(state) and loaded.certified_key == state.certified_key
    assert (loaded.last_round, loaded.last_boxes, loaded.voters, loaded.tallies) == (
        4,
        state.last_boxes,
        ("hospital-1",),
        1,
    )
    assert loaded.output_begun and loaded.voided and _same(loaded.kept, KEPT) and loaded.disputes == disputes
    assert loaded.deviation == "a check failed" and "after a deviation" in loaded.refusal(5, b"", rounds=9)
    files.delete()
    assert files.load(RUN) is None


def test_a_state_of_another_run_tallier_or_altered_is_not_used(tmp_path):
    identity = PrivateIdentity.generate()
    files = RunStateFile(tmp_path, name="tallier-1", identity=identity)
    files.save(RunState.new(RUN, identity=identity, context=b"context"))
    assert files.load("b" * 64) is None  # another run's
    assert RunStateFile(tmp_path, name="tallier-2", identity=identity).load(RUN) is None  # sealed for another name
    assert RunStateFile(tmp_path, name="tallier-1", identity=PrivateIdentity.generate()).load(RUN) is None
    (tmp_path / RUN_STATE_FILE).chmod(0)  # unreadable (as root: a folder in its place) is an error, never "no state"
    (tmp_path / RUN_STATE_FILE).rename(tmp_path / "kept")
    (tmp_path / RUN_STATE_FILE).mkdir()
    with pytest.raises(CheckpointError, match="cannot read the tallier's run state"):
        files.load(RUN)
    (tmp_path / RUN_STATE_FILE).rmdir()
    (tmp_path / "kept").chmod(0o600)
    (tmp_path / "kept").rename(tmp_path / RUN_STATE_FILE)
    sealed = bytearray((tmp_path / RUN_STATE_FILE).read_bytes())
    sealed[60] ^= 1
    (tmp_path / RUN_STATE_FILE).write_bytes(bytes(sealed))
    assert files.load(RUN) is None


def test_a_round_is_tallied_again_only_with_the_same_boxes_and_never_an_earlier_one():
    state = RunState.new(RUN, identity=PrivateIdentity.generate(), context=b"context")
    first = boxes_digest({"hospital-1": b"one", "hospital-2": b"two"})
    assert state.refusal(1, first, rounds=3) == ""
    state = state.tallying(1, first)
    assert state.refusal(1, boxes_digest({"hospital-2": b"two", "hospital-1": b"one"}), rounds=3) == ""
    assert "other ballots" in state.refusal(1, boxes_digest({"hospital-1": b"one"}), rounds=3)  # one ballot left out
    assert "other ballots" in state.refusal(1, boxes_digest({"hospital-1": b"one", "hospital-2": b"tw0"}), rounds=3)
    state = state.agreed(("hospital-1", "hospital-2"))
    with pytest.raises(ValueError, match="first counted"):  # a rolled-back tallier given one ballot less
        state.tallying(1, first).agreed(("hospital-1",))
    for _ in range(MAX_TALLIES - 1):
        assert state.refusal(1, first, rounds=3) == ""
        state = state.tallying(1, first).agreed(("hospital-1", "hospital-2"))
    assert "after 5 tallies" in state.refusal(1, first, rounds=3)
    state = state.keeping(KEPT)
    assert _same(state.tallying(1, first).kept, KEPT)  # a tally again counts what was kept
    with pytest.raises(ValueError, match="an output the first tally kept otherwise"):
        state.tallying(1, first).keeping(KEPT)
    with pytest.raises(ValueError, match="output was being computed"):  # kept: the output began
        state.void({})
    state = state.tallying(2, first)
    assert state.voters == () and state.tallies == 1 and state.kept is None
    voided = state.void({"hospital-1|tallier-2|none": b"s" * 64})
    assert not state.output_begun and voided.voided  # a new round, nothing computed yet
    assert voided.tallying(2, first).disputes == voided.disputes and voided.tallying(3, first).disputes == {}
    assert "after round 2" in state.refusal(1, first, rounds=3)
    assert "after round 2" in state.refusal(4, first, rounds=3)
    assert boxes_digest({"a": b"bc"}) != boxes_digest({"ab": b"c"})


def test_the_kept_totals_of_the_largest_round_a_run_may_have_load(tmp_path):
    """10^6 votes a round (``VotingConfig``'s most): a restarted tallier comes back with its key and what it kept."""
    identity = PrivateIdentity.generate()
    files = RunStateFile(tmp_path, name="tallier-1", identity=identity)
    kept = dataclasses.replace(KEPT, totals=np.full(10**6, 2**64 - 59, dtype=np.uint64))
    state = RunState.new(RUN, identity=identity, context=b"context").tallying(1, b"d").keeping(kept)
    files.save(state)
    loaded = files.load(RUN)
    assert _raw(loaded) == _raw(state) and _same(loaded.kept, kept)


def test_a_state_an_older_version_wrote_stops_the_tallier_rather_than_start_afresh(tmp_path):
    """Before kept outputs, the file pinned a placement and ``output_begun``: taken for no state, it would give the
    tallier a new box key mid-run and drop its pins (Review 5)."""
    identity = PrivateIdentity.generate()
    files = RunStateFile(tmp_path, name="tallier-1", identity=identity)
    state = RunState.new(RUN, identity=identity, context=b"context")
    older = {
        "box_key": _raw(state),
        "certified_key": state.certified_key,
        "last_round": 2,
        "last_boxes": b"",
        "voters": [],
        "tallies": 1,
        "placement": 12345,
        "output_begun": True,
        "voided": False,
    }
    sealed = seal(
        msgpack.packb(older), recipient=identity.box.public_key(), sender=identity.signing, context=files._context(RUN)
    )
    (tmp_path / RUN_STATE_FILE).write_bytes(sealed)
    with pytest.raises(CheckpointError, match="written by an older Consilium"):
        files.load(RUN)
