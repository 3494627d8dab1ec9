"""Private voting as a user runs it: server, hospitals and talliers as real processes, real MPyC over TLS."""

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from conftest import child_environment, free_port, launcher, party_ledger, run_launcher
from consilium.crypto.sealed_box import seal_revealable, verify_certified_key
from consilium.crypto.secret_sharing import to_bytes
from consilium.protocol.voting.ballots import _share_context, box_bytes, share_ballot, tallier_key_context
from consilium.protocol.voting.box_dispute import SealedBallot, reveal_for
from consilium.protocol.voting.round_void import MAX_VOIDS
from consilium.protocol.wire.messages import (
    TO_TALLIER,
    TO_VOTING_HOSPITAL,
    TO_VOTING_SERVER,
    Ballot,
    Dispute,
    Finish,
    Hello,
    Labels,
    Shares,
    VoteRequest,
    VotingWelcome,
)
from consilium.protocol.wire.codec import decode, encode
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import local_federation
from consilium.protocol.wire.transcript import read_transcript
from consilium.protocol.wire.transport import ClientTransport
from consilium.protocol.voting.voting_config import VotingConfig
from relay import Relay
from scripted import wait_for_text
from tally_inputs import ballot_bits, forged_ballot
from consilium.training.privacy.ledger import PrivacyLedger
from consilium.training.voting.vote_privacy import VotingSettings

pytestmark = pytest.mark.slow
SMALL = ("--queries-per-round", "20", "--feature-dimensions", "10", "--student-epochs", "50", "--round-timeout", "60")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vote")
    result = run_launcher("federation", "--method", "knn-dpfl", "--out", out, "--rounds", "2", *SMALL)
    assert result.returncode == 0, result.stderr
    return out, json.loads((out / "report.json").read_text())


def _messages(path, accept):
    return [
        (record["sender"], decode(record["payload"], accept=accept, max_bytes=1 << 26))
        for record in read_transcript(path)
    ]


def test_the_vote_labels_the_queries_and_reports_both_levels(run):
    out, report = run
    final = report["final"]
    assert report["finish_reason"] == "completed all rounds" and final["queries_labelled"] == 40
    assert 0.5 < final["label_accuracy"] <= 1 and final["student_test_accuracy"] > 0.3  # chance: 0.1
    assert (
        0 < final["epsilon"]["record"]["server"] < final["epsilon"]["hospital"]["server"]
    )  # k = 30 votes per hospital
    assert report["reveal"] == "labels" and report["reveal_warning"] == ""
    for name in report["config"]["hospitals"]:
        ledger = party_ledger(out / "federation" / name)
        assert ledger.steps == 2  # charged for both rounds, before its ballots left


def test_the_server_receives_sealed_boxes_and_labels_only(run):
    out, report = run
    received = _messages(out / "server" / "transcript.msgpack", TO_VOTING_SERVER)
    assert {message.TYPE for _, message in received} == {"hello", "run_key", "ballot", "labels"}
    length = box_bytes(VotingConfig.from_dict(report["config"]).ballot_layout().values)
    for _, message in received:
        if isinstance(message, Ballot):
            assert all(len(box) == length for box in message.boxes.values())
        if isinstance(message, Labels):
            assert message.totals == b"" and len(message.labels) == 20


def test_each_tallier_receives_its_own_boxes_and_nothing_else(run):
    out, report = run
    ballots = [
        (sender, m)
        for sender, m in _messages(out / "server" / "transcript.msgpack", TO_VOTING_SERVER)
        if isinstance(m, Ballot)
    ]
    for tallier in report["config"]["talliers"]:
        received = [m for _, m in _messages(out / tallier / "transcript.msgpack", TO_TALLIER)]
        assert {m.TYPE for m in received} == {"voting_welcome", "shares", "finish"}
        shares = [m for m in received if isinstance(m, Shares)]
        assert [m.round for m in shares] == [1, 2]
        for message in shares:
            sealed_to_it = {sender: b.boxes[tallier] for sender, b in ballots if b.round == message.round}
            assert message.boxes == sealed_to_it
        others = {b.boxes[t] for _, b in ballots for t in b.boxes if t != tallier}
        assert not others & {box for m in shares for box in m.boxes.values()}


