"""The whole federation as a user runs it: consilium-federation, one OS process per party."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import party_ledger, run_launcher
from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.key_shares import rebuild
from consilium.crypto.one_time_keys import check_zero_slots, decrypt_sum, public_polynomials, sum_uploads, unpack_ring
from consilium.crypto.sealed_box import SealedBoxError, open_box
from consilium.protocol.run.config import RunConfig
from consilium.protocol.wire.messages import TO_SERVER, Release, Update
from consilium.protocol.secure_round.statement import RoundSetting, box_context, released_from, upload_digest
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.wire.transcript import Transcript, read_messages, read_transcript
from consilium.training.privacy.accounting import VIEWS
from consilium.training.data.datasets import load_dataset
from consilium.training.privacy.ledger import LEDGER_FILE
from consilium.training.models.build import accuracy, build_model
from consilium.training.models.spec import ModelSpec

pytestmark = pytest.mark.slow
ROUNDS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("federation")
    result = run_launcher(
        "federation", "--out", out, "--rounds", ROUNDS, "--round-timeout", "30", "--transcript-payloads"
    )
    assert result.returncode == 0, result.stderr
    return out, result


def test_the_server_s_initial_model_is_the_one_the_seed_draws(run):
    """``--seed`` (0 here) fixes the initial model: the server's is the one a baseline of the same seed starts from."""
    import base64

    from consilium.training.models.build import get_flat_parameters

    out, _ = run
    checkpoint = json.loads((out / "server" / "checkpoint.json").read_text())
    initial = np.frombuffer(base64.b64decode(checkpoint["initial_parameters"]), dtype="<f4")
    spec = ModelSpec.from_dict(checkpoint["config"]["model"])
    state = torch.random.get_rng_state()
    assert np.array_equal(get_flat_parameters(build_model(spec, seed=0)), initial)
    assert not np.array_equal(get_flat_parameters(build_model(spec, seed=1)), initial)
    assert torch.equal(torch.random.get_rng_state(), state)  # a seeded build draws in a fork: nothing else moves


def _transcript(out: Path) -> list[dict]:
    return list(read_transcript(out / "server" / "transcript.msgpack"))


def _messages(out: Path):
    return read_messages(out / "server" / "transcript.msgpack", accept=TO_SERVER)


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
    # The ciphertexts within 1.1x float32, and a key share as large as one ciphertext for each hospital.
    params = RunConfig.from_dict(report["config"]).bfv_parameters()
    shares = len(report["config"]["hospitals"])
    assert report["wire"]["update_ratio_to_float32"] <= 1.1 * (params.chunk_count + shares) / params.chunk_count
    assert report["phase_seconds"]["hospital_per_round"]["encrypt"] > 0
    assert report["rejected_messages"] == 0
    # An overrun depends on the machine's load, not on the code: it must be counted and logged, not absent.
    overruns = sum(h["overran_send_offset"] for r in report["rounds"] for h in r["hospitals"].values())
    warnings = sum(
        log.read_text().count("longer than the send offset") for log in (out / "logs").glob("hospital-*.log")
    )
    assert report["send_offset_overruns"] == overruns == warnings
    # Updates leave a fixed 0.25 s after RoundStart, so the server waits at least that long for them.
    assert all(r["seconds"]["collect"] >= 0.25 for r in report["rounds"])


def test_each_hospital_ledger_agrees_with_the_server_and_is_on_disk(run):
    out, _ = run
    report = json.loads((out / "report.json").read_text())
    for name in ("hospital-1", "hospital-2", "hospital-3"):
        ledger = party_ledger(out / "federation" / name)
        assert ledger.steps == ROUNDS
        for view in VIEWS:
            assert ledger.epsilon(1e-5, view=view) == pytest.approx(report["final"]["epsilon"][view])
        # Every round's endorsement and release were recorded before they left, in round order.
        lines = [json.loads(line) for line in (out / "federation" / name / LEDGER_FILE).read_text().splitlines()]
        steps = [(line["round"], line["step"]) for line in lines if "step" in line]
        assert steps == [(r, step) for r in range(1, ROUNDS + 1) for step in ("endorsed", "released")]


def _round_one(out: Path):
    """What the server received in round 1: every upload and every release, by sender."""
    updates, releases = {}, {}
    for sender, message, _ in _messages(out):
        if isinstance(message, Update) and message.round == 1:
            updates[sender] = message
        elif isinstance(message, Release) and message.round == 1:
            releases[sender] = message
    return updates, releases


