import msgpack
import numpy as np
import pytest

from consilium.protocol.wire.messages import (
    PROTOCOL_VERSION,
    TO_HOSPITAL,
    TO_SERVER,
    TO_TALLIER,
    TO_VOTING_HOSPITAL,
    TO_VOTING_SERVER,
    Aggregate,
    Ballot,
    BoxKey,
    Confirmed,
    Endorsement,
    Endorsements,
    Finish,
    Hello,
    Labels,
    MessageError,
    Proof,
    Proofs,
    Refused,
    Release,
    Releases,
    RoundAbort,
    RoundStart,
    RoundVoid,
    RunKey,
    Shares,
    TallyFailed,
    Dispute,
    Reveal,
    Verdict,
    Update,
    VoteRequest,
    VotingWelcome,
    Welcome,
    Withdraw,
    release_digest,
)

from consilium.protocol.wire.codec import decode, encode, float32_values

LIMIT = 1 << 20
SAMPLES = [
    Hello(),
    BoxKey(round=1, certified_key=b"k" * 96),
    Update(round=3, chunks=(b"a", b"b"), boxes={"hospital-2": b"box"}, next_box_key=b"k" * 96),
    Withdraw(round=3, reason="budget"),
    Welcome(
        config={"run_id": "abc", "nested": {"x": [1, 2.5]}},
        initial_parameters=b"\x00" * 8,
        parameters=b"\x01" * 8,
        optimizer_state=b"\x02" * 8,
        next_round=1,
        server_wait_s=480,
    ),
    RunKey(certified_key=b"k" * 96),
    RoundStart(round=1, box_keys={"hospital-1": b"k" * 96}),
    Aggregate(
        round=1,
        contributors=("hospital-1", "hospital-2"),
        chunks=(b"c",),
        digests={"hospital-1": b"d" * 32},
        boxes={"hospital-1": b"b"},
    ),
    Endorsement(round=1, hashes=(1, 2**60), commitment=b"c" * 32, signature=b"s" * 64),
    Endorsements(
        round=1, hashes={"hospital-1": (1, 2)}, commitments={"hospital-1": b"c"}, signatures={"hospital-1": b"s"}
    ),
    Proof(round=1, seed=b"s" * 32, proof=((1, 2), (3, 4)), signature=b"s" * 64),
    Proofs(round=1, seeds={"hospital-1": b"s"}, proofs={"hospital-1": ((1,),)}, signatures={"hospital-1": b"s"}),
    Release(round=1, share=b"z" * 40, masks=(5, 6), signature=b"s" * 64),
    Releases(round=1, shares={"hospital-1": b"z"}, masks={"hospital-1": (5,)}, signatures={"hospital-1": b"s"}),
    Confirmed(round=3, digest=b"d" * 32),
    Refused(round=3, reason="no", named=("server",), openings={"hospital-2": b"k" * 32}),
    RoundAbort(round=1, reason="quorum"),
    Finish(reason="done"),
    VotingWelcome(config={"run_id": "ab"}, feature_map=b"", tallier_keys={"tallier-1": b"k" * 96}),
    VoteRequest(round=1, queries=b"\x00" * 16),
    Ballot(round=1, boxes={"tallier-1": b"b" * 200}),
    Shares(round=1, boxes={"hospital-1": b"b" * 200}),
    Labels(
        round=1,
        voters=("hospital-1",),
        refused=(),
        refused_because=(),
        labels=(3, 0),
        totals=b"",
        mpc_microseconds=10,
        mpc_bytes=5,
    ),
    TallyFailed(
        round=1,
        reason="too few voters",
        tampered=(),
        deviated=False,
        interrupted=False,
        void=b"s" * 64,
        disputes={"hospital-1|tallier-2|" + "ab" * 32: b"s" * 64},
    ),
    RoundVoid(round=1, signatures={"tallier-1": b"s" * 64}),
    Dispute(round=1, tallier="tallier-2", box=b"b" * 200, signatures={"tallier-1": b"s" * 64}),
    Reveal(round=1, tallier="tallier-2", ephemeral=b"e" * 32, signature=b"s" * 64),
    Verdict(
        round=1,
        hospital="hospital-1",
        tallier="tallier-2",
        tallier_key=b"k" * 96,
        box=b"b" * 200,
        signatures={"tallier-1": b"s" * 64},
        ephemeral=b"e" * 32,
        reveal_signature=b"s" * 64,
    ),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: m.TYPE)