class _Federation:
    """A provisioned voting federation whose parties the test launches one by one, each logging to a file."""

    def __init__(self, tmp_path, hospitals=3):
        self.tmp = tmp_path
        self.federation = tmp_path / "federation"
        mpc = tuple(f"127.0.0.1:{free_port()}" for _ in range(3))
        self.roster = local_federation(
            self.federation, hospitals=hospitals, address=f"tcp://127.0.0.1:{free_port()}", mpc_addresses=mpc
        )
        self.processes = {}

    def launch(self, role, name, *args):
        return self._start(name, launcher(role, *self._joining(), *args))

    def launch_python(self, code, name, *args):
        """A party whose process runs ``code`` (which patches a role, then runs its launcher) with its flags."""
        return self._start(name, [sys.executable, "-c", code, *map(str, (*self._joining(), *args))])

    def _joining(self):
        return "--federation", self.federation, "--roster-fingerprint", self.roster.fingerprint

    def _start(self, name, command):
        log = self.tmp / f"{name}.log"
        with log.open("w") as handle:
            self.processes[name] = subprocess.Popen(
                command,
                stdout=handle,
                stderr=handle,
                text=True,
                env=child_environment(),
            )
        return self.processes[name]

    def server(self, *args):
        return self.launch(
            "server",
            "server",
            "--method",
            "knn-dpfl",
            "--data",
            "digits",
            "--out",
            self.tmp / "out",
            "--rounds",
            "1",
            *SMALL,
            *args,
        )

    def hospital(self, name, part, *args, code=None):
        """A hospital process, or one that runs ``code`` (``launch_python``) with the same flags."""
        parts = str(len(self.roster.hospitals))
        start = partial(self.launch_python, code) if code else partial(self.launch, "hospital")
        return start(
            name,
            "--name",
            name,
            "--method",
            "knn-dpfl",
            "--data",
            "digits",
            "--parts",
            parts,
            "--part",
            part,
            "--epsilon-budget",
            "100",
            "--timeout",
            "60",
            *args,
        )

    def tallier(self, name, *args):
        return self.launch("tallier", name, "--name", name, "--timeout", "60", *args)

    def log(self, name):
        return (self.tmp / f"{name}.log").read_text()

    def wait_for_log(self, name, text, timeout=60):
        wait_for_text(self.tmp / f"{name}.log", text, self.processes[name], timeout)

    def exit_code(self, name, timeout=120):
        return self.processes[name].wait(timeout=timeout)

    def close(self):
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def federation(tmp_path, request):
    federation = _Federation(tmp_path, hospitals=getattr(request, "param", 3))
    yield federation
    federation.close()


@pytest.mark.parametrize("federation", [4], indirect=True)
def test_a_histogram_run_opens_the_totals_and_keeps_only_the_hospitals_that_accept_it(federation):
    # Two voters with k = 30 give a clean top total of up to 60 (median about 41 on these queries),
    # sigma 15 on it: a threshold of 45 releases about half the labels.
    federation.server(
        "--reveal",
        "histogram",
        "--quorum",
        "2",
        "--label-threshold",
        "45",
        "--transcript",
        federation.tmp / "transcript.msgpack",
    )
    for name in federation.roster.talliers:
        federation.tallier(name, "--allow-histogram")
    federation.hospital("hospital-1", 1, "--allow-histogram")
    federation.hospital("hospital-2", 2, "--allow-histogram")
    federation.hospital("hospital-3", 3)  # labels only, the default
    federation.hospital("hospital-4", 4, "--allow-histogram", "--min-quorum", "3")
    assert federation.exit_code("server") == 0, federation.log("server")
    refusals = {
        "hospital-3": "the run would reveal the noisy histogram; this hospital allows labels only",
        "hospital-4": "the run's quorum of 2 is below this hospital's minimum of 3",
    }
    for name, reason in refusals.items():
        assert (
            federation.exit_code(name) == 2
            and reason in federation.log(name)
            and "Traceback" not in federation.log(name)
        )
    report = json.loads((federation.tmp / "out" / "server_report.json").read_text())
    assert report["reveal"] == "histogram" and "saw the noisy vote totals" in report["reveal_warning"]
    assert report["rounds"][0]["voters"] == ["hospital-1", "hospital-2"]
    assert set(report["departures"]) == set(refusals)
    assert all(report["departures"][name].startswith("withdrew: " + reason) for name, reason in refusals.items())
    labels = [m for _, m in _messages(federation.tmp / "transcript.msgpack", TO_VOTING_SERVER) if isinstance(m, Labels)]
    assert len(labels) == 3  # one per tallier, alike
    totals = np.frombuffer(labels[0].totals, dtype="<i8").reshape(20, 10)
    assert (
        np.array_equal(np.where(totals.max(axis=1) >= 45, totals.argmax(axis=1), 10), labels[0].labels)
        and totals.sum() != 0
    )
    withheld = sum(label == 10 for label in labels[0].labels)
    assert 0 < withheld < 20  # both kinds, but for a chance of about 4e-6
    assert (report["final"]["queries_labelled"], report["final"]["queries_withheld"]) == (20 - withheld, withheld)
    # Every query asked is charged, its label released or not.
    asked = PrivacyLedger()
    asked.begin_run("run", "fingerprint")
    settings = VotingSettings("knn-dpfl", noise_std=15.0, quorum=2, neighbours=30)
    asked.record(
        settings.release(queries=20, classes=10, contributors=2, coalition=1, level="record"),
        run_id="run",
        round_number=1,
    )
    assert report["final"]["epsilon"]["record"]["server"] == pytest.approx(
        asked.epsilons(report["final"]["delta"])["server"]
    )


