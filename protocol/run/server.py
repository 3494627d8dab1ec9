"""The server (aggregator): adds ciphertexts it cannot read, and learns only what hospitals release.

It holds the run configuration, a ``PublicContext`` (BFV parameters, no key), its copy of the model
(``protocol.run.run_model``), moved only by the DP-protected sums the hospitals' releases open, and
the run's privacy ledger. No key outlives a round: each upload is under a one-time key whose shares
the other hospitals hold and release only for one sum every contributor endorsed
(``docs/explanation/secure-round.md``).

A run is a join and rounds (``protocol.wire.messages`` shows the sequence). This module is the run's
phases; ``protocol.run.round_steps`` opens a round's sum, ``protocol.secure_round`` holds the checks made at
each step, ``protocol.run.blame`` whom a failed round drops, ``protocol.run.server_report`` what is
reported. Every wait has a deadline. A message that fails validation, is out of sequence, or comes from
a party with nothing to say at that point is logged as rejected and changes nothing. A round with
fewer contributions than the quorum, or that a member refuses or does not answer in time, is aborted
and its sum never opened. Hospitals may join again between rounds (``protocol.run.participants``),
and a server that stopped goes on from its checkpoint (``protocol.run.checkpoint``, ``Server.resume``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable

from consilium.crypto.bfv import PublicContext
from consilium.crypto.insecure_plaintext import InsecurePlaintextSum
from consilium.protocol.run.checkpoint import Checkpoint, CheckpointError, save_checkpoint, write_report, write_retrying
from consilium.protocol.run.config import INSECURE_PLAINTEXT, RunConfig
from consilium.protocol.run.rules import ConfigError
from consilium.protocol.wire.messages import TO_SERVER, BoxKey, ProtocolError, RoundAbort, Welcome
from consilium.protocol.secure_round.box_keys import CertifiedBoxKeys
from consilium.protocol.secure_round.sum_round import SumRound
from consilium.protocol.run.round_steps import RoundSteps, confirm, open_plaintext
from consilium.protocol.run.participants import Timeouts, run_to_the_end
from consilium.protocol.run.server_connections import ServerConnections
from consilium.protocol.run.run_model import RunModel
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.secure_round.collection import collect_updates
from consilium.protocol.run.server_report import RoundRecord, RunRecord, mechanism_report, run_selection, save_model
from consilium.protocol.wire.transport import DEFAULT_MAX_MESSAGES_PER_SECOND, ServerTransport
from consilium.training.privacy.ledger import LEDGER_FILE, PrivacyLedger
from consilium.training.data.datasets import Split
from consilium.protocol.run.blame import Blame
from consilium.training.models.evaluation import Selection

__all__ = ["Server"]


log = logging.getLogger("consilium.server")


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
        model_seed: int | None = None,
        selection: Selection | None = None,
        listen: str | None = None,
        transport: ServerTransport | None = None,
        _checkpoint: Checkpoint | None = None,
    ) -> None:
        roster.check_own_entry(credentials)
        self._selection = run_selection(selection, _checkpoint, out_dir)
        ledger_path = _ledger_path(out_dir, resumed=_checkpoint is not None)
        self._config = config
        self._roster = roster
        self._validation = validation
        self._out_dir = out_dir
        self._timeouts = timeouts
        self._on_round = on_round or (lambda record: None)
        self._model = RunModel(config, seed=model_seed)  # a resumed run takes its checkpoint's
        self._params = config.bfv_parameters()
        # Charged at the method's first level, as the hospitals' ledgers are.
        ledger = PrivacyLedger(ledger_path, key=credentials.ledger_key)
        self._record = RunRecord(
            config,
            self._model.shared.mechanism,
            ledger,
            out_dir,
            test,
            coalition=config.coalition(len(roster.hospitals)),
            selection=self._selection,
        )
        self._public: PublicContext | None = None
        self._box_keys = CertifiedBoxKeys(roster.identities(config.hospitals))
        self._run = ""  # RunConfig.fingerprint of what every hospital is welcomed with, once known
        self._rounds_started = 0
        self._resumed_from = _checkpoint
        membership = ({}, [], []) if _checkpoint is None else self._restore(_checkpoint)
        self._open_channels(
            credentials,
            membership,
            transcript=transcript,
            transcript_payloads=transcript_payloads,
            max_messages_per_second=max_messages_per_second,
            listen=listen,
            transport=transport,
        )

    def _open_channels(self, credentials: Credentials, membership: tuple[dict, list, list], **settings) -> None:
        """The server's socket, open to the roster's hospitals only, its transcript, and who takes part."""
        config = self._config
        self._connections = ServerConnections.open(
            self._roster,
            credentials,
            hospitals=config.hospitals,
            accept=TO_SERVER,
            limit=config.message_limit(),
            log=log,
            **settings,
        )
        self._participants = participants = self._connections.participants
        departures, joins, expelled = membership
        participants.restore(active=[], departures=departures, joins=joins, expelled=expelled)
        self._blame = Blame(participants.expel, lambda: self._config)
        self._steps = RoundSteps(
            participants,
            self._blame,
            round_s=self._timeouts.round_s,
            abort=self._abort,
            save_checkpoint=self._save_checkpoint,
        )

    @property
    def config(self) -> RunConfig:
        return self._config

    @classmethod
    def resume(cls, *, out_dir: Path, **settings) -> "Server":
        """The server of the run checkpointed in ``out_dir``, to go on where it stopped (``protocol.run.checkpoint``)."""
        checkpoint = Checkpoint.load(out_dir)
        return cls(
            config=checkpoint.run_config(RunConfig, out_dir), out_dir=out_dir, _checkpoint=checkpoint, **settings
        )

    @staticmethod
    def checkpointed_config(out_dir: Path) -> RunConfig:
        """The configuration of the run checkpointed in ``out_dir``, read without touching anything (``CheckpointError``)."""
        return Checkpoint.load(out_dir).run_config(RunConfig, out_dir)

    def run(self) -> dict:
        """Run the federation to its end; returns (and writes) the server's report."""
        return run_to_the_end(
            self._run_all,
            finish=self._participants.finish,
            report=self._report,
            write_outputs=self._write_outputs,
            close=self._close,
        )

    # -- phases ---------------------------------------------------------------------------------

    def _run_all(self) -> str:
        """Join, then the rounds; returns why the run ended."""
        participants = self._participants
        started = time.perf_counter()
        if self._resumed_from is None:
            self._join()
        else:
            participants.await_hellos(set(self._resumed_from.active), time.monotonic() + self._timeouts.join_s)
        self._record.phase_seconds["join"] = time.perf_counter() - started
        started = time.perf_counter()
        self._admit()
        self._record.phase_seconds["welcome"] = time.perf_counter() - started
        quorum = self._config.training.quorum
        for round_number in range(self._rounds_started + 1, self._config.rounds + 1):
            participants.read_between_rounds()
            rejoin_by = time.monotonic() + self._timeouts.rejoin_s
            while True:  # welcome who said Hello; below the quorum, wait for those that fell silent
                for _ in range(2):  # and once more for those that said Hello while others were being welcomed
                    if participants.joining:
                        self._admit()
                done = len(participants.active) >= quorum or time.monotonic() >= rejoin_by
                if done or not participants.await_return(quorum, rejoin_by):
                    break
            if len(participants.active) < quorum:
                break
            self._run_round(round_number)
        if len(participants.active) + len(participants.joining) < quorum:
            return participants.shortfall(quorum)
        return "completed all rounds"

    def _join(self) -> None:
        """The hospitals that say Hello in time make up the run; its settings and fingerprint follow."""
        self._participants.await_hellos(set(self._config.hospitals), time.monotonic() + self._timeouts.join_s)
        joined = set(self._participants.joining)
        if len(joined) < self._config.training.quorum:
            raise ProtocolError(
                f"only {len(joined)} of {len(self._config.hospitals)} hospitals joined within {self._timeouts.join_s:g} s; "
                f"the quorum is {self._config.training.quorum}"
            )
        self._config = dataclasses.replace(
            self._config, hospitals=tuple(h for h in self._config.hospitals if h in joined)
        )
        self._participants.narrow_to(self._config.hospitals)
        self._params = self._config.bfv_parameters()
        self._public = PublicContext(self._params)
        self._run = self._model.fingerprint(self._config)
        self._record.begin_run(self._run)

    def _admit(self) -> None:
        """Welcome the hospitals that said Hello to the model as it is now; each answers with its box key
        for the next round (``protocol.secure_round.box_keys``), or is turned away."""
        next_round = self._rounds_started + 1
        welcome = Welcome(
            config=self._config.to_dict(),
            **self._model.arrays(),
            next_round=next_round,
            server_wait_s=self._timeouts.server_silence_s(),
        )

        def box_key(sender: str, message) -> str:
            if not isinstance(message, BoxKey):
                return "expected a box key"
            return self._take_box_key(sender, message.round, message.certified_key, next_round)

        participants = self._participants
        participants.welcome(
            welcome, before_round=next_round, timeout_s=self._timeouts.key_s, awaited="box key", answer=box_key
        )
        log.info("%d hospitals take part; the server holds parameters only", len(participants.active))
        participants.open_rounds()
        self._save_checkpoint()

    def _take_box_key(self, name: str, round_number: int, certified: bytes, expected_round: int) -> str:
        """Keep ``name``'s box key for ``round_number``; or say why not."""
        if self._config.aggregation == INSECURE_PLAINTEXT:
            return ""  # nothing is sealed in the plaintext benchmark
        return self._box_keys.keep(self._run, name, round_number, certified, expected_round=expected_round)

    def _run_round(self, round_number: int) -> None:
        training, participants, timeout_s = self._model.shared.settings, self._participants, self._timeouts.round_s
        record = RoundRecord(round=round_number, status="aborted", contributors=[], round_state=training.round_state())
        insecure = self._config.aggregation == INSECURE_PLAINTEXT
        quorum = self._config.training.quorum
        self._rounds_started = round_number  # on disk before RoundStart leaves (RoundSteps.start)
        box_keys = self._steps.start(record, None if insecure else self._box_keys, quorum)
        if box_keys is None:
            return
        started = time.perf_counter()
        setting = self._config.round_setting(self._run, round_number, self._params) if not insecure else None
        total = SumRound(setting, self._public) if setting else InsecurePlaintextSum(self._params)
        updates, record.seconds["aggregate"] = collect_updates(
            participants, total, round_number, timeout_s, box_keys=box_keys, identities=self._identities()
        )
        record.update_bytes = {name: update.upload_bytes() for name, update in updates.items()}
        # One that said Hello again since its upload is joining again: the others' sum goes on without it (review 4, finding 9).
        record.contributors = [
            name for name in self._config.hospitals if name in updates and name in participants.active
        ]
        record.seconds["collect"] = time.perf_counter() - started
        if round_number < self._config.rounds:  # each update carries its sender's box key for the next round
            for name, update in updates.items():
                if reason := self._take_box_key(name, round_number + 1, update.next_box_key, round_number + 1):
                    log.warning("%s's box key for round %d is refused: %s", name, round_number + 1, reason)
        if len(record.contributors) < quorum:
            self._abort(record, f"{len(record.contributors)} contributions, fewer than the quorum of {quorum}")
            return
        started = time.perf_counter()
        if insecure:
            mean = self._open_plaintext(record, total)
        else:
            mean = self._open_secure(record, total, updates, box_keys)
        if mean is None:
            return
        record.seconds["release"] = time.perf_counter() - started
        started = time.perf_counter()
        self._model.move(mean, len(record.contributors))
        self._record.score(record, self._model.network, self._validation)
        record.seconds["evaluate"] = time.perf_counter() - started
        self._record.account(record)
        self._finish_round(record)

    def _open_secure(self, record: RoundRecord, total: SumRound, updates: dict, box_keys: dict[str, bytes]):
        """The round's mean, once every member endorsed, proved and released (``protocol.run.round_steps``);
        None where the round was aborted."""
        summed = self._steps.open(
            record,
            total,
            updates,
            box_keys,
            self._identities(),
            public=self._public,
            previous_result=self._model.digest(),
            charge=lambda: self._charge(record),
        )
        return None if summed is None else self._confirmed(record, summed)

    def _open_plaintext(self, record: RoundRecord, total: InsecurePlaintextSum):
        """The plaintext benchmark's round: the sum goes back to the contributors as it is."""
        self._charge(record)
        return self._confirmed(record, open_plaintext(self._participants, record, total, self._params))

    def _confirmed(self, record: RoundRecord, summed):
        """The round's mean, once the members said which they applied (``protocol.run.round_steps.confirm``)."""
        mean = self._model.mean(summed, len(record.contributors))
        confirm(self._participants, record, mean, self._timeouts.round_s)
        return mean

    def _charge(self, record: RoundRecord) -> None:
        """Charge the ledger for the round's release, at the noise its contributors' sum carries."""
        coalition = self._config.coalition(len(self._roster.hospitals))
        self._record.charge(self._model.release(len(record.contributors), coalition), record.round)

    def _identities(self) -> dict:
        return self._roster.identities(self._config.hospitals)

    def _abort(self, record: RoundRecord, reason: str) -> None:
        """End a round whose sum nobody opens."""
        record.reason = reason
        for name in record.contributors:
            if name in self._participants.active:
                self._participants.parties.send(name, RoundAbort(round=record.round, reason=reason))
        log.warning("round %d aborted: %s; its sum is never opened", record.round, reason)
        self._finish_round(record)

    # -- persistence ----------------------------------------------------------------------------

    def _finish_round(self, record: RoundRecord) -> None:
        self._participants.end_round()
        self._record.rounds.append(record)
        self._save_checkpoint()
        self._on_round(dataclasses.asdict(record))

    def _save_checkpoint(self, *, required: bool = False) -> None:
        """Write the checkpoint. If the system refuses (a full disk, no descriptor left), the one before
        stands: after a round the run goes on and says so, but no round starts (``required``) before its
        number is on disk."""
        participants = self._participants
        checkpoint = Checkpoint(
            config=self._config.to_dict(),
            **self._model.arrays(),
            rounds_started=self._rounds_started,
            active=participants.active + participants.joining,  # whom a resumed server waits for
            rounds=[dataclasses.asdict(r) for r in self._record.rounds],
            departures=dict(participants.departures),
            selection=dataclasses.asdict(self._selection),
            joins=list(participants.joins),
            expelled=sorted(participants.expelled),
        )
        if failure := save_checkpoint(checkpoint, self._out_dir, required=required):
            self._record.write_failures.append(failure)

    def _restore(self, checkpoint: Checkpoint) -> tuple[dict[str, str], list[dict], list[str]]:
        """Go on from ``checkpoint``; returns the departures, joins and expulsions it recorded."""
        try:
            self._model.load(checkpoint, whose="its")
        except ValueError as error:  # a MessageError among them
            raise CheckpointError(f"the checkpoint in {self._out_dir} is unusable: {error}") from None
        membership = checkpoint.membership(self._out_dir)
        self._run = self._model.fingerprint(self._config)
        self._rounds_started = self._record.resume(self._run, checkpoint, self._out_dir)
        self._public = PublicContext(self._params)
        return membership

    def _report(self, finish_reason: str) -> dict:
        self._record.end_selection(self._model.network)  # the model is the last released round's
        return {
            "config": self._config.to_dict(),
            "bfv": self._params.to_dict(),
            "mechanism": mechanism_report(self._model.shared.mechanism, self._config),
            "parameter_count": self._model.parameter_count,
            "finish_reason": finish_reason,
            "run_fingerprint": self._run,
            **self._record.report(),
            "resumed": self._resumed_from is not None,
            **self._connections.report(),
        }

    def _write_outputs(self, report: dict) -> None:
        write_retrying(lambda: write_report(self._out_dir, report), "the server's report")
        write_retrying(lambda: save_model(self._model.network, self._out_dir / "model.pt"), "the final model")

    def _close(self) -> None:
        self._connections.close()


def _ledger_path(out_dir: Path, *, resumed: bool) -> Path:
    """Where the run's ledger lives; ``ConfigError`` where a new run would mix its ledger with another's."""
    path = out_dir / LEDGER_FILE
    if not resumed and path.exists():
        raise ConfigError(
            f"{out_dir} already holds a run (its ledger would mix two runs); choose another --out, or --resume it"
        )
    return path
