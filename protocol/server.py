"""The server (aggregator): adds ciphertexts it cannot read, and learns only what hospitals release.

It holds the run configuration, a ``PublicContext`` (BFV parameters, no key: it can neither encrypt
nor decrypt), its copy of the model, moved only by the DP-protected mean gradient the hospitals
release, and the run's privacy ledger. It never holds the secret key or a hospital's update in the
clear.

A run is a join, a key ceremony and rounds (``protocol.messages`` shows the sequence). Every wait
has a deadline. A message that fails validation, is out of sequence, or comes from a party with
nothing to say at that point is logged as rejected and changes nothing. A round that gathers fewer
contributions than the quorum is aborted and its sum is never sent for decryption; one that some
contributor does not endorse (``crypto.endorsement``) is aborted before anyone may decrypt it; a
hospital that misses a deadline is dropped from the run.

Hospitals of the run may join again (``_admit``): one that says Hello after the run began, because
it restarted or its connection was made again, leaves the round under way and is welcomed before
the next one to the model and its update rule's state as they are then. The server checkpoints what it needs to
resume after a crash (``protocol.checkpoint``); ``Server.resume`` goes on from it, and the
hospitals, which notice the new connection, join again by themselves.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from crypto.bfv import BfvError, CiphertextSum, PublicContext
from crypto.insecure_plaintext import InsecurePlaintextSum
from crypto.endorsement import EndorsementError, aggregate_statement, check_endorsements
from protocol.channel import PartyChannels
from protocol.checkpoint import Checkpoint, CheckpointError, write_at_the_end, write_report, write_retrying
from training.durable import replace_file
from protocol.config import INSECURE_PLAINTEXT, ConfigError, RunConfig
from protocol.messages import (
    TO_SERVER,
    Aggregate,
    Endorsement,
    Endorsements,
    Finish,
    Hello,
    KeyReady,
    KeyRequest,
    KeySetup,
    MeanRequest,
    Message,
    MessageError,
    ProtocolError,
    Released,
    RoundAbort,
    RoundStart,
    RunKey,
    SealedKey,
    Update,
    Welcome,
    Withdraw,
    float32_values,
    release_digest,
)
from protocol.party_keys import Credentials
from protocol.roster import Roster
from protocol.transcript import Transcript
from protocol.transport import DEFAULT_MAX_MESSAGES_PER_SECOND, ServerTransport
from training.accounting import ACCOUNTANT, LEDGER_FILE, PrivacyLedger
from training.datasets import Split
from training.methods import SharedState, ledger_release
from training.evaluation import evaluate
from training.models import build_model, get_flat_parameters, set_flat_parameters

__all__ = ["Server", "Timeouts"]

log = logging.getLogger("consilium.server")
SELECTED_MODEL_FILE = "selected_model.pt"  # the parameters of the round selected on validation
_MAX_JOINS_AGAIN = 3  # per hospital and run: a join mid-round costs every contributor a round's charge

@dataclass(frozen=True)
class Timeouts:
    join_s: float = 60.0
    key_s: float = 60.0
    round_s: float = 60.0


@dataclass
class _RoundRecord:
    round: int
    status: str  # "released" or "aborted"
    contributors: list[str]
    validation_accuracy: float | None = None
    validation_auc: float | None = None
    test: dict[str, float | None] | None = None  # accuracy and AUC on the test split, if the data have one
    epsilon: dict[str, float] = field(default_factory=dict)  # by view, see training.accounting, at the ledger's level
    epsilon_levels: dict[str, dict[str, float]] = field(default_factory=dict)  # level -> view -> epsilon
    seconds: dict[str, float] = field(default_factory=dict)
    update_bytes: dict[str, int] = field(default_factory=dict)
    reason: str = ""
    round_state: dict[str, float] = field(default_factory=dict)  # the method's, this round (adaptive v and C)


class Server:
    def __init__(
        self,
        *,
        config: RunConfig,
        roster: Roster,
        credentials: Credentials,
        validation: Split,
        out_dir: Path,
        test: Split | None = None,
        timeouts: Timeouts = Timeouts(),
        transcript: Path | None = None,
        transcript_payloads: bool = False,
        max_messages_per_second: float = DEFAULT_MAX_MESSAGES_PER_SECOND,
        on_round: Callable[[dict], None] | None = None,
        _checkpoint: Checkpoint | None = None,
    ) -> None:
        roster.check_own_entry(credentials)
        ledger_path = out_dir / LEDGER_FILE
        if _checkpoint is None and ledger_path.exists():
            raise ConfigError(f"{out_dir} already holds a run (its ledger would mix two runs); choose another --out, or --resume it")
        self._config = config
        self._roster = roster
        self._validation = validation
        self._test = test
        self._out_dir = out_dir
        self._timeouts = timeouts
        self._on_round = on_round or (lambda record: None)
        self._model = build_model(config.model)
        self._shared = SharedState(config.training, self._model)
        self._params = config.bfv_parameters()
        limit = config.message_limit()
        self._mechanism = self._shared.mechanism
        self._parameter_count = self._shared.parameter_count
        self._ledger = PrivacyLedger(ledger_path, key=credentials.ledger_key)  # charged at the method's first level, as the hospitals' are
        self._levels = {level: PrivacyLedger() for level in config.training.LEVELS[1:]}  # reported only, rebuilt on resume
        self._public: PublicContext | None = None
        self._run = ""  # RunConfig.fingerprint of what every hospital is welcomed with, once known
        self._active: list[str] = []  # hold the key and take part in rounds
        self._joining: list[str] = []  # said Hello after the run began: welcomed before the next round
        self._rounds: list[_RoundRecord] = []
        self._rounds_started = 0
        self._departures: dict[str, str] = {}
        self._joins: list[dict] = []  # hospitals that joined after the start, and before which round
        self._phase_seconds: dict[str, float] = {}
        self._rounds_open = False  # from the first admission on, a Hello means a hospital joins again
        self._write_failures: list[str] = []  # what the system refused to write, reported
        self._resumed_from = _checkpoint
        if _checkpoint is None:
            self._initial_parameters = get_flat_parameters(self._model)  # the ledger's run begins once the run is named
        else:
            self._restore(_checkpoint)
        enrolled = {roster.party(name).curve_public: name for name in config.hospitals}
        self._transport = ServerTransport(
            roster.server_address, credentials.curve, enrolled, limit, max_messages_per_second
        )
        self._transcript = (
            Transcript(transcript, payloads=transcript_payloads, max_payload_bytes=limit) if transcript else None
        )
        self._parties = PartyChannels(self._transport, accept=TO_SERVER, limit=limit, log=log, transcript=self._transcript)

    @property
    def config(self) -> RunConfig:
        return self._config

    @classmethod
    def resume(cls, *, out_dir: Path, **settings) -> "Server":
        """The server of the run checkpointed in ``out_dir``, to go on where it stopped (``protocol.checkpoint``)."""
        checkpoint = Checkpoint.load(out_dir)
        return cls(config=_checkpointed_config(checkpoint, out_dir), out_dir=out_dir, _checkpoint=checkpoint, **settings)

    @staticmethod
    def checkpointed_config(out_dir: Path) -> RunConfig:
        """The configuration of the run checkpointed in ``out_dir``, read without touching anything (``CheckpointError``)."""
        return _checkpointed_config(Checkpoint.load(out_dir), out_dir)

    def _restore(self, checkpoint: Checkpoint) -> None:
        try:
            self._initial_parameters = float32_values(checkpoint.initial_parameters, self._parameter_count, "its initial model")
            set_flat_parameters(self._model, float32_values(checkpoint.parameters, self._parameter_count, "its model"))
            self._shared.load_state(float32_values(checkpoint.optimizer_state, self._shared.state().size, "its optimizer state"))
            self._rounds = [_RoundRecord(**record) for record in checkpoint.rounds]
            if not all(type(r.round) is int for r in self._rounds):
                raise ValueError("round numbers must be integers")
            self._departures = {str(name): str(reason) for name, reason in dict(checkpoint.departures).items()}
            self._joins = [{"hospital": str(j["hospital"]), "before_round": int(j["before_round"])} for j in checkpoint.joins]
        except (MessageError, TypeError, ValueError, KeyError) as error:
            raise CheckpointError(f"the checkpoint in {self._out_dir} is unusable: {error}") from None
        self._run = self._config.fingerprint(checkpoint.initial_parameters)
        charged_up_to = self._ledger.begin_run(self._config.run_id, self._run)
        for ledger in self._levels.values():
            ledger.begin_run(self._config.run_id, self._run)
        for record in self._released():
            self._record_other_levels(record)
        self._public = PublicContext(self._params)
        # Never a round number used before, even if the checkpoint on disk were older than the ledger.
        self._rounds_started = max(checkpoint.rounds_started, charged_up_to)
        if self._rounds_started > max((r.round for r in self._rounds), default=0):
            self._rounds.append(
                _RoundRecord(
                    round=self._rounds_started, status="aborted", contributors=[],
                    reason="interrupted: the server stopped during this round",
                )  # fmt: skip
            )
        log.warning(
            "resuming run %s after round %d (its ledger last charged round %d)",
            self._config.run_id, self._rounds_started, charged_up_to,
        )  # fmt: skip

    def run(self) -> dict:
        """Run the federation to its end; returns (and writes) the server's report."""
        finish_reason = "completed all rounds"
        try:
            started = time.perf_counter()
            if self._resumed_from is None:
                self._join()
            else:
                self._await_hellos(set(self._resumed_from.active), time.monotonic() + self._timeouts.join_s)
            self._phase_seconds["join"] = time.perf_counter() - started
            started = time.perf_counter()
            self._admit()
            self._phase_seconds["key_ceremony"] = time.perf_counter() - started
            quorum = self._config.training.quorum
            for round_number in range(self._rounds_started + 1, self._config.rounds + 1):
                if self._joining:
                    self._admit()
                if len(self._active) < quorum:
                    break
                self._run_round(round_number)
            remaining = len(self._active) + len(self._joining)  # (one joining again is still in the run)
            if remaining < quorum:
                finish_reason = f"only {remaining} hospitals remain, fewer than the quorum of {quorum}"
        except ProtocolError as error:
            finish_reason = f"stopped: {error}"
            raise
        except BaseException as error:  # a bug or an interrupt: the report must not claim success
            finish_reason = f"stopped by an unexpected {type(error).__name__}: {error}"
            raise
        finally:
            for name in self._active + self._joining:
                self._parties.send(name, Finish(reason=finish_reason))
            report = self._report(finish_reason)
            try:
                write_at_the_end(lambda: self._write_outputs(report), run_failed=finish_reason.startswith("stopped"))
            finally:
                self._transport.close()
                if self._transcript:
                    self._transcript.close()
        return report

    # -- phases ---------------------------------------------------------------------------------

    def _join(self) -> None:
        """The hospitals that say Hello in time make up the run; its settings and fingerprint follow."""
        self._await_hellos(set(self._config.hospitals), time.monotonic() + self._timeouts.join_s)
        joined = set(self._joining)
        if len(joined) < self._config.training.quorum:
            raise ProtocolError(
                f"only {len(joined)} of {len(self._config.hospitals)} hospitals joined within {self._timeouts.join_s:g} s; "
                f"the quorum is {self._config.training.quorum}"
            )
        self._config = dataclasses.replace(self._config, hospitals=tuple(h for h in self._config.hospitals if h in joined))
        self._params = self._config.bfv_parameters()
        self._public = PublicContext(self._params)
        self._run = self._config.fingerprint(self._initial_parameters.tobytes())
        for ledger in (self._ledger, *self._levels.values()):
            ledger.begin_run(self._config.run_id, self._run)

    def _await_hellos(self, expected: set[str], deadline: float) -> None:
        while not expected <= set(self._joining):
            got = self._next_message(deadline)
            if got is None:
                return
            sender, message = got
            if not isinstance(message, Hello):
                self._parties.reject(sender, message, "expected hello")
            elif sender not in self._config.hospitals:
                self._parties.reject(sender, message, "not a hospital of this run")
            elif sender in self._joining:
                self._parties.reject(sender, message, "already joined")
            else:
                self._joining.append(sender)  # told how the run ends from now on, also if it ends mid-join
                log.info("%s joined (%d of %d)", sender, len(self._joining), len(expected))

    def _admit(self) -> None:
        """Welcome the hospitals that said Hello to the model as it is now, and see that each holds the key.

        At the start the key holder is told to create the run's key; every other hospital sends a
        fresh certified box key (RunKey), and a hospital that holds the key seals it to them (the key
        holder at the start, any hospital of the run later). A hospital joins the rounds on KeyReady.
        """
        newcomers, self._joining = self._joining, []
        deadline = time.monotonic() + self._timeouts.key_s
        welcome = dict(
            config=self._config.to_dict(),
            initial_parameters=self._initial_parameters.tobytes(),
            parameters=get_flat_parameters(self._model).tobytes(),
            optimizer_state=self._shared.state().tobytes(),
        )
        key_exists = bool(self._active) or self._resumed_from is not None or self._rounds_started > 0
        for name in newcomers:
            self._parties.send(name, Welcome(**welcome, generate_key=not key_exists and name == self._config.key_holder))
        ready: list[str] = []
        run_keys: dict[str, bytes] = {}
        while set(ready) | set(run_keys) != set(newcomers):
            got = self._next_message(deadline)
            if got is None:
                break
            sender, message = got
            if sender not in newcomers or sender in ready or sender in run_keys:
                self._parties.reject(sender, message, "expected nothing while hospitals join")
            elif isinstance(message, KeyReady):
                ready.append(sender)
            elif isinstance(message, RunKey):
                run_keys[sender] = message.certified_key
            else:
                self._parties.reject(sender, message, "expected key ready or a run key")
        sealers = self._active + sorted(ready, key=lambda name: name != self._config.key_holder)
        if run_keys and sealers:
            ready += self._relay_key(sealers[0], run_keys, deadline)
        for name in set(newcomers) - set(ready) - set(self._joining):  # (one that said Hello again is welcomed again)
            self._departures[name] = f"did not take the run's key within {self._timeouts.key_s:g} s"
            log.warning("%s leaves the run: %s", name, self._departures[name])
            self._parties.send(name, Finish(reason=self._departures[name]))
        if self._rounds_started:
            self._joins += [{"hospital": name, "before_round": self._rounds_started + 1} for name in ready]
        self._active = [name for name in self._config.hospitals if name in self._active or name in ready]
        log.info("%d hospitals hold the key; the server holds parameters only", len(self._active))
        self._rounds_open = True
        self._save_checkpoint()

    def _relay_key(self, sealer: str, run_keys: dict[str, bytes], deadline: float) -> list[str]:
        """Have ``sealer`` seal the key to each run key, relay the boxes; those that confirm hold the key."""
        self._parties.send(sealer, KeyRequest(run_keys=run_keys))
        while True:
            got = self._next_message(deadline)
            if got is None:
                log.warning("%s sealed no key within %g s", sealer, self._timeouts.key_s)
                return []
            sender, message = got
            if not (isinstance(message, KeySetup) and sender == sealer):
                self._parties.reject(sender, message, f"expected {sealer}'s key setup")
            elif set(message.sealed_keys) != set(run_keys):
                self._parties.reject(sender, message, f"sealed keys are for {sorted(message.sealed_keys)}, not {sorted(run_keys)}")
            else:
                break
        for name, box in message.sealed_keys.items():
            self._parties.send(name, SealedKey(box=box, sealer=sealer))
        ready: list[str] = []
        while set(ready) != set(run_keys):
            got = self._next_message(deadline)
            if got is None:
                break
            sender, message = got
            if isinstance(message, KeyReady) and sender in run_keys and sender not in ready:
                ready.append(sender)
            else:
                self._parties.reject(sender, message, "expected key ready")
        return ready

    def _run_round(self, round_number: int) -> None:
        training = self._shared.settings
        record = _RoundRecord(round=round_number, status="aborted", contributors=[], round_state=training.round_state())
        self._rounds_started = round_number
        self._save_checkpoint(required=True)  # before RoundStart leaves: a resumed server never starts this round again
        started = time.perf_counter()
        for name in self._active:
            self._parties.send(name, RoundStart(round=round_number))
        total, aggregate_seconds = self._collect(round_number, record)
        record.seconds["collect"] = time.perf_counter() - started
        record.seconds["aggregate"] = aggregate_seconds
        quorum = self._config.training.quorum
        if len(record.contributors) < quorum:
            self._abort(record, f"{len(record.contributors)} contributions, fewer than the quorum of {quorum}")
            return

        started = time.perf_counter()
        aggregate = Aggregate(round=round_number, contributors=tuple(record.contributors), chunks=tuple(total.to_chunks()))
        for name in record.contributors:
            self._parties.send(name, aggregate)
        signatures = self._collect_endorsements(aggregate, record.round_state)
        if set(signatures) != set(record.contributors):
            self._abort(record, f"{len(signatures)} of {len(record.contributors)} contributors endorsed the aggregate")
            return
        # Charged before the endorsements leave: from then on the contributors may decrypt and use the sum.
        release = ledger_release(training, self._mechanism, len(record.contributors))
        self._ledger.record(release, run_id=self._config.run_id, round_number=round_number)
        for name in record.contributors:
            self._parties.send(name, Endorsements(round=round_number, signatures=signatures))
        mean_gradient = self._await_release(round_number, record.contributors)
        record.seconds["release"] = time.perf_counter() - started

        started = time.perf_counter()
        self._shared.apply(mean_gradient, len(record.contributors))
        scores = evaluate(self._model, self._validation, num_classes=self._config.model.num_classes)
        record.validation_accuracy, record.validation_auc = scores["accuracy"], scores["auc"]
        if _selected_on_validation([*self._released(), record]) is record:
            self._keep_selected(record)
        record.seconds["evaluate"] = time.perf_counter() - started
        record.status = "released"
        self._record_other_levels(record)
        record.epsilon = self._ledger.epsilons(self._config.delta)
        record.epsilon_levels = self._epsilon_levels()
        self._finish_round(record)

    def _released(self) -> list[_RoundRecord]:
        return [r for r in self._rounds if r.status == "released"]

    def _keep_selected(self, record: _RoundRecord) -> None:
        """The new best round on validation: its model is the one a user keeps, and the only one scored on test."""
        if self._test is not None:
            record.test = evaluate(self._model, self._test, num_classes=self._config.model.num_classes)
        try:
            write_retrying(lambda: _save_model(self._model, self._out_dir / SELECTED_MODEL_FILE), "the selected model")
        except CheckpointError as error:
            self._write_failures.append(str(error))
            log.warning("%s", error)

    def _record_other_levels(self, record: _RoundRecord) -> None:
        releases = self._config.training.levels(self._mechanism, len(record.contributors))
        for level, ledger in self._levels.items():
            ledger.record(releases[level], run_id=self._config.run_id, round_number=record.round)

    def _epsilon_levels(self) -> dict[str, dict[str, float]]:
        """Epsilon by view at every level the method protects (the first is the ledger's)."""
        first, *others = self._config.training.LEVELS
        return {
            first: self._ledger.epsilons(self._config.delta),
            **{level: self._levels[level].epsilons(self._config.delta) for level in others},
        }

    def _collect(self, round_number: int, record: _RoundRecord) -> tuple[CiphertextSum | InsecurePlaintextSum, float]:
        total = (
            InsecurePlaintextSum(self._params) if self._config.aggregation == INSECURE_PLAINTEXT else CiphertextSum(self._public)
        )
        aggregate_seconds = 0.0
        deadline = time.monotonic() + self._timeouts.round_s
        waiting = lambda: not set(self._active) <= set(record.contributors)  # noqa: E731
        while waiting():
            got = self._next_message(deadline, waiting)
            if got is None:
                break
            sender, message = got
            if isinstance(message, Withdraw) and sender in self._active:
                self._drop(sender, f"withdrew: {message.reason}", notify=False)
            elif not isinstance(message, Update) or sender not in self._active:
                self._parties.reject(sender, message, f"expected an update for round {round_number}")
            elif message.round != round_number:
                self._parties.reject(sender, message, f"update for round {message.round} during round {round_number}")
            elif sender in record.contributors:
                self._parties.reject(sender, message, f"second update for round {round_number}")
            else:
                started = time.perf_counter()
                try:
                    total.add(message.chunks)
                except BfvError as error:
                    self._parties.reject(sender, message, str(error))
                    continue
                aggregate_seconds += time.perf_counter() - started
                record.contributors.append(sender)
                record.update_bytes[sender] = sum(len(chunk) for chunk in message.chunks)
        for name in set(self._active) - set(record.contributors):
            self._drop(name, f"sent no update for round {round_number} within {self._timeouts.round_s:g} s")
        record.contributors.sort(key=self._config.hospitals.index)
        return total, aggregate_seconds

    def _abort(self, record: _RoundRecord, reason: str) -> None:
        """End a round whose sum no hospital may decrypt."""
        record.reason = reason
        for name in record.contributors:
            if name in self._active:
                self._parties.send(name, RoundAbort(round=record.round, reason=reason))
        log.warning("round %d aborted: %s; its sum is never decrypted", record.round, reason)
        self._finish_round(record)

    def _collect_endorsements(self, aggregate: Aggregate, round_state: dict[str, float]) -> dict[str, bytes]:
        """Each contributor's signature on the aggregate (crypto.endorsement), checked as it arrives."""
        contributors = set(aggregate.contributors)
        statement = aggregate_statement(
            run=self._run, round_number=aggregate.round, contributors=aggregate.contributors, chunks=aggregate.chunks,
            round_state=round_state,
        )  # fmt: skip
        signatures: dict[str, bytes] = {}
        deadline = time.monotonic() + self._timeouts.round_s
        complete = lambda: contributors <= set(self._active)  # noqa: E731 (one joining again will never endorse)
        while set(signatures) != contributors:
            got = self._next_message(deadline, complete)
            if not complete():
                return signatures  # nobody is late
            if got is None:
                break
            sender, message = got
            if not (isinstance(message, Endorsement) and message.round == aggregate.round and sender in contributors):
                self._parties.reject(sender, message, f"expected an endorsement of the aggregate of round {aggregate.round}")
                continue
            if sender in signatures:
                self._parties.reject(sender, message, f"second endorsement of round {aggregate.round}")
                continue
            try:
                check_endorsements(statement, {sender: message.signature}, {sender: self._roster.party(sender).identity.signing})
            except EndorsementError as error:
                # An honest contributor that signs another statement holds another aggregate or round state.
                shown = f" (the server's round state: {round_state})" if round_state else ""
                self._parties.reject(sender, message, f"{error}{shown}")
                continue
            signatures[sender] = message.signature
        for name in contributors - set(signatures):
            self._drop(name, f"did not endorse the aggregate of round {aggregate.round} within {self._timeouts.round_s:g} s")
        return signatures

    def _await_release(self, round_number: int, contributors: list[str]) -> np.ndarray:
        """The mean gradient the contributors decrypted; all of them must state the same digest."""
        releaser = contributors[0]
        digests: dict[str, bytes] = {}
        gradient: np.ndarray | None = None
        deadline = time.monotonic() + self._timeouts.round_s
        waiting = lambda: not set(contributors) & set(self._active) <= set(digests)  # noqa: E731
        while waiting():
            got = self._next_message(deadline, waiting)
            if got is None:
                break
            sender, message = got
            if not (isinstance(message, Released) and message.round == round_number and sender in contributors):
                self._parties.reject(sender, message, f"expected the release of round {round_number}")
            elif sender in digests:
                self._parties.reject(sender, message, f"second release of round {round_number}")
            elif sender != releaser and message.mean_gradient:
                self._parties.reject(sender, message, f"only {releaser} sends the mean gradient")
            elif sender != releaser:
                digests[sender] = message.digest
            elif (gradient := self._mean_gradient_in(sender, message)) is not None:
                digests[sender] = message.digest
        for name in contributors:
            if gradient is not None:
                break
            if name in digests and name in self._active:
                gradient = self._requested_mean(name, round_number, digests[name], deadline)
                releaser = name
        if gradient is None:
            raise ProtocolError(f"no contributor released the mean gradient of round {round_number}")
        expected = release_digest(round_number, gradient.tobytes())
        disagreeing = sorted(name for name, digest in digests.items() if digest != expected)
        if disagreeing:
            raise ProtocolError(
                f"round {round_number}: {', '.join(disagreeing)} decrypted a different sum than {releaser} (wrong key?)"
            )
        for name in set(contributors) - set(digests):
            self._drop(name, f"did not confirm round {round_number}")
        return gradient

    def _requested_mean(self, name: str, round_number: int, digest: bytes, deadline: float) -> np.ndarray | None:
        """The mean gradient ``name`` released, asked for because the first contributor left before sending it."""
        self._parties.send(name, MeanRequest(round=round_number))
        while (got := self._next_message(deadline, lambda: name in self._active)) is not None:
            sender, message = got
            if not (isinstance(message, Released) and sender == name and message.round == round_number):
                self._parties.reject(sender, message, f"expected {name}'s mean gradient of round {round_number}")
                continue
            gradient = self._mean_gradient_in(sender, message)
            if gradient is not None and message.digest == digest:
                return gradient
            if gradient is not None:
                self._parties.reject(sender, message, "a mean gradient other than the one it stated")
        return None

    def _mean_gradient_in(self, sender: str, message: Released) -> np.ndarray | None:
        """The mean gradient a release carries, or None (rejected) if it is not the model's size or not finite."""
        try:
            return float32_values(message.mean_gradient, self._mechanism.dimension, "the mean gradient")
        except MessageError as error:
            self._parties.reject(sender, message, str(error))
            return None

    # -- helpers --------------------------------------------------------------------------------

    def _next_message(self, deadline: float, waiting: Callable[[], bool] = lambda: True) -> tuple[str, Message] | None:
        """The next valid message before ``deadline``, or None once it passes or ``waiting()`` turns false
        (a hospital that says Hello again leaves the round: what a round waits for may change)."""
        while waiting() and (got := self._parties.next_message(deadline)) is not None:
            sender, message = got
            if isinstance(message, Hello) and self._rounds_open:
                self._hello_again(sender, message)
            else:
                return got
        return None

    def _hello_again(self, sender: str, message: Hello) -> None:
        """A hospital of the run that connected again (it or this server restarted): welcomed before the next round."""
        if sender not in self._config.hospitals:
            self._parties.reject(sender, message, "not a hospital of this run")
            return
        if sender in self._joining:
            self._parties.reject(sender, message, "already joining")
            return
        if sum(join["hospital"] == sender for join in self._joins) >= _MAX_JOINS_AGAIN:
            # Each join mid-round costs the round, and every contributor is charged for it.
            reason = f"joined again {_MAX_JOINS_AGAIN} times; not welcomed any more"
            if sender in self._active:
                self._drop(sender, reason)
            else:
                self._parties.send(sender, Finish(reason=reason))
            return
        if sender in self._active:
            self._active.remove(sender)  # whatever it had in flight is gone: a round waits for it no longer
            log.warning("%s connected again; it joins again before the next round", sender)
        self._joining.append(sender)

    def _drop(self, name: str, reason: str, *, notify: bool = True) -> None:
        if name in self._active:
            self._active.remove(name)
            self._departures[name] = reason
            log.warning("%s leaves the run: %s", name, reason)
            if notify:
                self._parties.send(name, Finish(reason=reason))

    def _finish_round(self, record: _RoundRecord) -> None:
        self._rounds.append(record)
        self._save_checkpoint()
        self._on_round(dataclasses.asdict(record))

    def _save_checkpoint(self, *, required: bool = False) -> None:
        """Write the checkpoint. If the system refuses (a full disk, no descriptor left), the one before
        stands: after a round the run goes on and says so, but no round starts (``required``) before its
        number is on disk."""
        checkpoint = Checkpoint(
            config=self._config.to_dict(),
            initial_parameters=self._initial_parameters.tobytes(),
            parameters=get_flat_parameters(self._model).tobytes(),
            optimizer_state=self._shared.state().tobytes(),
            rounds_started=self._rounds_started,
            active=self._active + self._joining,  # whom a resumed server waits for
            rounds=[dataclasses.asdict(r) for r in self._rounds],
            departures=dict(self._departures),
            joins=list(self._joins),
        )
        try:
            write_retrying(lambda: checkpoint.save(self._out_dir), "the checkpoint")
        except CheckpointError as error:
            if required:
                raise ProtocolError(f"{error}; no round starts before its number is on disk") from None
            self._write_failures.append(str(error))
            log.warning("%s; the one before stands", error)

    def _report(self, finish_reason: str) -> dict:
        released = self._released()
        selected = _selected_on_validation(released)
        return {
            "config": self._config.to_dict(),
            "bfv": self._params.to_dict(),
            "mechanism": self._mechanism_report(),
            "parameter_count": self._parameter_count,
            "finish_reason": finish_reason,
            "run_fingerprint": self._run,
            "rounds": [dataclasses.asdict(r) for r in self._rounds],
            "final": {
                "rounds_released": len(released),
                "validation_accuracy": released[-1].validation_accuracy if released else None,
                "selected": None if selected is None else {
                    "round": selected.round, "validation_accuracy": selected.validation_accuracy, "test": selected.test, "model": SELECTED_MODEL_FILE,
                },  # fmt: skip
                "epsilon": self._ledger.epsilons(self._config.delta),
                "epsilon_levels": self._epsilon_levels(),
                "delta": self._config.delta,
                "accountant": ACCOUNTANT,
            },
            "phase_seconds": self._phase_seconds,
            "rejected_messages": self._parties.rejections.total,
            "dropped_messages_over_rate": dict(self._transport.dropped),
            "connection_limits": self._transport.limits,
            "write_failures": list(self._write_failures),
            "transcript_records_lost": self._transcript.lost if self._transcript else 0,
            "departures": self._departures,
            "joins": self._joins,
            "resumed": self._resumed_from is not None,
            "bytes_received": dict(self._transport.bytes_received),
            "bytes_sent": dict(self._transport.bytes_sent),
        }

    def _mechanism_report(self) -> dict:
        bound = self._mechanism.sum_bound(
            contributors=len(self._config.hospitals), expected_batch_size=self._config.training.rows_per_share
        )
        return {
            "name": "distributed Skellam, conditional randomized rounding of each row: an example gradient or a sub-client update (training.skellam)",
            **dataclasses.asdict(self._mechanism),
            "sum_bound": bound.levels,
            "wrap_probability_per_round": bound.wrap_probability,
        }

    def _write_outputs(self, report: dict) -> None:
        write_retrying(lambda: write_report(self._out_dir, report), "the server's report")
        write_retrying(lambda: _save_model(self._model, self._out_dir / "model.pt"), "the final model")


def _save_model(model: torch.nn.Module, path: Path) -> None:
    """The model's weights, replaced whole: a write the disk refuses leaves the file before it intact."""
    serialized = io.BytesIO()
    torch.save(model.state_dict(), serialized)
    replace_file(path, serialized.getvalue())


def _checkpointed_config(checkpoint: Checkpoint, out_dir: Path) -> RunConfig:
    try:
        return RunConfig.from_dict(checkpoint.config)
    except ConfigError as error:
        raise CheckpointError(f"the checkpoint in {out_dir} holds an unusable configuration: {error}") from None


def _selected_on_validation(released: list[_RoundRecord]) -> _RoundRecord | None:
    """The round a user would keep, chosen on validation accuracy alone (the earliest of ties).

    Only such a round is scored on test: the last round's test scores, or the best on test, would flatter the method.
    """
    return max(released, key=lambda r: (r.validation_accuracy, -r.round), default=None)
