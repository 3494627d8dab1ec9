from protocol.transcript import Transcript, read_transcript


def test_a_record_cut_short_by_a_kill_is_dropped_when_the_transcript_is_reopened(tmp_path):
    path = tmp_path / "transcript.msgpack"
    transcript = Transcript(path, payloads=True)
    transcript.record("hospital-1", b"first")
    transcript.record("hospital-2", b"second")
    transcript.close()
    whole = path.read_bytes()
    path.write_bytes(whole + whole[len(whole) // 2 :][:20])  # a third record, cut short
    resumed = Transcript(path, payloads=True)
    resumed.record("hospital-3", b"third")
    resumed.close()
    assert [(r["sender"], r["payload"]) for r in read_transcript(path)] == [
        ("hospital-1", b"first"), ("hospital-2", b"second"), ("hospital-3", b"third"),
    ]  # fmt: skip
    assert path.stat().st_mode & 0o777 == 0o600