def test_a_tallier_that_opens_labels_only_stops_a_histogram_run(federation):
    federation.server("--reveal", "histogram")
    for name in federation.roster.hospitals:
        federation.hospital(name, int(name.split("-")[1]), "--allow-histogram")
    federation.tallier("tallier-1", "--allow-histogram")
    federation.tallier("tallier-2")
    federation.tallier("tallier-3", "--allow-histogram")
    assert federation.exit_code("tallier-2") == 2
    assert "this tallier opens labels only" in federation.log("tallier-2") and "Traceback" not in federation.log(
        "tallier-2"
    )
    assert federation.exit_code("server") == 2
    assert "tallier-2 refuses the run: policy: the run would reveal the noisy histogram" in federation.log("server")
    for name in federation.roster.hospitals:  # told, not left waiting for a welcome
        assert federation.exit_code(
            name
        ) == 2 and "the server ended the run: stopped: tallier-2 refuses the run" in federation.log(name)


def test_a_tallier_killed_that_does_not_come_back_stops_the_run_with_no_labels(federation):
    federation.server("--round-timeout", "8")  # the talliers' MPC timeout, with room for the ballots before it
    for index, name in enumerate(federation.roster.hospitals, start=1):
        federation.hospital(name, index)
    federation.tallier("tallier-1", "--mpc-timeout", "4")
    federation.tallier("tallier-2", "--mpc-timeout", "4")
    federation.tallier("tallier-3", "--log-level", "info")
    federation.wait_for_log("tallier-3", "sent its box key")
    federation.processes["tallier-3"].kill()
    assert federation.exit_code("server") == 2
    server_log = federation.log("server")
    assert "tallier-3 did not come back within 16 s" in server_log and "Traceback" not in server_log
    report = json.loads((federation.tmp / "out" / "server_report.json").read_text())
    assert report["final"]["queries_labelled"] == 0 and report["finish_reason"].startswith("stopped:")
    for name in ("tallier-1", "tallier-2"):
        assert federation.exit_code(name) == 0  # told that the run ended
        assert "did not finish within 4 s" in federation.log(name) and "Traceback" not in federation.log(name)
    for name in federation.roster.hospitals:
        assert federation.exit_code(name) == 0


def test_a_server_and_talliers_listening_apart_from_the_roster_s_addresses_complete_a_run(federation):
    """Relays on the roster's ports stand in for a NAT's forwarding (``tests/support/relay.py``): the server and
    the talliers that the MPC dials (every one but the first) listen on ports of their own."""
    server_port = int(federation.roster.server_address.rsplit(":", 1)[1])
    relays, server_own = [], free_port()
    relays.append(Relay(server_port, server_own))
    try:
        federation.server("--listen", f"tcp://127.0.0.1:{server_own}")
        federation.tallier("tallier-1")
        for name in ("tallier-2", "tallier-3"):
            own = free_port()
            relays.append(Relay(federation.roster.party(name).mpc_address[1], own))
            federation.tallier(name, "--listen", f"127.0.0.1:{own}")
        for index, name in enumerate(federation.roster.hospitals, start=1):
            federation.hospital(name, index)
        assert federation.exit_code("server") == 0, federation.log("server")
        for name in (*federation.roster.talliers, *federation.roster.hospitals):
            assert federation.exit_code(name) == 0, federation.log(name)
    finally:
        for relay in relays:
            relay.close()
    report = json.loads((federation.tmp / "out" / "server_report.json").read_text())
    assert report["finish_reason"] == "completed all rounds" and report["final"]["queries_labelled"] > 0
    assert f"server on tcp://127.0.0.1:{server_own} (the roster's" in federation.log("server")


def _charged_rounds(ledger_path):
    """The rounds a ledger charged, in the order it charged them."""
    lines = [json.loads(line) for line in ledger_path.read_text().splitlines()]
    return [line["round"] for line in lines if "key" in line]