def test_the_server_opens_each_sum_and_no_single_upload(run):
    """From everything the server received (every byte, kept in its transcript): the releases rebuild
    the sum's key, which opens the sum, and no upload on its own."""
    out, _ = run
    config = RunConfig.from_dict(json.loads((out / "report.json").read_text())["config"])
    run_id = json.loads((out / "report.json").read_text())["run_fingerprint"]
    public = PublicContext(config.bfv_parameters())
    params, q = public.params, public.params.ciphertext_modulus
    updates, releases = _round_one(out)
    assert set(updates) == set(releases) == set(config.hospitals)
    shares = {
        config.hospitals.index(name) + 1: released_from(public, r.share, r.masks, r.signature).release.share
        for name, r in releases.items()
    }
    key = rebuild(dict(sorted(shares.items())[: config.key_threshold]), config.key_threshold, q)
    a = public_polynomials(params, run=run_id, round_number=1)
    uploads = {name: unpack_ring(public, list(u.chunks), "upload") for name, u in updates.items()}
    data_slots = params.digits.slots_for(params.vector_length)
    check_zero_slots(public, decrypt_sum(public, sum_uploads(public, list(uploads.values())), key, a), data_slots)
    for upload in uploads.values():
        with pytest.raises(BfvError, match="zero slots"):
            check_zero_slots(public, decrypt_sum(public, upload, key, a), data_slots)


def test_a_finished_run_s_key_shares_stay_shut_with_every_long_term_key(run):
    """Forward secrecy: shares were sealed to box keys made for one round, never written down."""
    out, _ = run
    run_id = json.loads((out / "report.json").read_text())["run_fingerprint"]
    config = RunConfig.from_dict(json.loads((out / "report.json").read_text())["config"])
    setting = RoundSetting(
        run_id,
        1,
        config.hospitals,
        threshold=config.key_threshold,
        quorum=config.training.quorum,
        params=config.bfv_parameters(),
    )
    federation = out / "federation"
    roster = Roster.load(federation)
    updates, _ = _round_one(out)
    dealer, update = next(iter(updates.items()))
    assert set(update.boxes) == set(config.hospitals)
    for name, box in update.boxes.items():
        with pytest.raises(SealedBoxError):
            open_box(
                box,
                recipient=Credentials.load(federation / name).identity.box,
                sender=roster.party(dealer).identity.signing,
                context=box_context(setting, dealer, name, upload_digest(list(update.chunks))),
            )


def test_by_default_the_transcript_keeps_digests_in_a_private_file(tmp_path):
    path = tmp_path / "transcript.msgpack"
    transcript = Transcript(path)
    transcript.record("hospital-1", b"ciphertext")
    transcript.close()
    (record,) = read_transcript(path)
    assert "payload" not in record and record["sha256"] == hashlib.sha256(b"ciphertext").digest()
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_full_transcript_keeps_no_oversized_message(tmp_path):
    path = tmp_path / "transcript.msgpack"
    transcript = Transcript(path, payloads=True, max_payload_bytes=10)
    transcript.record("hospital-1", b"0123456789")
    transcript.record("hospital-1", b"0123456789!")
    transcript.close()
    kept, oversized = read_transcript(path)
    assert kept["payload"] == b"0123456789" and "payload" not in oversized and oversized["bytes"] == 11


def test_the_saved_models_are_the_ones_whose_accuracy_was_reported(run):
    out, _ = run
    report = json.loads((out / "report.json").read_text())
    model = build_model(ModelSpec.from_dict(report["config"]["model"]))
    model.load_state_dict(torch.load(out / "server" / "model.pt"))
    validation = load_dataset("breast_cancer").validation
    assert accuracy(model, validation.x, validation.y) == pytest.approx(report["final"]["validation_accuracy"])
    # and the round selected on validation: its model is saved beside, scored as reported
    selected = report["final"]["selected"]
    assert selected["validation_accuracy"] == max(
        r["validation_accuracy"] for r in report["rounds"] if r["status"] == "released"
    )
    model.load_state_dict(torch.load(out / "server" / selected["model"]))
    assert accuracy(model, validation.x, validation.y) == pytest.approx(selected["validation_accuracy"])


def test_the_plaintext_benchmark_round_runs_and_times_every_phase(tmp_path):
    """The round benchmark's baseline: the same federation with the updates in the clear, every phase
    the benchmark reads timed (it failed on a missing one)."""
    result = run_launcher(
        "federation",
        "--out",
        tmp_path / "run",
        "--rounds",
        "2",
        "--round-timeout",
        "30",
        "--insecure-plaintext-benchmark",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["final"]["rounds_released"] == 2
    hospital = report["phase_seconds"]["hospital_per_round"]
    assert all(hospital[phase] is not None for phase in ("train", "encrypt", "decrypt"))
