"""The voting server's checkpoint: what it saves comes back whole, and nothing else is taken for it."""

import json

import pytest

from consilium.protocol.run.checkpoint import CHECKPOINT_FILE, Checkpoint, CheckpointError, VotingCheckpoint


def _checkpoint(**changes) -> VotingCheckpoint:
    fields = dict(
        config={"run_id": "0123456789abcdef"},
        feature_map=b"\x00\x01map",
        data_digest="ab" * 32,
        order=[2, 0, 1],
        tallier_keys={"tallier-1": b"key-1", "tallier-2": b"key-2"},
        rounds_started=2,
        rounds=[{"round": 1, "status": "labelled"}],
        labelled=[[[2], [7]]],
        active=["hospital-1", "hospital-2"],
        departures={},
        joins=[],
        pending_round=2,
        pending_ballots={"hospital-1": {"tallier-1": b"\xffbox", "tallier-2": b"box"}},
    )
    return VotingCheckpoint(**{**fields, **changes})


def test_a_voting_checkpoint_comes_back_whole_sealed_boxes_included(tmp_path):
    saved = _checkpoint()
    saved.save(tmp_path)
    assert VotingCheckpoint.load(tmp_path) == saved
    assert (tmp_path / CHECKPOINT_FILE).stat().st_mode & 0o777 == 0o600


def test_a_training_checkpoint_or_a_damaged_one_is_refused_in_one_line(tmp_path):
    Checkpoint({}, b"", b"", b"", 0, [], [], {}, []).save(tmp_path)
    with pytest.raises(CheckpointError, match="not a consilium-voting-checkpoint"):
        VotingCheckpoint.load(tmp_path)
    _checkpoint().save(tmp_path)
    record = json.loads((tmp_path / CHECKPOINT_FILE).read_text())
    for damage in ({"pending_ballots": {"hospital-1": {"tallier-1": "not base64!"}}}, {"rounds_started": -1}):
        (tmp_path / CHECKPOINT_FILE).write_text(json.dumps({**record, **damage}))
        with pytest.raises(CheckpointError, match="unreadable"):
            VotingCheckpoint.load(tmp_path)


@pytest.mark.parametrize("kind", [Checkpoint, VotingCheckpoint])
def test_a_checkpoint_of_the_version_before_is_read_with_nobody_expelled_and_an_older_one_is_refused(tmp_path, kind):
    saved = (
        _checkpoint(expelled=["hospital-3"]) if kind is VotingCheckpoint else kind({}, b"", b"", b"", 0, [], [], {}, [])
    )
    saved.save(tmp_path)
    record = json.loads((tmp_path / CHECKPOINT_FILE).read_text())
    version = record["version"]
    del record["expelled"]
    (tmp_path / CHECKPOINT_FILE).write_text(json.dumps({**record, "version": version - 1}))
    assert kind.load(tmp_path).expelled == []
    (tmp_path / CHECKPOINT_FILE).write_text(json.dumps({**record, "version": version - 2}))
    with pytest.raises(CheckpointError, match=f"of version {version}"):
        kind.load(tmp_path)
