"""The server of a voting run: asks the hospitals to vote, relays sealed shares, and learns only the labels.

It holds the public pool (unlabeled records; their true labels only to measure the label accuracy
of the run, as a simulation can) and a test split. It never sees a vote, a share or a total: it
relays each tallier only the boxes sealed to it (``protocol.voting.ballots``), the talliers send back
the labels (``tallier.mpc``), and its transcript's boxes open only with their per-run keys (one
disputed box, with the secret its hospital revealed: ``protocol.voting.box_dispute``).

A run: every hospital and tallier says Hello (all talliers must: the MPC needs each of them); the
talliers get the run's ``VotingWelcome`` and answer with a certified box key
(``protocol.voting.tallier_keys``), which the hospitals then get in theirs. A tallier that refuses the
run stops it; a hospital that refuses it (``Withdraw``) leaves it. Per round
(``protocol.voting.voting_round``) the server picks ``Q`` queries from the pool, sends them to the
hospitals, relays the ballots that arrive in time to the talliers, and takes the labels they all
report alike (with a label threshold, ``C`` for a query whose noisy top total fell short: its record
stays unlabelled). A round with no ballot is aborted; one with fewer than the quorum is relayed
all the same, and the talliers end it and sign its void; a round the talliers could not tally is
lost. Either way no label of that round is used, and only a labelled round is
charged to the server's ledgers (``protocol.voting.voting_ledgers``). A server that stopped goes on
from its checkpoint (``protocol.voting.voting_resume``). After the rounds it trains a student on the
labelled queries and the rest of the pool (``training.voting.votes.train_student``) and reports its
test accuracy, the labels' accuracy, and epsilon at both levels.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from consilium.protocol.run.rules import ConfigError
from consilium.protocol.wire.messages import TO_VOTING_SERVER, Hello, ProtocolError, VoteRequest, VotingWelcome
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.run.checkpoint import VotingCheckpoint, save_checkpoint, write_report, write_retrying
from consilium.protocol.run.participants import Timeouts, run_to_the_end
from consilium.protocol.run.server_connections import ServerConnections
from consilium.protocol.wire.transport import ServerTransport
from consilium.protocol.voting.voting_resume import check_startable, data_digest, restored
from consilium.protocol.voting.tallier_keys import TallierKeys
from consilium.protocol.voting.voting_config import VotingConfig
from consilium.protocol.voting.voting_ledgers import VotingLedgers, ledger_paths
from consilium.protocol.voting.voting_report import final_figures, run_report
from consilium.protocol.voting.box_dispute import BoxDisputes
from consilium.protocol.voting.voting_round import BallotSeals, RoundRecord, collect_ballots, tally
from consilium.training.data.datasets import Split
from consilium.training.voting.votes import train_student

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
        listen: str | None = None,
        transport: ServerTransport | None = None,
        _checkpoint: VotingCheckpoint | None = None,
    ) -> None:
        roster.check_own_entry(credentials)
        check_startable(config, roster, public_pool, ledger_paths(out_dir), resumed=_checkpoint is not None)
        self._config = config
        self._roster = roster
        self._pool = public_pool
        self._test = test
        self._feature_map = feature_map
        self._out_dir = out_dir
        self._student_epochs = student_epochs
        self._timeouts = timeouts
        self._on_round = on_round or (lambda record: None)
        self._ledgers = VotingLedgers(
            out_dir, key=credentials.ledger_key, config=config, roster_hospitals=len(roster.hospitals)
        )
        self._rounds: list[RoundRecord] = []
        self._labelled: list[tuple[np.ndarray, np.ndarray]] = []  # (pool indices, labels) of each labelled round
        self._student: torch.nn.Module | None = None
        self._phase_seconds: dict[str, float] = {}
        self._order = np.random.default_rng().permutation(len(public_pool))  # the queries are public: no secret needed
        self._rounds_started = 0
        self._pending: tuple[int, dict[str, dict[str, bytes]]] | None = None  # a round's ballots, awaiting labels
        self._resumed_from = _checkpoint
        self._data_digest = data_digest(public_pool, test)  # in every checkpoint: hashed once, not per write
        self._open_channels(credentials, transcript, listen, transport)
        if _checkpoint is not None:
            self._restore(_checkpoint)

    def _open_channels(
        self, credentials: Credentials, transcript: Path | None, listen: str | None, transport: ServerTransport | None
    ) -> None:
        """The server's socket, open to the roster's hospitals and talliers only, its transcript, and who takes part."""
        config = self._config
        self._connections = ServerConnections.open(
            self._roster,
            credentials,
            hospitals=config.hospitals,
            others=config.talliers,
            accept=TO_VOTING_SERVER,
            limit=config.message_limit(),
            log=log,
            transcript=transcript,
            listen=listen,
            transport=transport,
        )
        self._participants = self._connections.participants
        self._talliers = TallierKeys(self._participants, config.talliers, self._tallier_welcome, self._timeouts)
        self._participants.intercept = self._talliers.returns

    @classmethod
    def resume(cls, *, out_dir: Path, public_pool: Split, test: Split, **settings) -> "VotingServer":
        """The server of the voting run checkpointed in ``out_dir``, to go on where it stopped."""
        checkpoint = VotingCheckpoint.load(out_dir)
        if checkpoint.data_digest != data_digest(public_pool, test):
            raise ConfigError(
                "this server's public pool and test split are not the checkpointed run's; pass the same --data"
            )
        return cls(
            config=checkpoint.run_config(VotingConfig, out_dir),
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
        return VotingCheckpoint.load(out_dir).run_config(VotingConfig, out_dir)

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
            close=self._connections.close,
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
            resumed = RoundRecord(round=round_number, status="aborted", tally_attempts=1)  # relayed before, maybe
            seals = BallotSeals(self._roster, self._run, self._talliers.keys)
            self._tally(resumed, self._queries(round_number), ballots, seals)
        quorum = self._config.voting.quorum
        finish_reason = "completed all rounds"
        for round_number in range(self._rounds_started + 1, self._config.rounds + 1):
            self._participants.read_between_rounds()
            self._welcome_joining()
            if len(self._participants.active) < quorum:
                finish_reason = self._participants.shortfall(quorum)
                break
            self._run_round(round_number)
        started = time.perf_counter()
        student = self._train_student()
        self._phase_seconds["student"] = time.perf_counter() - started
        self._student = student
        return finish_reason

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
        self._ledgers.begin_run(self._config, self._run)
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
            if isinstance(message, Hello) and sender in joined:  # said again on a reconnection: harmless
                log.info("%s said Hello again while the run gathers its parties", sender)
            elif not isinstance(message, Hello) or sender not in expected:
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
        seals = BallotSeals(self._roster, self._run, self._talliers.keys)  # what the boxes and any void are checked by
        ballots = collect_ballots(
            self._participants, round_number, seals, self._config.ballot_layout().values, self._timeouts.round_s
        )
        record.seconds["ballots"] = time.perf_counter() - started
        record.voters = sorted(ballots, key=self._config.hospitals.index)
        if not ballots:  # every hospital withdrew, or sent nothing in time and is dropped: nobody to relay to
            self._abort(record, f"no ballots, fewer than the quorum of {self._config.voting.quorum}")
            return
        # Fewer than the quorum are relayed all the same: the talliers end the round before computing anything
        # and sign its void, which cancels the charges of those who voted (docs/explanation/void-rounds.md).
        self._pending = (round_number, ballots)
        self._save_checkpoint()  # a server resumed from here tallies these ballots, asking no hospital again
        log.info("round %d: %d ballots in; relaying them to the talliers", round_number, len(ballots))
        self._tally(record, indices, ballots, seals)

    def _tally(
        self, record: RoundRecord, indices: np.ndarray, ballots: dict[str, dict[str, bytes]], seals: BallotSeals
    ) -> None:
        """The talliers' labels for the round's ballots (``protocol.voting.voting_round.tally``), charged and kept."""
        started = time.perf_counter()
        settled = BoxDisputes(self._roster, self._config, self._run, self._talliers.keys)
        parties, timeout = (self._participants, self._talliers), self._timeouts.round_s
        try:
            labels = tally(*parties, self._config, record, ballots, timeout, settled, seals)
        except ProtocolError as error:  # the run stops: the report shows the round; the checkpoint keeps it pending
            relayed = sorted(ballots, key=self._config.hospitals.index)  # not the talliers' claims, maybe refused
            stopped = dict(status="stopped", reason=str(error), voters=relayed, refused=[], refused_because=[])
            self._rounds.append(dataclasses.replace(record, **stopped))
            raise
        record.seconds["tally"] = time.perf_counter() - started
        self._pending = None
        if labels is None:
            self._abort(record, record.reason)
            return
        self._ledgers.charge(record, queries=len(indices))
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
            expelled=sorted(self._participants.expelled),
        )
        save_checkpoint(checkpoint, self._out_dir, required=required)

    def _restore(self, checkpoint: VotingCheckpoint) -> None:
        """Go on from ``checkpoint``."""
        vote = restored(checkpoint, self._config, len(self._pool), self._out_dir)
        departures, joins, expelled = checkpoint.membership(self._out_dir)
        self._order, self._rounds, self._labelled = vote.order, vote.rounds, vote.labelled
        self._talliers.keys = dict(checkpoint.tallier_keys)
        self._participants.narrow_to(self._config.hospitals)
        self._participants.restore(active=vote.active, departures=departures, joins=joins, expelled=expelled)
        self._run = self._config.fingerprint(self._feature_map)
        self._rounds_started = max(checkpoint.rounds_started, self._ledgers.begin_run(self._config, self._run))
        pending = vote.pending_round
        self._pending = (pending, checkpoint.pending_ballots) if pending == self._rounds_started and pending else None
        if self._pending is None and self._rounds_started > max((r.round for r in vote.rounds), default=0):
            self._rounds.append(
                RoundRecord(
                    round=self._rounds_started,
                    status="aborted",
                    reason="interrupted: the server stopped before this round's ballots were in",
                )
            )

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
        return {
            **run_report(self._config, finish_reason, getattr(self, "_run", ""), self._rounds),
            "final": final_figures(
                self._config,
                self._rounds,
                self._labelled,
                self._pool,
                self._test,
                self._student,
                self._ledgers.epsilons(),
            ),
            "phase_seconds": self._phase_seconds,
            **self._connections.report(),
        }

    def _write_outputs(self, report: dict) -> None:
        write_retrying(lambda: write_report(self._out_dir, report), "the server's report")