def _assert_every_round_labelled_and_charged_once(federation, server_log_name, rounds):
    assert federation.exit_code(server_log_name) == 0, federation.log(server_log_name)
    report = json.loads((federation.tmp / "out" / "server_report.json").read_text())
    assert [r["round"] for r in report["rounds"]] == list(range(1, rounds + 1))
    assert all(r["status"] == "labelled" for r in report["rounds"]), report["rounds"]
    assert report["final"]["queries_labelled"] + report["final"]["queries_withheld"] == 20 * rounds
    for level in ("record", "hospital"):  # the server's ledgers: each round once
        assert _charged_rounds(federation.tmp / "out" / f"privacy_ledger_{level}.jsonl") == list(range(1, rounds + 1))
    for name in federation.roster.hospitals:  # every hospital's: each round once, no query voted on twice
        assert federation.exit_code(name) == 0, federation.log(name)
        assert _charged_rounds(federation.federation / name / "privacy_ledger.jsonl") == list(range(1, rounds + 1))
    return report


def test_a_voting_server_killed_mid_round_resumes_and_tallies_that_round_from_its_sealed_ballots(federation):
    """Killed once round 2's ballots are in, while the talliers are held: the resumed server relays the same
    boxes, no hospital votes again, and every ledger charges each round once."""
    resume_flags = ("--rounds", "4", "--log-level", "info")
    federation.server(*resume_flags)
    for index, name in enumerate(federation.roster.hospitals, start=1):
        federation.hospital(name, index)
    for name in federation.roster.talliers:
        federation.tallier(name, "--mpc-timeout", "30")
    federation.wait_for_log("server", "round    1/4")
    for name in federation.roster.talliers:  # round 2 cannot be tallied before the server goes
        os.kill(federation.processes[name].pid, signal.SIGSTOP)
    federation.wait_for_log("server", "round 2: 3 ballots in")  # logged once they are in the checkpoint
    federation.processes["server"].kill()
    federation.processes["server"].wait()
    for name in federation.roster.talliers:
        os.kill(federation.processes[name].pid, signal.SIGCONT)
    federation.launch(
        "server",
        "server-resumed",
        "--method",
        "knn-dpfl",
        "--data",
        "digits",
        "--out",
        federation.tmp / "out",
        *SMALL,
        *resume_flags,
        "--resume",
    )
    report = _assert_every_round_labelled_and_charged_once(federation, "server-resumed", 4)
    assert "resuming run" in federation.log("server-resumed") and "Traceback" not in federation.log("server-resumed")
    assert report["rounds"][1]["voters"] == list(federation.roster.hospitals)
    for name in (*federation.roster.hospitals, *federation.roster.talliers):
        assert "joining again" in federation.log(name) and "Traceback" not in federation.log(name)
        assert federation.exit_code(name) == 0
    assert not any(
        (federation.federation / name / "tallier_run.sealed").exists() for name in federation.roster.talliers
    )


def test_a_tallier_killed_mid_run_and_started_again_rejoins_with_its_key_and_the_run_ends(federation):
    federation.server("--rounds", "3", "--log-level", "info")
    for index, name in enumerate(federation.roster.hospitals, start=1):
        federation.hospital(name, index)
    for name in federation.roster.talliers:
        federation.tallier(name, "--mpc-timeout", "10")
    federation.wait_for_log("server", "round    1/3")
    federation.processes["tallier-2"].kill()
    federation.processes["tallier-2"].wait()
    federation.launch("tallier", "tallier-2-again", "--name", "tallier-2", "--timeout", "60", "--log-level", "info")
    report = _assert_every_round_labelled_and_charged_once(federation, "server", 3)
    assert "tallier-2 rejoins run" in federation.log("tallier-2-again")
    assert "tallier-2 is back in the run with its box key" in federation.log("server")
    for name in ("tallier-1", "tallier-3", "tallier-2-again"):
        assert federation.exit_code(name) == 0 and "Traceback" not in federation.log(name)
    assert (federation.federation / "tallier-2" / "tallier_run.sealed").exists() is False  # deleted as the run ended
    assert sum(r["tally_attempts"] for r in report["rounds"]) >= 3


