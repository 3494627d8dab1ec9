"""The server of a voting run: asks the hospitals to vote, relays sealed shares, and learns only the labels.

It holds the public pool (unlabeled records; their true labels only to measure the label accuracy
of the run, as a simulation can) and a test split. It never sees a vote, a share or a total: it
relays each tallier only the boxes sealed to it (``protocol.voting.ballots``), and the talliers send back
the labels (``tallier.mpc``).

A run: every hospital and tallier says Hello (all talliers must: the MPC needs each of them);
the talliers get the run's ``VotingWelcome`` and answer with a certified box key, which the
hospitals then get in theirs. A tallier that refuses the run stops it; a hospital that refuses it
(``Withdraw``) leaves it. Per round (``protocol.voting.voting_round``) the server picks ``Q`` queries from the pool, sends them
to the hospitals, and relays the ballots that arrive in time and carry a box of the right length
for each tallier. A round with fewer ballots than the quorum is aborted: nothing is relayed. Every
tallier must answer with the same voters and labels (with a label threshold, ``C`` for a query
whose noisy top total fell short: its record stays unlabelled); the round is then charged to the server's
ledgers, one per level (``training.voting.vote_privacy``), at the number of voters the talliers agreed.
If every tallier reports the same failure (they agreed on fewer voters than the quorum, say after
bad shares), the round is lost and the run goes on; a tallier that fails otherwise, goes silent or
disagrees stops the run. Either way no label of that round is used.

**Crashes.** The server checkpoints the run (``protocol.run.checkpoint.VotingCheckpoint``): once every
party joined, before each VoteRequest leaves, once a round's ballots are in, and after each round.
Restarted with ``--resume`` it waits for the talliers and hospitals to say Hello again (their
connections are made again by themselves), checks that every tallier comes back with the box key
it had, and goes on: a round whose ballots were in is tallied again from the very same boxes (no
hospital votes twice on the same queries, and the server's ledgers charge each round once), one
stopped before that is recorded as interrupted, and the next round asks new queries. If the
talliers' MPC is interrupted (a tallier left mid-round), the server waits until every tallier that
did not answer has come back with its key, then relays the same boxes again, up to
``MAX_TALLY_ATTEMPTS`` times a round.

Its transcript keeps whole messages: the boxes in them open only with the talliers' per-run keys,
which never leave the tallier processes' memory.

After the rounds it trains a student on the labelled queries and the rest of the pool
(``training.voting.votes.train_student``) and reports its test accuracy, the labels' accuracy, and epsilon at both levels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from consilium.protocol.wire.channel import PartyChannels
from consilium.protocol.run.rules import ConfigError
from consilium.protocol.wire.messages import (
    TO_VOTING_SERVER,
    Hello,
    ProtocolError,
    Shares,
    VoteRequest,
    VotingWelcome,
)
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.wire.transcript import Transcript
from consilium.protocol.run.checkpoint import (
    CheckpointError,
    VotingCheckpoint,
    save_checkpoint,
    write_report,
    write_retrying,
)
from consilium.protocol.run.participants import Participants, Timeouts, join_record, run_to_the_end
from consilium.protocol.wire.transport import ServerTransport
from consilium.protocol.voting.tallier_keys import TallierKeys
from consilium.protocol.voting.voting_config import VotingConfig
from consilium.protocol.voting.voting_report import final_figures, run_report
from consilium.protocol.voting.voting_round import RoundRecord, TallyInterrupted, collect_ballots, collect_labels
from consilium.training.privacy.ledger import PrivacyLedger
from consilium.training.data.datasets import Split
from consilium.training.voting.vote_privacy import LEVELS
from consilium.training.voting.votes import train_student

__all__ = ["MAX_TALLY_ATTEMPTS", "VotingServer"]

MAX_TALLY_ATTEMPTS = 3  # per round: the first, and two more after interrupted MPCs

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
        _checkpoint: VotingCheckpoint | None = None,
    ) -> None:
        roster.check_own_entry(credentials)
        ledgers = {level: out_dir / f"privacy_ledger_{level}.jsonl" for level in LEVELS}
        _check_run(config, roster, public_pool, ledgers, resumed=_checkpoint is not None)
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
        self._order = np.random.default_rng().permutation(len(public_pool))  # the queries are public: no secret needed
        self._rounds_started = 0
        self._pending: tuple[int, dict[str, dict[str, bytes]]] | None = None  # a round's ballots, awaiting labels
        self._resumed_from = _checkpoint
        self._data_digest = _data_digest(public_pool, test)  # in every checkpoint: hashed once, not per write
        self._charged: dict[str, int] = {}  # per level, the last round its ledger charged before a resume
        self._open_channels(credentials, transcript)
        if _checkpoint is not None:
            self._restore(_checkpoint)

    def _open_channels(self, credentials: Credentials, transcript: Path | None) -> None:
        """The server's socket, open to the roster's hospitals and talliers only, its transcript, and who takes part."""
        config, roster, limit = self._config, self._roster, self._config.message_limit()
        enrolled = {roster.party(name).curve_public: name for name in (*config.hospitals, *config.talliers)}
        self._transport = ServerTransport(roster.server_address, credentials.curve, enrolled, limit)
        self._transcript = Transcript(transcript, payloads=True, max_payload_bytes=limit) if transcript else None
        parties = PartyChannels(
            self._transport, accept=TO_VOTING_SERVER, limit=limit, log=log, transcript=self._transcript
        )
        self._participants = Participants(parties, config.hospitals, log)
        self._talliers = TallierKeys(self._participants, config.talliers, self._tallier_welcome, self._timeouts)
        self._participants.intercept = self._talliers.returns

    @classmethod
    def resume(cls, *, out_dir: Path, public_pool: Split, test: Split, **settings) -> "VotingServer":
        """The server of the voting run checkpointed in ``out_dir``, to go on where it stopped."""
        checkpoint = VotingCheckpoint.load(out_dir)
        if checkpoint.data_digest != _data_digest(public_pool, test):
            raise ConfigError(
                "this server's public pool and test split are not the checkpointed run's; pass the same --data"
            )
        return cls(
            config=_checkpointed_config(checkpoint, out_dir),
            public_pool=public_pool,
            test=test,
            feature_map=checkpoint.feature_map,
            out_dir=out_dir,
            _checkpoint=checkpoint,
            **settings,
        )

    @staticmethod
    def checkpointed_config(out_dir: Path) -> VotingConfig:
        """The configuration of the voting run checkpointed in ``out_dir`` (``CheckpointError``)."""
        return _checkpointed_config(VotingCheckpoint.load(out_dir), out_dir)

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
        """Join (or join again), then the rounds; returns why the run ended."""
        started = time.perf_counter()
        if self._resumed_from is None:
            self._join()
        else:
            self._join_again()
        self._phase_seconds["join"] = time.perf_counter() - started
        self._participants.open_rounds()
        self._save_checkpoint(required=True)
        if self._pending is not None:
            round_number, ballots = self._pending
            self._tally(RoundRecord(round=round_number, status="aborted"), self._queries(round_number), ballots)
        quorum = self._config.voting.quorum
        finish_reason = "completed all rounds"
        for round_number in range(self._rounds_started + 1, self._config.rounds + 1):
            self._participants.read_between_rounds()
            self._welcome_joining()
            if len(self._participants.active) < quorum:
                finish_reason = (
                    f"only {len(self._participants.active)} hospitals remain, fewer than the quorum of {quorum}"
                )
                break
            self._run_round(round_number)
        started = time.perf_counter()
        student = self._train_student()
        self._phase_seconds["student"] = time.perf_counter() - started
        self._student = student
        return finish_reason

    # -- phases ---------------------------------------------------------------------------------

    def _join(self) -> None:
        config = self._config
        joined = self._hellos(set(config.hospitals) | set(config.talliers))
        hospitals = tuple(h for h in config.hospitals if h in joined)
        if len(hospitals) < config.voting.quorum:
            raise ProtocolError(
                f"only {len(hospitals)} of {len(config.hospitals)} hospitals joined; the quorum is {config.voting.quorum}"
            )
        self._config = dataclasses.replace(config, hospitals=hospitals)
        self._participants.narrow_to(hospitals, take_part=True)
        self._run = self._config.fingerprint(self._feature_map)
        for ledger in self._ledgers.values():
            ledger.begin_run(self._config.run_id, self._run)
        self._talliers.keys = self._talliers.ask()
        self._welcome_hospitals(hospitals)

    def _join_again(self) -> None:
        """After ``--resume``: every tallier, and the hospitals that were in the run, say Hello again."""
        expected = set(self._participants.active) | set(self._config.talliers)
        joined = self._hellos(expected)
        for name in sorted(set(self._participants.active) - set(joined)):
            self._participants.drop(name, f"did not join again within {self._timeouts.join_s:g} s", notify=False)
        self._talliers.ask_again()
        self._welcome_hospitals(tuple(self._participants.active))
        log.warning("resuming run %s after round %d", self._config.run_id, self._rounds_started)

    def _hellos(self, expected: set[str]) -> list[str]:
        """The parties of ``expected`` that say Hello within the join timeout; every tallier must."""
        deadline = time.monotonic() + self._timeouts.join_s
        joined: list[str] = []
        while set(joined) != expected and (got := self._participants.parties.next_message(deadline)) is not None:
            sender, message = got
            if not isinstance(message, Hello) or sender in joined or sender not in expected:
                self._participants.parties.reject(sender, message, "expected one hello")
            else:
                joined.append(sender)
        missing_talliers = sorted(set(self._config.talliers) - set(joined))
        if missing_talliers:
            raise ProtocolError(
                f"the talliers {missing_talliers} did not join within {self._timeouts.join_s:g} s; the MPC needs every one"
            )
        return joined

    def _tallier_welcome(self) -> VotingWelcome:
        """The run as a tallier is welcomed to it: no keys (a tallier answers with its own)."""
        return VotingWelcome(config=self._config.to_dict(), feature_map=self._feature_map, tallier_keys={})

    def _welcome_hospitals(self, names: tuple[str, ...]) -> None:
        welcome = VotingWelcome(
            config=self._config.to_dict(), feature_map=self._feature_map, tallier_keys=self._talliers.keys
        )
        for name in names:
            self._participants.parties.send(name, welcome)

    def _welcome_joining(self) -> None:
        """Hospitals that said Hello again (their connection was made again) take part from the next round:
        their ledgers keep them from voting twice on a round."""
        participants = self._participants
        if participants.joining:
            joining = participants.take_joining()
            self._welcome_hospitals(tuple(joining))
            participants.admit(joining, before_round=self._rounds_started + 1)

    def _queries(self, round_number: int) -> np.ndarray:
        q = self._config.queries_per_round
        return self._order[(round_number - 1) * q : round_number * q]

    def _run_round(self, round_number: int) -> None:
        record = RoundRecord(round=round_number, status="aborted")
        indices = self._queries(round_number)
        self._rounds_started = round_number
        self._save_checkpoint(required=True)  # before VoteRequest leaves: a resumed server never asks this round again
        started = time.perf_counter()
        queries = np.ascontiguousarray(self._pool.x[indices], dtype="<f4").tobytes()
        for name in self._participants.active:
            self._participants.parties.send(name, VoteRequest(round=round_number, queries=queries))
        self._participants.begin_round()
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
        self._pending = (round_number, ballots)
        self._save_checkpoint()  # a server resumed from here tallies these ballots, asking no hospital again
        log.info("round %d: %d ballots in; relaying them to the talliers", round_number, len(ballots))
        self._tally(record, indices, ballots)

    def _tally(self, record: RoundRecord, indices: np.ndarray, ballots: dict[str, dict[str, bytes]]) -> None:
        """Relay each tallier its boxes and take the labels, relaying the same boxes again after an interrupted MPC."""
        started = time.perf_counter()
        labels = None
        for attempt in range(1, MAX_TALLY_ATTEMPTS + 1):
            record.tally_attempts = attempt
            self._talliers.relayed()
            for tallier in self._config.talliers:
                self._participants.parties.send(
                    tallier,
                    Shares(round=record.round, boxes={voter: boxes[tallier] for voter, boxes in ballots.items()}),
                )
            try:
                labels = collect_labels(
                    self._participants, self._config, record, self._timeouts.round_s, self._talliers.rejoined
                )
                break
            except TallyInterrupted as interrupted:
                if attempt == MAX_TALLY_ATTEMPTS:
                    raise ProtocolError(f"{interrupted}; tried {attempt} times, the run stops") from None
                log.warning("%s; the same boxes go to the talliers again once every one is back", interrupted)
                self._talliers.await_back(set(interrupted.silent), record.round)
        record.seconds["tally"] = time.perf_counter() - started
        self._pending = None
        if labels is None:
            self._abort(record, record.reason)
            return
        if set(record.voters) - set(ballots) or len(record.voters) < self._config.voting.quorum:
            raise ProtocolError(
                f"round {record.round}: the talliers counted voters {record.voters}, not a quorum of those relayed"
            )
        if set(record.refused) - set(ballots) or set(record.refused) & set(record.voters):
            raise ProtocolError(
                f"round {record.round}: the talliers refused {record.refused}, not ballots they left out"
            )
        for level, ledger in self._ledgers.items():
            if self._charged.get(level, 0) < record.round:  # a round tallied again after --resume is charged once
                release = self._config.voting.release(
                    queries=len(indices),
                    classes=self._config.classes,
                    contributors=len(record.voters),
                    coalition=self._config.coalition(len(self._roster.hospitals)),
                    level=level,
                )
                ledger.record(release, run_id=self._config.run_id, round_number=record.round)
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

    # -- checkpoint -----------------------------------------------------------------------------

    def _save_checkpoint(self, *, required: bool = False) -> None:
        """Write the checkpoint. If the system refuses, the one before stands: the run goes on and says so,
        but no round starts (``required``) before its number is on disk."""
        round_number, ballots = self._pending or (0, {})
        checkpoint = VotingCheckpoint(
            config=self._config.to_dict(),
            feature_map=self._feature_map,
            data_digest=self._data_digest,
            order=self._order.tolist(),
            tallier_keys=dict(self._talliers.keys),
            rounds_started=self._rounds_started,
            rounds=[dataclasses.asdict(r) for r in self._rounds],
            labelled=[[indices.tolist(), labels.tolist()] for indices, labels in self._labelled],
            active=self._participants.active + self._participants.joining,
            departures=dict(self._participants.departures),
            joins=list(self._participants.joins),
            pending_round=round_number,
            pending_ballots=ballots,
        )
        save_checkpoint(checkpoint, self._out_dir, required=required)

    def _restore(self, checkpoint: VotingCheckpoint) -> None:
        """Go on from ``checkpoint``."""
        try:
            order = np.array(checkpoint.order, dtype=np.int64)
            if sorted(order.tolist()) != list(range(len(self._pool))):
                raise ValueError("the pool's order is not a permutation of the pool")
            rounds = [RoundRecord(**record) for record in checkpoint.rounds]
            labelled = [(np.array(i, dtype=np.int64), np.array(y, dtype=np.int64)) for i, y in checkpoint.labelled]
            if any(i.shape != y.shape or i.size and not 0 <= i.min() <= i.max() < len(self._pool) for i, y in labelled):
                raise ValueError("a labelled round names records outside the pool")
            if set(checkpoint.tallier_keys) != set(self._config.talliers):
                raise ValueError("it does not hold every tallier's box key")
            pending = checkpoint.pending_round
            if pending and (pending != checkpoint.rounds_started or not checkpoint.pending_ballots):
                raise ValueError(f"its pending round {pending} is not the last one started")
            if not set(checkpoint.pending_ballots) <= set(self._config.hospitals) or any(
                set(boxes) != set(self._config.talliers) for boxes in checkpoint.pending_ballots.values()
            ):
                raise ValueError("its pending ballots are not one box per tallier from hospitals of the run")
            active = [str(name) for name in checkpoint.active if name in self._config.hospitals]
            departures = {str(name): str(reason) for name, reason in dict(checkpoint.departures).items()}
            joins = [join_record(join) for join in checkpoint.joins]
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            raise CheckpointError(f"the checkpoint in {self._out_dir} is unusable: {error}") from None
        self._order, self._rounds, self._labelled = order, rounds, labelled
        self._talliers.keys = dict(checkpoint.tallier_keys)
        self._participants.narrow_to(self._config.hospitals)
        self._participants.restore(active=active, departures=departures, joins=joins)
        self._run = self._config.fingerprint(self._feature_map)
        self._charged = {
            level: ledger.begin_run(self._config.run_id, self._run) for level, ledger in self._ledgers.items()
        }
        self._rounds_started = max(checkpoint.rounds_started, *self._charged.values())
        self._pending = (pending, checkpoint.pending_ballots) if pending == self._rounds_started and pending else None
        if self._pending is None and self._rounds_started > max((r.round for r in rounds), default=0):
            self._rounds.append(
                RoundRecord(
                    round=self._rounds_started,
                    status="aborted",
                    reason="interrupted: the server stopped before this round's ballots were in",
                )
            )

    # -- helpers --------------------------------------------------------------------------------

    def _abort(self, record: RoundRecord, reason: str) -> None:
        record.reason = reason
        log.warning("round %d aborted: %s; no share is relayed", record.round, reason)
        self._finish_round(record)

    def _finish_round(self, record: RoundRecord) -> None:
        self._participants.end_round()
        self._rounds.append(record)
        self._save_checkpoint()
        self._on_round(dataclasses.asdict(record))

    def _report(self, finish_reason: str) -> dict:
        transport, participants = self._transport, self._participants
        return {
            **run_report(self._config, finish_reason, getattr(self, "_run", ""), self._rounds),
            "final": final_figures(
                self._config, self._rounds, self._labelled, self._pool, self._test, self._student, self._ledgers
            ),
            "phase_seconds": self._phase_seconds,
            "rejected_messages": participants.parties.rejections.total,
            "departures": participants.departures,
            "joins": participants.joins,
            "connection_limits": transport.limits,
            "bytes_received": dict(transport.bytes_received),
            "bytes_sent": dict(transport.bytes_sent),
        }

    def _write_outputs(self, report: dict) -> None:
        write_retrying(lambda: write_report(self._out_dir, report), "the server's report")

    def _close(self) -> None:
        self._transport.close()
        if self._transcript:
            self._transcript.close()


def _checkpointed_config(checkpoint: VotingCheckpoint, out_dir: Path) -> VotingConfig:
    try:
        return VotingConfig.from_dict(checkpoint.config)
    except ConfigError as error:
        raise CheckpointError(f"the checkpoint in {out_dir} is unusable: {error}") from None


def _check_run(
    config: VotingConfig, roster: Roster, public_pool: Split, ledgers: dict[str, Path], *, resumed: bool
) -> None:
    """``ConfigError`` where the run cannot start: talliers other than the roster's, a pool too small for its
    queries, or (unless resumed) an output folder that already holds a run's ledgers."""
    if config.talliers != tuple(roster.talliers):
        raise ConfigError(f"the run's talliers {list(config.talliers)} are not the roster's {roster.talliers}")
    if len(public_pool) < config.rounds * config.queries_per_round:
        raise ConfigError(
            f"{config.rounds} rounds of {config.queries_per_round} queries need {config.rounds * config.queries_per_round} "
            f"public records; the pool has {len(public_pool)}"
        )
    if not resumed and any(path.exists() for path in ledgers.values()):
        out_dir = next(iter(ledgers.values())).parent
        raise ConfigError(
            f"{out_dir} already holds a run (its ledgers would mix two runs); choose another --out, or --resume it"
        )


def _data_digest(public_pool: Split, test: Split) -> str:
    """A digest of the records a voting server labels and tests on: a resumed server must hold the same."""
    digest = hashlib.sha256(b"consilium voting data v1")
    for array in (public_pool.x, public_pool.y, test.x, test.y):
        data = np.ascontiguousarray(array)
        digest.update(str((data.dtype.str, data.shape)).encode() + data.tobytes())
    return digest.hexdigest()
