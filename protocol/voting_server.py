"""The server of a voting run: asks the hospitals to vote, relays sealed shares, and learns only the labels.

It holds the public pool (unlabeled records; their true labels only to measure the label accuracy
of the run, as a simulation can) and a test split. It never sees a vote, a share or a total: it
relays each tallier only the boxes sealed to it (``protocol.ballots``), and the talliers send back
the labels (``tallier.mpc``).

A run: every hospital and tallier says Hello (all talliers must: the MPC needs each of them);
the talliers get the run's ``VotingWelcome`` and answer with a certified box key, which the
hospitals then get in theirs. A tallier that refuses the run stops it; a hospital that refuses it
(``Withdraw``) leaves it. Per round (``protocol.voting_round``) the server picks ``Q`` queries from the pool, sends them
to the hospitals, and relays the ballots that arrive in time and carry a box of the right length
for each tallier. A round with fewer ballots than the quorum is aborted: nothing is relayed. Every
tallier must answer with the same voters and labels (with a label threshold, ``C`` for a query
whose noisy top total fell short: its record stays unlabelled); the round is then charged to the server's
ledgers, one per level (``training.vote_privacy``), at the number of voters the talliers agreed.
If every tallier reports the same failure (they agreed on fewer voters than the quorum, say after
bad shares), the round is lost and the run goes on; a tallier that fails otherwise, goes silent or
disagrees stops the run. Either way no label of that round is used.

Its transcript keeps whole messages: the boxes in them open only with the talliers' per-run keys,
which never leave the tallier processes' memory.

After the rounds it trains a student on the labelled queries and the rest of the pool
(``training.voting.train_student``) and reports its test accuracy, the labels' accuracy, and epsilon at both levels.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from protocol.channel import PartyChannels
from protocol.config import ConfigError
from protocol.messages import (
    TO_VOTING_SERVER,
    Hello,
    ProtocolError,
    RunKey,
    Shares,
    TallyFailed,
    VoteRequest,
    VotingWelcome,
)
from protocol.party_keys import Credentials
from protocol.roster import Roster
from protocol.transcript import Transcript
from protocol.checkpoint import write_report, write_retrying
from protocol.participants import Participants, Timeouts, run_to_the_end
from protocol.transport import ServerTransport
from protocol.voting_config import VotingConfig
from protocol.voting_round import RoundRecord, collect_ballots, collect_labels
from training.ledger import PrivacyLedger
from training.datasets import Split
from training.models import accuracy
from training.vote_privacy import ACCOUNTANT, LEVELS
from training.voting import train_student

__all__ = ["VotingServer"]

log = logging.getLogger("consilium.voting_server")


class VotingServer:
    def __init__(
        self,
        *,
        config: VotingConfig,
        roster: Roster,
        credentials: Credentials,
        public_pool: Split,
        test: Split,
        feature_map: bytes,
        out_dir: Path,
        student_epochs: int,
        timeouts: Timeouts = Timeouts(),
        transcript: Path | None = None,
        on_round: Callable[[dict], None] | None = None,
    ) -> None:
        roster.check_own_entry(credentials)
        if config.talliers != tuple(roster.talliers):
            raise ConfigError(f"the run's talliers {list(config.talliers)} are not the roster's {roster.talliers}")
        if len(public_pool) < config.rounds * config.queries_per_round:
            raise ConfigError(
                f"{config.rounds} rounds of {config.queries_per_round} queries need {config.rounds * config.queries_per_round} "
                f"public records; the pool has {len(public_pool)}"
            )
        ledgers = {level: out_dir / f"privacy_ledger_{level}.jsonl" for level in LEVELS}
        if any(path.exists() for path in ledgers.values()):
            raise ConfigError(f"{out_dir} already holds a run (its ledgers would mix two runs); choose another --out")
        self._config = config
        self._roster = roster
        self._pool = public_pool
        self._test = test
        self._feature_map = feature_map
        self._out_dir = out_dir
        self._student_epochs = student_epochs
        self._timeouts = timeouts
        self._on_round = on_round or (lambda record: None)
        self._ledgers = {level: PrivacyLedger(path, key=credentials.ledger_key) for level, path in ledgers.items()}
        self._rounds: list[RoundRecord] = []
        self._labelled: list[tuple[np.ndarray, np.ndarray]] = []  # (pool indices, labels) of each labelled round
        self._student: torch.nn.Module | None = None
        self._phase_seconds: dict[str, float] = {}
        limit = config.message_limit()
        parties = list(config.hospitals) + list(config.talliers)
        enrolled = {roster.party(name).curve_public: name for name in parties}
        self._transport = ServerTransport(roster.server_address, credentials.curve, enrolled, limit)
        self._transcript = Transcript(transcript, payloads=True, max_payload_bytes=limit) if transcript else None
        parties = PartyChannels(
            self._transport, accept=TO_VOTING_SERVER, limit=limit, log=log, transcript=self._transcript
        )
        self._participants = Participants(parties, config.hospitals, log)

    @property
    def config(self) -> VotingConfig:
        return self._config

    def run(self) -> dict:
        """Run the vote to its end; returns (and writes) the server's report."""
        return run_to_the_end(
            self._run_all,
            finish=lambda reason: self._participants.finish(reason, others=self._config.talliers),
            report=self._report,
            write_outputs=self._write_outputs,
            close=self._close,
        )

    def _run_all(self) -> str:
        """Join, then the rounds; returns why the run ended."""
        started = time.perf_counter()
        self._join()
        self._phase_seconds["join"] = time.perf_counter() - started
        order = np.random.default_rng().permutation(
            len(self._pool)
        )  # the queries are public: no secret randomness needed
        quorum, q = self._config.voting.quorum, self._config.queries_per_round
        finish_reason = "completed all rounds"
        for round_number in range(1, self._config.rounds + 1):
            if len(self._participants.active) < quorum:
                finish_reason = (
                    f"only {len(self._participants.active)} hospitals remain, fewer than the quorum of {quorum}"
                )
                break
            self._run_round(round_number, order[(round_number - 1) * q : round_number * q])
        started = time.perf_counter()
        student = self._train_student()
        self._phase_seconds["student"] = time.perf_counter() - started
        self._student = student
        return finish_reason

    # -- phases ---------------------------------------------------------------------------------

    def _join(self) -> None:
        config = self._config
        deadline = time.monotonic() + self._timeouts.join_s
        joined: list[str] = []
        expected = set(config.hospitals) | set(config.talliers)
        while set(joined) != expected and (got := self._participants.parties.next_message(deadline)) is not None:
            sender, message = got
            if not isinstance(message, Hello) or sender in joined:
                self._participants.parties.reject(sender, message, "expected one hello")
            else:
                joined.append(sender)
        missing_talliers = sorted(set(config.talliers) - set(joined))
        if missing_talliers:
            raise ProtocolError(
                f"the talliers {missing_talliers} did not join within {self._timeouts.join_s:g} s; the MPC needs every one"
            )
        hospitals = tuple(h for h in config.hospitals if h in joined)
        if len(hospitals) < config.voting.quorum:
            raise ProtocolError(
                f"only {len(hospitals)} of {len(config.hospitals)} hospitals joined; the quorum is {config.voting.quorum}"
            )
        self._config = dataclasses.replace(config, hospitals=hospitals)
        self._participants.active = list(hospitals)  # from here on each is told when the run ends, however it ends
        self._run = self._config.fingerprint(self._feature_map)
        for ledger in self._ledgers.values():
            ledger.begin_run(self._config.run_id, self._run)
        welcome = dict(config=self._config.to_dict(), feature_map=self._feature_map)
        for name in self._config.talliers:
            self._participants.parties.send(name, VotingWelcome(**welcome, tallier_keys={}))
        keys: dict[str, bytes] = {}
        deadline = time.monotonic() + self._timeouts.key_s
        while (
            set(keys) != set(self._config.talliers)
            and (got := self._participants.parties.next_message(deadline)) is not None
        ):
            sender, message = got
            if isinstance(message, TallyFailed) and sender in self._config.talliers and message.round == 0:
                raise ProtocolError(f"{sender} refuses the run: {message.reason}")
            if not isinstance(message, RunKey) or sender not in self._config.talliers or sender in keys:
                self._participants.parties.reject(sender, message, "expected a tallier's box key")
            else:
                keys[sender] = message.certified_key  # the hospitals check it against the tallier's identity
        if set(keys) != set(self._config.talliers):
            raise ProtocolError(
                f"the talliers {sorted(set(self._config.talliers) - set(keys))} sent no box key in time"
            )
        for name in hospitals:
            self._participants.parties.send(name, VotingWelcome(**welcome, tallier_keys=keys))

    def _run_round(self, round_number: int, indices: np.ndarray) -> None:
        record = RoundRecord(round=round_number, status="aborted")
        started = time.perf_counter()
        queries = np.ascontiguousarray(self._pool.x[indices], dtype="<f4").tobytes()
        for name in self._participants.active:
            self._participants.parties.send(name, VoteRequest(round=round_number, queries=queries))
        ballots = collect_ballots(
            self._participants,
            round_number,
            self._config.talliers,
            self._config.ballot_layout().values,
            self._timeouts.round_s,
        )
        record.seconds["ballots"] = time.perf_counter() - started
        record.voters = sorted(ballots, key=self._config.hospitals.index)
        if len(ballots) < self._config.voting.quorum:
            self._abort(record, f"{len(ballots)} ballots, fewer than the quorum of {self._config.voting.quorum}")
            return
        started = time.perf_counter()
        for tallier in self._config.talliers:
            self._participants.parties.send(
                tallier, Shares(round=round_number, boxes={voter: boxes[tallier] for voter, boxes in ballots.items()})
            )
        labels = collect_labels(self._participants, self._config, record, self._timeouts.round_s)
        record.seconds["tally"] = time.perf_counter() - started
        if labels is None:
            self._abort(record, record.reason)
            return
        if set(record.voters) - set(ballots) or len(record.voters) < self._config.voting.quorum:
            raise ProtocolError(
                f"round {round_number}: the talliers counted voters {record.voters}, not a quorum of those relayed"
            )
        if set(record.refused) - set(ballots) or set(record.refused) & set(record.voters):
            raise ProtocolError(
                f"round {round_number}: the talliers refused {record.refused}, not ballots they left out"
            )
        for level, ledger in self._ledgers.items():
            release = self._config.voting.release(
                queries=len(indices), classes=self._config.classes, contributors=len(record.voters), level=level
            )
            ledger.record(release, run_id=self._config.run_id, round_number=round_number)
            record.epsilon[level] = ledger.epsilons(self._config.delta)
        released = labels < self._config.classes
        self._labelled.append((indices[released], labels[released]))
        record.labels_withheld = int(np.sum(~released))
        record.label_accuracy = (
            float(np.mean(labels[released] == self._pool.y[indices[released]])) if released.any() else None
        )
        record.status = "labelled"
        self._finish_round(record)

    def _train_student(self) -> torch.nn.Module | None:
        if not any(len(indices) for indices, _ in self._labelled):  # no round, or every label withheld
            return None
        indices = np.concatenate([indices for indices, _ in self._labelled])
        labels = np.concatenate([labels for _, labels in self._labelled])
        unlabelled = np.setdiff1d(np.arange(len(self._pool)), indices)
        return train_student(
            self._config.model,
            Split(self._pool.x[indices], labels),
            self._pool.x[unlabelled],
            epochs=self._student_epochs,
        )

    # -- helpers --------------------------------------------------------------------------------

    def _abort(self, record: RoundRecord, reason: str) -> None:
        record.reason = reason
        log.warning("round %d aborted: %s; no share is relayed", record.round, reason)
        self._finish_round(record)

    def _finish_round(self, record: RoundRecord) -> None:
        self._rounds.append(record)
        self._on_round(dataclasses.asdict(record))

    def _report(self, finish_reason: str) -> dict:
        student = self._student
        labelled = [r for r in self._rounds if r.status == "labelled"]
        queries = sum(len(indices) for indices, _ in self._labelled)
        asked = queries + sum(r.labels_withheld for r in labelled)
        correct = sum(int(np.sum(labels == self._pool.y[indices])) for indices, labels in self._labelled)
        mpc_seconds = sum(r.mpc_seconds for r in labelled)
        config = self._config
        layout = config.ballot_layout()
        return {
            "method": config.voting.method,
            "config": config.to_dict(),
            "field": dataclasses.asdict(config.field()),
            "ballot_range": [layout.low, layout.high],
            "totals_bound": config.totals_bound(),
            "finish_reason": finish_reason,
            "run_fingerprint": getattr(self, "_run", ""),
            "reveal": config.reveal,
            "reveal_warning": (
                "histogram mode: the server and every tallier saw the noisy vote totals, not only the labels"
                if config.reveal == "histogram"
                else ""
            ),
            "rounds": [dataclasses.asdict(r) for r in self._rounds],
            "final": {
                "rounds_labelled": len(labelled),
                "queries_labelled": queries,
                "queries_withheld": asked - queries,
                "label_accuracy": correct / queries if queries else None,
                "student_test_accuracy": accuracy(student, self._test.x, self._test.y) if student is not None else None,
                "epsilon": {level: ledger.epsilons(config.delta) for level, ledger in self._ledgers.items()},
                "delta": config.delta,
                "accountant": ACCOUNTANT,
                "mpc_seconds_per_query": mpc_seconds / asked if asked else None,
            },
            "phase_seconds": self._phase_seconds,
            "rejected_messages": self._participants.parties.rejections.total,
            "departures": self._participants.departures,
            "connection_limits": self._transport.limits,
            "bytes_received": dict(self._transport.bytes_received),
            "bytes_sent": dict(self._transport.bytes_sent),
        }

    def _write_outputs(self, report: dict) -> None:
        write_retrying(lambda: write_report(self._out_dir, report), "the server's report")

    def _close(self) -> None:
        self._transport.close()
        if self._transcript:
            self._transcript.close()