class _BadVoter:
    """A hospital that seals each tallier a share of its own making (correctly sealed: only the talliers can tell), and
    reveals a disputed box's secret as an honest hospital does."""

    def __init__(self, federation, name, reveals=True):
        roster = federation.roster
        self.name, self.roster, self.reveals = name, roster, reveals  # reveals: answers a dispute, or not at all
        self.credentials = Credentials.load(federation.federation / name)
        self.transport = ClientTransport(
            roster.server_address, roster.server.curve_public, self.credentials.curve, 1 << 26
        )

    def vote(self, make_shares, sealed_for=lambda round_number, tallier: round_number):
        """``make_shares(config)``: the three share vectors to seal, one per tallier, each for the round
        ``sealed_for`` says."""
        self.transport.send(encode(Hello()))
        welcome = decode(self.transport.receive(60), accept=TO_VOTING_HOSPITAL, max_bytes=1 << 26)
        assert isinstance(welcome, VotingWelcome)
        config = VotingConfig.from_dict(welcome.config)
        run = config.fingerprint(welcome.feature_map)
        keys = {
            t: verify_certified_key(
                welcome.tallier_keys[t],
                signer=self.roster.party(t).identity.signing,
                context=tallier_key_context(run, t),
            )
            for t in config.talliers
        }
        sealed = None
        while True:  # a bad ballot in every round, until the run ends
            request = decode(self.transport.receive(60), accept=TO_VOTING_HOSPITAL, max_bytes=1 << 26)
            if isinstance(request, Finish):
                return
            if isinstance(request, Dispute) and self.reveals:
                signing, settings = self.credentials.identity.signing, dict(roster=self.roster, config=config, run=run)
                self.transport.send(
                    encode(reveal_for(request, sealed, signing=signing, hospital=self.name, **settings))
                )
            if not isinstance(request, VoteRequest):
                continue  # a RoundVoid: its ledger is not this test's concern
            boxes = {
                t: seal_revealable(
                    to_bytes(s),
                    recipient=keys[t],
                    sender=self.credentials.identity.signing,
                    context=_share_context(run, sealed_for(request.round, t), self.name, t),
                )
                for t, s in zip(config.talliers, make_shares(config))
            }
            sealed = SealedBallot(
                request.round, {t: b for t, (b, _) in boxes.items()}, {t: e for t, (_, e) in boxes.items()}
            )
            self.transport.send(encode(Ballot(round=request.round, boxes=sealed.boxes)))

    def close(self):
        self.transport.close()


def _all_for_class_3(config):
    """A ballot's votes, all for class 3, and no noise."""
    layout = config.ballot_layout()
    votes = np.zeros((layout.queries, layout.vote_columns), dtype=np.int64)
    votes[:, 3] = layout.votes_per_query
    return votes, np.zeros(layout.pool_values, dtype=np.int64)


def _outside_the_field(config, talliers=(1, 2)):
    """Valid shares, but those of ``talliers`` (0-based; more than t by default) outside the field."""
    shares = share_ballot(*_all_for_class_3(config), config.ballot_layout(), 3, config.field().modulus)
    for tallier in talliers:
        shares[tallier] = np.full(config.ballot_layout().values, config.field().modulus, dtype=np.uint64)  # outside Z_p
    return shares


def _forged(extra):
    """All its votes for class 3, and ``extra`` more in each class 3 count's lowest "bit" (valid tags)."""

    def make_shares(config):
        layout = config.ballot_layout()
        votes, noise = _all_for_class_3(config)
        bits = ballot_bits(layout, votes, noise, layout.energy_cap)
        bits[0][3 :: layout.vote_columns, 0] += extra
        return forged_ballot(bits, 3, config.field().modulus)

    return make_shares


def _run_with_a_bad_voter(federation, make_shares, *server_args, hospital_args=(), sealed_for=None, reveals=True):
    federation.server(*server_args)
    federation.hospital("hospital-1", 1, *hospital_args)
    federation.hospital("hospital-2", 2, *hospital_args)
    for name in federation.roster.talliers:
        federation.tallier(name)
    bad = _BadVoter(federation, "hospital-3", reveals)
    try:
        bad.vote(make_shares, *([sealed_for] if sealed_for else []))
        assert federation.exit_code("server") == 0, federation.log("server")
    finally:
        bad.close()
    return json.loads((federation.tmp / "out" / "server_report.json").read_text())


def test_a_share_outside_the_field_leaves_its_hospital_out_of_every_tallier_s_count(federation):
    """Its shares to two talliers (t + 1) lie outside the field: it is refused and named, and with a quorum of 2 the
    others' votes are counted."""
    report = _run_with_a_bad_voter(federation, _outside_the_field, "--quorum", "2")
    assert report["finish_reason"] == "completed all rounds"
    assert report["final"]["queries_labelled"] == 20
    assert report["rounds"][0]["voters"] == ["hospital-1", "hospital-2"]
    assert report["rounds"][0]["refused"] == ["hospital-3"] and report["rounds"][0]["disputes"] == []
    assert "share from hospital-3 for round 1 is refused: a share value lies outside the field" in federation.log(
        "tallier-2"
    )