def test_every_message_survives_the_wire(message):
    roles = (TO_SERVER, TO_HOSPITAL, TO_VOTING_SERVER, TO_VOTING_HOSPITAL, TO_TALLIER)
    accepting = [accept for accept in roles if type(message) in accept]
    assert accepting
    for accept in accepting:
        assert decode(encode(message), accept=accept, max_bytes=LIMIT) == message


def test_each_role_refuses_the_other_method_s_messages():
    with pytest.raises(MessageError, match="unexpected message type"):
        decode(encode(Ballot(round=1, boxes={})), accept=TO_SERVER, max_bytes=LIMIT)
    with pytest.raises(MessageError, match="unexpected message type"):
        decode(encode(RoundStart(round=1, box_keys={})), accept=TO_TALLIER, max_bytes=LIMIT)


def _raw(**body):
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"\xc1garbage", "not a msgpack"),
        (b"\x92\x01", "not a msgpack"),
        (_raw(v=PROTOCOL_VERSION, type="withdraw", round=1, reason="x") + b"\x00", "not a msgpack"),
        (msgpack.packb([1, 2]), "must be a map"),
        (_raw(v=1, type="hello"), "unsupported protocol version"),
        (_raw(type="hello"), "unsupported protocol version"),
        (_raw(v=PROTOCOL_VERSION, type="launch_missiles"), "unexpected message type"),
        (
            _raw(v=PROTOCOL_VERSION, type="aggregate", round=1, contributors=[], chunks=[], digests={}, boxes={}),
            "unexpected message type",
        ),
        (_raw(v=PROTOCOL_VERSION, type="withdraw", round=1), "expected fields"),
        (_raw(v=PROTOCOL_VERSION, type="withdraw", round=1, reason="x", sender="hospital-2"), "expected fields"),
        (_raw(v=PROTOCOL_VERSION, type="withdraw", round=-1, reason="x"), "non-negative integer"),
        (_raw(v=PROTOCOL_VERSION, type="withdraw", round=True, reason="x"), "non-negative integer"),
        (_raw(v=PROTOCOL_VERSION, type="withdraw", round="1", reason="x"), "non-negative integer"),
        (_raw(v=PROTOCOL_VERSION, type="update", round=1, chunks=b"a", boxes={}, next_box_key=b""), "must be a list"),
        (
            _raw(v=PROTOCOL_VERSION, type="update", round=1, chunks=["text"], boxes={}, next_box_key=b""),
            "must be bytes",
        ),
        (
            _raw(v=PROTOCOL_VERSION, type="update", round=1, chunks=[], boxes={"h": "text"}, next_box_key=b""),
            "must be bytes",
        ),
        (
            _raw(v=PROTOCOL_VERSION, type="endorsement", round=1, hashes=[-1], commitment=b"", signature=b""),
            "non-negative integer",
        ),
        (_raw(v=PROTOCOL_VERSION, type="proof", round=1, seed=b"", proof=[1], signature=b""), "must be a list"),
        (msgpack.packb({1: 2}), "not a msgpack"),
        (_raw(v=PROTOCOL_VERSION, type=["update"]), "unexpected message type"),
        (
            _raw(v=PROTOCOL_VERSION, type="withdraw", round=1, reason="done\nWARNING forged log line"),
            "printable characters",
        ),
        (_raw(v=PROTOCOL_VERSION, type="withdraw", round=1, reason="x" * 501), "printable characters"),
        (
            msgpack.packb({"v": PROTOCOL_VERSION, "type": "hello", b"type": b"x"}, use_bin_type=True),
            "field names must be strings",
        ),
        (_raw(v=True, type="hello"), "unsupported protocol version"),
        (_raw(v=2.0, type="hello"), "unsupported protocol version"),
        (b"\x00" * (LIMIT + 1), "exceeds the limit"),
    ],
)
def test_malformed_messages_are_rejected_with_a_reason(raw, reason):
    with pytest.raises(MessageError, match=reason):
        decode(raw, accept=TO_SERVER, max_bytes=LIMIT)


