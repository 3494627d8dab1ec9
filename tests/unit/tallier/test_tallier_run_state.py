"""A tallier's sealed run state: it opens only for its own tallier and run, and keeps the round rule."""

import pytest
import dataclasses
from cryptography.hazmat.primitives import serialization

from consilium.crypto.identity import PrivateIdentity
from consilium.protocol.voting.ballots import tallier_key_context
from consilium.protocol.run.checkpoint import CheckpointError
from consilium.tallier.run_state import MAX_TALLIES, RUN_STATE_FILE, RunState, RunStateFile, boxes_digest

RUN = "a" * 64


def _raw(state: RunState) -> bytes:
    return state.box_key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def test_the_state_comes_back_whole_and_its_box_key_is_never_on_disk_in_the_clear(tmp_path):
    identity = PrivateIdentity.generate()
    files = RunStateFile(tmp_path, name="tallier-1", identity=identity)
    state = RunState.new(RUN, identity=identity, context=tallier_key_context(RUN, "tallier-1"))
    state = state.tallying(4, boxes_digest({"hospital-1": b"box"})).agreed(("hospital-1",)).placed(2**60 + 7)
    state = dataclasses.replace(state, voided=True)  # both pins travel, whatever their combination
    files.save(state)
    on_disk = (tmp_path / RUN_STATE_FILE).read_bytes()
    assert _raw(state) not in on_disk and (tmp_path / RUN_STATE_FILE).stat().st_mode & 0o777 == 0o600
    loaded = files.load(RUN)
    assert _raw(loaded) == _raw(state) and loaded.certified_key == state.certified_key
    assert (loaded.last_round, loaded.last_boxes, loaded.voters, loaded.tallies, loaded.placement) == (
        4,
        state.last_boxes,
        ("hospital-1",),
        1,
        2**60 + 7,
    )
    assert loaded.output_begun and loaded.voided
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
    state = state.placed(12345)
    assert state.tallying(1, first).placed(12345).placement == 12345
    with pytest.raises(ValueError, match="placing its noise otherwise"):
        state.tallying(1, first).placed(54321)
    with pytest.raises(ValueError, match="output was being computed"):  # placed: the output began
        state.void()
    state = state.tallying(2, first)
    assert state.voters == () and state.tallies == 1 and state.placement == 0
    assert not state.output_begun and state.void().voided  # a new round, nothing computed yet
    assert "after round 2" in state.refusal(1, first, rounds=3)
    assert "after round 2" in state.refusal(4, first, rounds=3)
    assert boxes_digest({"a": b"bc"}) != boxes_digest({"ab": b"c"})