def test_a_box_its_hospital_did_not_seal_for_the_round_is_not_relayed_and_the_hospital_is_expelled_named(federation):
    """hospital-3 seals tallier-2's share for the next round (as a box replayed from another round would be): the
    server verifies every box's signature before it relays any, so the talliers never see it, no tallier can be
    blamed for it, and the round goes on with the two others (a quorum of 2)."""
    report = _run_with_a_bad_voter(
        federation,
        lambda config: share_ballot(*_all_for_class_3(config), config.ballot_layout(), 3, config.field().modulus),
        "--quorum",
        "2",
        "--rounds",
        "2",
        sealed_for=lambda round_number, tallier: round_number + (tallier == "tallier-2"),
    )
    assert report["finish_reason"] == "completed all rounds" and report["final"]["queries_labelled"] == 40
    assert [r["voters"] for r in report["rounds"]] == [["hospital-1", "hospital-2"]] * 2  # out for good
    assert all(r["refused"] == [] for r in report["rounds"])  # no tallier saw its box
    assert report["departures"]["hospital-3"].startswith("round 1: its box to tallier-2 for round 1 is refused")
    assert "hospital-3" in report["expelled"]
    assert all("hospital-3" not in federation.log(name) for name in federation.roster.talliers)


@pytest.mark.parametrize("forge", [_outside_the_field, _forged(200)], ids=["outside-the-field", "not-bits"])
def test_rounds_that_a_refused_ballot_leaves_without_a_quorum_are_void_and_after_the_cap_no_honest_hospital_votes(
    federation, forge
):
    """With a quorum of 3, every round hospital-3 spoils ends for too few voters before anything is computed:
    every tallier signs its void and the honest hospitals' charges are cancelled, for the first MAX_VOIDS
    rounds of the run; in the next the honest hospitals withdraw, so no round that released nothing charges them
    (docs/explanation/void-rounds.md, "After the cap")."""
    report = _run_with_a_bad_voter(federation, forge, "--quorum", "3", "--rounds", str(MAX_VOIDS + 2))
    assert report["final"]["queries_labelled"] == 0
    voided = report["rounds"][:MAX_VOIDS]
    assert all(r["status"] == "aborted" and set(r["void"]) == set(federation.roster.talliers) for r in voided)
    assert "VOID: every tallier signed that it released nothing" in federation.log("server")
    for name in ("hospital-1", "hospital-2"):
        assert federation.exit_code(name) == 0, federation.log(name)
        ledger = party_ledger(federation.federation / name)
        assert ledger.voids(report["config"]["run_id"]) == MAX_VOIDS and ledger.steps == 0, federation.log(name)
        assert f"{MAX_VOIDS} rounds of this run were void, the most a run may cancel" in federation.log(name)
        assert report["departures"][name].startswith(f"withdrew: {MAX_VOIDS} rounds of this run were void")


def test_a_tallier_that_withholds_its_void_is_named_and_the_run_stops(federation):
    """Every round hospital-3 spoils at a quorum of 3 is void, but tallier-1 answers with bytes that are no signature
    for its void: the server, which verifies each void, names tallier-1 and stops the run after that round (which
    stays charged, once), instead of going on with rounds charged and never voided (docs/explanation/void-rounds.md,
    "A tallier that withholds its void")."""
    federation.server("--quorum", "3", "--rounds", "3")
    federation.hospital("hospital-1", 1)
    federation.hospital("hospital-2", 2)
    code = _DEVIATING_TALLIER.format(script=str(_DEVIATING), where="no-void")
    federation.launch_python(code, "tallier-1", "--name", "tallier-1", "--timeout", "60")
    federation.tallier("tallier-2")
    federation.tallier("tallier-3")
    bad = _BadVoter(federation, "hospital-3")
    try:
        bad.vote(_forged(200))
        assert federation.exit_code("server") == 2, federation.log("server")
    finally:
        bad.close()
    report = json.loads((federation.tmp / "out" / "server_report.json").read_text())
    named = "round 1: tallier-2, tallier-3 voided it, and tallier-1 sent no valid void: it withheld it; the run stops"
    assert named in report["finish_reason"] and report["final"]["queries_labelled"] == 0
    for name in ("hospital-1", "hospital-2"):
        ledger = party_ledger(federation.federation / name)
        assert ledger.steps == 1 and ledger.voids(report["config"]["run_id"]) == 0, federation.log(name)
        assert "keeps round 1's charge" not in federation.log(name)  # no RoundVoid came, not even one it refuses
        assert "round 1 released nothing" not in federation.log(name)


def _void_first_round(federation):
    """The report of a run whose first round every tallier voided, once every party has left (each hospital has
    written the void's cancellation by then), and that round's record."""
    assert federation.exit_code("server") == 0, federation.log("server")
    for name in federation.roster.hospitals:  # each has written the void's cancellation when it leaves
        assert federation.exit_code(name) == 0, federation.log(name)
    report = json.loads((federation.tmp / "out" / "server_report.json").read_text())
    first = report["rounds"][0]
    assert first["status"] == "aborted" and set(first["void"]) == set(federation.roster.talliers), first
    assert report["final"]["queries_labelled"] == 0
    return report, first


