"""The whole federation as a user runs it: consilium-federation, one OS process per party."""

import json
import tempfile
from pathlib import Path

import msgpack
import pytest
import tenseal as ts
import torch

from conftest import run_launcher
from crypto.sealed_box import open_box
from protocol.hospital import sealed_key_context
from protocol.messages import TO_SERVER, KeySetup, Update, decode
from protocol.roster import Credentials, Roster
from protocol.transcript import read_transcript
from training.accounting import PrivacyLedger
from training.datasets import load_dataset
from training.models import ModelSpec, accuracy, build_model

pytestmark = pytest.mark.slow
ROUNDS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("federation")
    result = run_launcher("federation", "--out", out, "--rounds", ROUNDS, "--round-timeout", "30")
    assert result.returncode == 0, result.stderr
    return out, result


def _transcript(out: Path) -> list[dict]:
    return list(read_transcript(out / "server" / "transcript.msgpack"))


def _decode(record):
    return decode(record["payload"], accept=TO_SERVER, max_bytes=1 << 26)


def test_the_run_prints_a_line_per_round_and_writes_its_report(run):
    out, result = run
    round_lines = [line for line in result.stdout.splitlines() if line.startswith("round ")]
    assert len(round_lines) == ROUNDS and all("val_acc" in line and "epsilon" in line for line in round_lines)
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.png").stat().st_size > 10_000
    final = report["final"]
    assert final["rounds_released"] == ROUNDS and final["delta"] == 1e-5
    epsilon = final["epsilon"]
    assert 0 < epsilon["server"] < epsilon["peer_hospital"] < epsilon["collusion"]
    assert report["mechanism"]["wrap_probability_per_round"] < 1e-8
    assert 0 <= final["validation_accuracy"] <= 1
    assert len(report["rounds"]) == ROUNDS
    assert all(set(r["hospitals"]) == {"hospital-1", "hospital-2", "hospital-3"} for r in report["rounds"])
    assert report["wire"]["update_ratio_to_float32"] <= 3.0
    assert report["phase_seconds"]["hospital_per_round"]["encrypt"] > 0
    assert report["rejected_messages"] == 0 and report["send_offset_overruns"] == 0


def test_each_hospital_ledger_agrees_with_the_server_and_is_on_disk(run):
    out, _ = run
    report = json.loads((out / "report.json").read_text())
    for name in ("hospital-1", "hospital-2", "hospital-3"):
        ledger = PrivacyLedger(out / "federation" / name / "privacy_ledger.jsonl")
        assert ledger.steps == ROUNDS
        for view in ("server", "peer_hospital", "collusion"):
            assert ledger.epsilon(1e-5, view=view) == pytest.approx(report["final"]["epsilon"][view])


def test_the_server_never_receives_the_secret_key(run):
    out, _ = run
    records = _transcript(out)
    assert {r["sender"] for r in records} == {"hospital-1", "hospital-2", "hospital-3"}
    setup = next(m for m in map(_decode, records) if isinstance(m, KeySetup))
    federation = out / "federation"
    roster = Roster.load(federation)
    run_id = json.loads((out / "report.json").read_text())["config"]["run_id"]
    # Open hospital-2's box as hospital-2 would, to learn what must never appear in the clear.
    secret_bytes = open_box(
        setup.sealed_keys["hospital-2"],
        recipient=Credentials.load(federation, "hospital-2").identity.box,
        sender=roster.party("hospital-1").identity.signing,
        context=sealed_key_context(run_id, "hospital-2"),
    )
    secret_context = ts.context_from(secret_bytes)
    assert secret_context.has_secret_key()
    key = secret_context.secret_key().data
    raw_key = b"".join(key.data().data(i).to_bytes(8, "little") for i in range(64))
    with tempfile.TemporaryDirectory() as scratch:
        key.save(f"{scratch}/key")
        serialized_key = Path(f"{scratch}/key").read_bytes()
    received = b"".join(r["payload"] for r in records)
    for secret in (secret_bytes, serialized_key[16:80], raw_key[:64], raw_key[-64:]):
        assert secret not in received
    blobs = [setup.public_context]
    for record in records:
        body = msgpack.unpackb(record["payload"], raw=False)
        blobs += [v for v in body.values() if isinstance(v, bytes)]
    for blob in blobs:
        try:
            context = ts.context_from(blob)
        except Exception:
            continue
        assert not context.has_secret_key()
    # Nor does anything the server wrote hold it.
    for path in (out / "server").iterdir():
        assert raw_key[:64] not in path.read_bytes()


def test_the_server_cannot_decrypt_what_it_received(run):
    out, _ = run
    messages = [_decode(r) for r in _transcript(out)]
    setup = next(m for m in messages if isinstance(m, KeySetup))
    update = next(m for m in messages if isinstance(m, Update))
    server_context = ts.context_from(setup.public_context)
    assert not server_context.has_secret_key()
    with pytest.raises(ValueError, match="secret"):
        ts.bfv_vector_from(server_context, update.chunks[0]).decrypt()


def test_the_saved_model_is_the_one_whose_accuracy_was_reported(run):
    out, _ = run
    report = json.loads((out / "report.json").read_text())
    model = build_model(ModelSpec.from_dict(report["config"]["model"]))
    model.load_state_dict(torch.load(out / "server" / "model.pt"))
    validation = load_dataset("breast_cancer").validation
    assert accuracy(model, validation.x, validation.y) == pytest.approx(report["final"]["validation_accuracy"])