def test_a_message_of_millions_of_tiny_objects_is_refused_before_they_are_all_made():
    """Nested arrays of empty maps, each within the per-container limits: 16 MiB of them took 1.1 GiB."""
    inner = b"\xdc" + (4000).to_bytes(2, "big") + b"\x80" * 4000
    raw = b"\x81\xa1v" + b"\xdd" + (4000).to_bytes(4, "big") + inner * 4000
    with pytest.raises(MessageError, match="more than 1,048,576 objects"):
        decode(raw, accept=TO_SERVER, max_bytes=len(raw))


@pytest.mark.parametrize("flag", [1, 0, "true", None])
def test_a_boolean_is_only_a_boolean(flag):
    failed = dict(round=1, reason="x", tampered=[], deviated=False, interrupted=flag, void=b"", disputes={})
    with pytest.raises(MessageError, match="must be a boolean"):
        decode(_raw(v=PROTOCOL_VERSION, type="tally_failed", **failed), accept=TO_VOTING_SERVER, max_bytes=LIMIT)


@pytest.mark.parametrize("payload", [b"\x00" * 7, b"\x00" * 12, b"\x00\x00\xc0\x7f" + b"\x00" * 4])
def test_float32_fields_need_the_count_and_finite_values(payload):
    assert float32_values(b"\x00" * 8, 2, "the model").tolist() == [0.0, 0.0]
    with pytest.raises(MessageError, match="the model is not 2 finite float32 values"):
        float32_values(payload, 2, "the model")


def test_our_own_texts_are_made_printable_and_short_before_they_leave():
    sent = Withdraw(round=1, reason="Traceback:\n  line 1\n" * 100)
    received = decode(encode(sent), accept=TO_SERVER, max_bytes=LIMIT)
    assert (
        received.reason.isprintable()
        and len(received.reason) == 500
        and received.reason.startswith("Traceback:   line 1")
    )


def test_release_digest_binds_the_round_and_the_values():
    assert release_digest(1, b"abc") != release_digest(2, b"abc")
    assert release_digest(1, b"abc") != release_digest(1, b"abd")
    assert len(release_digest(1, b"")) == 32


def _random_value(rng, depth=0):
    kind = rng.integers(0, 9 if depth < 3 else 6)
    if kind == 0:
        return int(rng.integers(-(2**40), 2**40)) if rng.random() < 0.5 else bool(rng.integers(0, 2))
    if kind == 1:
        return float(rng.normal())
    if kind == 2:
        return rng.choice(["update", "hello", "v", "type", "round", "chunks", ""])
    if kind == 3:
        return bytes(rng.integers(0, 256, rng.integers(0, 8), dtype=np.uint8))
    if kind == 4:
        return None
    if kind == 5:
        return msgpack.ExtType(int(rng.integers(0, 128)), b"x")
    if kind in (6, 7):
        return [_random_value(rng, depth + 1) for _ in range(rng.integers(0, 4))]
    keys = [_random_value(rng, 3) for _ in range(rng.integers(0, 5))]
    return {k: _random_value(rng, depth + 1) for k in keys if isinstance(k, (str, bytes))}


def test_any_structure_or_byte_string_raises_only_message_error():
    """Generated maps around real message shapes, and random bytes, never raise anything else."""
    rng = np.random.default_rng(11)
    for _ in range(3000):
        body = {
            "v": rng.choice([1, 1, True, 1.0, 2]),
            "type": _random_value(rng)
            if rng.random() < 0.3
            else rng.choice(["update", "key_setup", "released", "hello", "run_key"]),
        }
        body.update(
            {
                rng.choice(
                    ["round", "chunks", "sealed_keys", "digest", "mean_gradient", "reason", "certified_key"]
                ): _random_value(rng)
                for _ in range(rng.integers(0, 4))
            }
        )
        for raw in (
            msgpack.packb(body, use_bin_type=True),
            bytes(rng.integers(0, 256, rng.integers(0, 40), dtype=np.uint8)),
        ):
            try:
                decode(raw, accept=TO_SERVER, max_bytes=LIMIT)
                decode(raw, accept=TO_HOSPITAL, max_bytes=LIMIT)
            except MessageError:
                pass