_NOISE_OVER_ITS_CAP = """
import runpy, sys
sys.path.insert(0, {support!r})
import numpy as np
import consilium.protocol.voting.ballots as ballots
from tally_inputs import ballot_bits, forged_ballot


def over_its_cap(votes, noise, layout, parties, modulus):
    edge = np.full(layout.pool_values, layout.noise_range)  # each value in its range, no slack left
    return forged_ballot(ballot_bits(layout, votes, edge, 0), parties, modulus)


ballots.share_ballot = over_its_cap
sys.argv = ["hospital", *sys.argv[1:]]
runpy.run_module("consilium.scripts.hospital", run_name="__main__")
"""


def test_a_round_in_which_every_ballot_is_refused_releases_nothing_and_charges_no_ledger(federation):
    """Every hospital is a real hospital process whose ballot's noise is over its energy cap (valid bits and tags):
    the talliers refuse and name all three, the round is void, signed by every tallier, and each hospital's charge
    for it is cancelled by that void: nothing released, nothing charged (docs/explanation/void-rounds.md)."""
    federation.server("--quorum", "2")
    code = _NOISE_OVER_ITS_CAP.format(support=str(_DEVIATING.parent))
    for part, name in enumerate(federation.roster.hospitals, start=1):
        federation.hospital(name, part, code=code)
    for name in federation.roster.talliers:
        federation.tallier(name)
    report, first = _void_first_round(federation)
    assert "0 of the 3 voters' ballots pass their checks" in first["reason"], first
    for name in federation.roster.hospitals:  # a void round's refusals are named in its reason
        assert f"{name} (its noise's energy exceeds the cap)" in first["reason"], first
    for name in federation.roster.hospitals:
        ledger = party_ledger(federation.federation / name)
        assert ledger.voids(report["config"]["run_id"]) == 1 and ledger.steps == 0, federation.log(name)


def test_a_round_a_hospital_withdraws_from_below_the_quorum_is_void_and_charges_no_ledger(federation):
    """At the default quorum (every hospital), hospital-3 withdraws for its budget in round 1: the two ballots are
    relayed all the same, the talliers end the round before anything is computed and sign its void, and the two
    hospitals that voted are charged nothing (docs/explanation/void-rounds.md, "Short rounds")."""
    federation.server("--rounds", "2")
    federation.hospital("hospital-1", 1)
    federation.hospital("hospital-2", 2)
    federation.hospital("hospital-3", 3, "--epsilon-budget", "0.001")
    for name in federation.roster.talliers:
        federation.tallier(name)
    report, first = _void_first_round(federation)
    for name in ("hospital-1", "hospital-2"):
        ledger = party_ledger(federation.federation / name)
        assert ledger.voids(report["config"]["run_id"]) == 1 and ledger.steps == 0, federation.log(name)
    assert party_ledger(federation.federation / "hospital-3").steps == 0  # it withdrew before any charge


@pytest.mark.parametrize("extra", [200, 2**40], ids=["plus-200-votes", "beyond-the-comparisons"])
def test_a_hospital_that_adds_votes_beyond_its_range_is_left_out_named_and_the_labels_stay_right(federation, extra):
    """Counted, 200 more votes for class 3 of every query would make every label 3 (label accuracy about 0.1,
    measured before the checks); 2^40 would lie outside the comparisons' range and make them wrong. Refused inside
    the MPC, before any comparison, the hospital is named and the other two hospitals' labels are released.

    Little noise on 100 queries (sigma 3, where the default 15 on 20 queries spreads the label accuracy from about
    0.55 to 1), so that the labels are the two honest hospitals' kNN labels, about 0.9 right, within a few points;
    class 3 everywhere would be 0.1."""
    report = _run_with_a_bad_voter(
        federation,
        _forged(extra),
        "--quorum",
        "2",
        "--vote-noise",
        "3",
        "--queries-per-round",
        "100",
        hospital_args=("--epsilon-budget", "1000000"),
    )
    first = report["rounds"][0]
    assert first["status"] == "labelled" and first["refused"] == ["hospital-3"]
    assert first["voters"] == ["hospital-1", "hospital-2"]
    assert report["final"]["label_accuracy"] >= 0.7
    assert "REFUSED: hospital-3 (its bits are not bits)" in federation.log("server")


def _twice_k_votes(config):
    """All its k votes for class 3 and k more for class 4 in every query: each count within [0, k], valid bits and
    tags, and counts that sum to 2k (AE-DPFL, k = 1: two classes in one query)."""
    layout = config.ballot_layout()
    votes, noise = _all_for_class_3(config)
    votes[:, 4] = layout.votes_per_query
    return forged_ballot(ballot_bits(layout, votes, noise, layout.energy_cap), 3, config.field().modulus)


