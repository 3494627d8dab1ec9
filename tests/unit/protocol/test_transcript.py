import pytest

from consilium.protocol.wire.messages import TO_SERVER, Withdraw

from consilium.protocol.wire.codec import encode
from consilium.protocol.wire.transcript import Transcript, TranscriptError, read_messages, read_transcript


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
        ("hospital-1", b"first"),
        ("hospital-2", b"second"),
        ("hospital-3", b"third"),
    ]
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("where", ["a byte that is not msgpack", "a length running past the end"])
def test_damage_before_the_last_record_is_refused_and_nothing_is_cut(tmp_path, where):
    path = tmp_path / "transcript.msgpack"
    transcript = Transcript(path)
    for number in range(50):
        if number == 10:
            boundary = path.stat().st_size  # where the 11th record begins
        transcript.record(f"hospital-{number}", b"message")
    transcript.close()
    damaged = bytearray(path.read_bytes())
    if where == "a byte that is not msgpack":
        damaged[boundary] = 0xC1
    else:
        damaged[boundary : boundary + 5] = b"\xc6\x7f\xff\xff\xff"  # a 2 GiB binary
    path.write_bytes(bytes(damaged))
    with pytest.raises(TranscriptError, match=f"unreadable after byte {boundary}"):
        Transcript(path)
    assert path.read_bytes() == bytes(damaged)


def test_an_auditor_reads_every_kept_message_and_the_bytes_of_those_the_party_refused(tmp_path):
    path = tmp_path / "transcript.msgpack"
    transcript = Transcript(path, payloads=True, max_payload_bytes=100)
    withdraw = Withdraw(round=3, reason="budget spent")
    transcript.record("hospital-1", encode(withdraw))
    transcript.record("hospital-2", b"not a message")
    transcript.record("hospital-3", bytes(101))  # too large to keep: its digest alone
    transcript.close()
    assert list(read_messages(path, accept=TO_SERVER)) == [
        ("hospital-1", withdraw, encode(withdraw)),
        ("hospital-2", None, b"not a message"),
    ]