@pytest.mark.parametrize("method, k", [("knn-dpfl", 30), ("ae-dpfl", 1)])
def test_a_ballot_whose_counts_sum_to_more_than_k_is_refused_named_and_the_round_goes_on(federation, method, k):
    """Votes checked as votes in a whole federation: hospital-3's ballot, 2k votes a query (in AE-DPFL two classes
    in one query), is left out and named with the check it failed, and with a quorum of 2 the other two hospitals'
    labels are released, in every round."""
    report = _run_with_a_bad_voter(
        federation,
        _twice_k_votes,
        *("--method", method, "--quorum", "2", "--rounds", "2"),
        hospital_args=("--method", method, "--epsilon-budget", "1000000"),
    )
    assert report["finish_reason"] == "completed all rounds"
    why = f"its votes are not {k} per query"
    for record in report["rounds"]:
        assert record["status"] == "labelled" and record["voters"] == ["hospital-1", "hospital-2"], record
        assert record["refused"] == ["hospital-3"] and record["refused_because"] == [why]
    assert f"REFUSED: hospital-3 ({why})" in federation.log("server")


_SHIFTING_TALLIER = """
import runpy, sys
import consilium.tallier.tallier as module

honest = module.run_round


def shifted(party, round_number, shares, **settings):
    layout, modulus = settings["layout"], settings["field"].modulus
    votes = layout.parts[0]
    for name, vector in shares.items():  # 200 more for class 3 of every query, in this tallier's share of its bits
        vector = vector.copy()
        for count in range(3, votes.entries, layout.vote_columns):
            vector[count * votes.bits] = (int(vector[count * votes.bits]) + 200) % modulus
        shares[name] = vector
    return honest(party, round_number, shares, **settings)


module.run_round = shifted
sys.argv = ["consilium-tallier", *sys.argv[1:]]
runpy.run_module("consilium.scripts.tallier", run_name="__main__")
"""


# tallier-1 adds 1 to its share of one product before resharing it: the ballot checks' first inner product, or the
# labels' first pair product in a comparison's bitwise step
_DEVIATING = Path(__file__).parents[1] / "support" / "deviating_tallier.py"
_DEVIATING_TALLIER = """
import runpy, sys
sys.argv = [{script!r}, {where!r}, "consilium.scripts.tallier", *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
_TALLIERS = {
    "shifts its input": _SHIFTING_TALLIER,
    "deviates in the ballot checks' arithmetic": _DEVIATING_TALLIER.format(
        script=str(_DEVIATING), where="ballot-check"
    ),
    "deviates in the labels' arithmetic": _DEVIATING_TALLIER.format(script=str(_DEVIATING), where="comparison"),
}


@pytest.mark.parametrize(
    "script, reason",
    [
        ("shifts its input", "fail its tag check: a tallier changed its input"),
        ("deviates in the ballot checks' arithmetic", "the MAC check of the ballot checks' arithmetic failed"),
        ("deviates in the labels' arithmetic", "the MAC check of the labels' arithmetic failed: a tallier deviated"),
    ],
)
def test_a_tallier_that_deviates_is_caught_no_label_is_released_and_the_run_stops(federation, script, reason):
    """tallier-1 shifts its input (the tag check), or reshares a wrong product (the checks' or the labels' MAC
    check); no hospital is refused."""
    federation.server("--rounds", "2")
    for index, name in enumerate(federation.roster.hospitals, start=1):
        federation.hospital(name, index)
    code = _TALLIERS[script]
    federation.launch_python(code, "tallier-1", "--name", "tallier-1", "--timeout", "60")
    federation.tallier("tallier-2")
    federation.tallier("tallier-3")
    assert federation.exit_code("server") == 2, federation.log("server")
    report = json.loads((federation.tmp / "out" / "server_report.json").read_text())
    assert report["final"]["queries_labelled"] == 0 and report["finish_reason"].startswith("stopped:")
    assert reason in report["finish_reason"] and "refused" not in report["finish_reason"]
    assert [(r["round"], r["status"]) for r in report["rounds"]] == [(1, "stopped")]  # the round it stopped in
    assert reason in report["rounds"][0]["reason"] and report["rounds"][0]["voters"] == list(
        federation.roster.hospitals
    )
    assert "the run stops" in federation.log("server") and "Traceback" not in federation.log("server")
    for name in federation.roster.hospitals:  # charged for the round it sent (a deviation voids nothing), no more
        assert party_ledger(federation.federation / name).steps == 1
