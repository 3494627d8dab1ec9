"""The server (aggregator): adds ciphertexts it cannot read, and learns only what hospitals release.

It holds the run configuration, a ``PublicContext`` (BFV parameters, no key), its copy of the model,
moved only by the DP-protected sum the hospitals' releases open, and the run's privacy ledger. No
key outlives a round: each upload is under a one-time key whose shares the other hospitals hold and
release only for one sum every contributor endorsed (``docs/explanation/secure-round.md``).

A run is a join and rounds (``protocol.wire.messages`` shows the sequence); this module is the rounds'
phases, ``protocol.secure_round`` the checks it makes at each, ``protocol.run.blame`` whom a failed
round drops, ``protocol.run.server_report`` what it reports. Every wait has a deadline. A message that
fails validation, is out of sequence, or comes from a party with nothing to say at that point is
logged as rejected and changes nothing. A round with fewer contributions than the quorum is aborted
and its sum never opened; one that a member refuses, or does not answer in time, is aborted, with
whom the refusals name; a hospital that misses a deadline is dropped from the run.

Hospitals of the run may join again (``protocol.run.participants``): one that says Hello after the run
began (restarted, or its connection made again) leaves the round under way and is welcomed before the
next one, to the model and its update rule's state as they are then, answering with a box key. The server checkpoints what it needs to resume after a crash
(``protocol.run.checkpoint``); ``Server.resume`` goes on from it, and the hospitals, which notice the new
connection, join again by themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable

from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.insecure_plaintext import InsecurePlaintextSum, InsecurePlaintextUploads
from consilium.crypto.sealed_box import SealedBoxError, verify_certified_key
from consilium.protocol.wire.channel import PartyChannels
from consilium.protocol.run.checkpoint import Checkpoint, CheckpointError, save_checkpoint, write_report, write_retrying
from consilium.protocol.run.config import INSECURE_PLAINTEXT, RunConfig
from consilium.protocol.run.rules import ConfigError
from consilium.protocol.wire.messages import (
    TO_SERVER,
    Aggregate,
    BoxKey,
    Confirmed,
    Endorsement,
    Endorsements,
    MessageError,
    Proof,
    Proofs,
    ProtocolError,
    Release,
    Releases,
    RoundAbort,
    RoundStart,
    Welcome,
    float32_values,
    release_digest,
)
from consilium.protocol.secure_round.statement import (
    Endorsed,
    Proved,
    RoundRefused,
    box_key_context,
    released_from,
    state_digest,
)
from consilium.protocol.secure_round.sum_round import SumRound
from consilium.protocol.run.participants import Participants, Timeouts, join_record, run_to_the_end
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.secure_round.collection import collect_from_members, collect_updates
from consilium.protocol.run.server_report import RoundRecord, RunRecord, mechanism_report, save_model
from consilium.protocol.wire.transcript import Transcript
from consilium.protocol.wire.transport import DEFAULT_MAX_MESSAGES_PER_SECOND, ServerTransport
from consilium.training.privacy.ledger import LEDGER_FILE, PrivacyLedger
from consilium.training.data.datasets import Split
from consilium.protocol.run.blame import Blame, Evidence
from consilium.training.models.evaluation import Selection
from consilium.training.methods.registry import SharedState, ledger_release
from consilium.training.models.build import build_model, get_flat_parameters, set_flat_parameters

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
        _checkpoint: Checkpoint | None = None,
    ) -> None:
        roster.check_own_entry(credentials)
        self._selection = _selection_of(selection, _checkpoint, out_dir)
        ledger_path = out_dir / LEDGER_FILE
        if _checkpoint is None and ledger_path.exists():
            raise ConfigError(
                f"{out_dir} already holds a run (its ledger would mix two runs); choose another --out, or --resume it"
            )
        self._config = config
        self._roster = roster
        self._validation = validation
        self._out_dir = out_dir
        self._timeouts = timeouts
        self._on_round = on_round or (lambda record: None)
        self._model = build_model(config.model, seed=model_seed)  # a resumed run takes its checkpoint's
        self._shared = SharedState(config.training, self._model)
        self._params = config.bfv_parameters()
        self._mechanism = self._shared.mechanism
        # Charged at the method's first level, as the hospitals' ledgers are.
        ledger = PrivacyLedger(ledger_path, key=credentials.ledger_key)
        self._record = RunRecord(
            config,
            self._mechanism,
            ledger,
            out_dir,
            test,
            coalition=config.coalition(len(roster.hospitals)),
            selection=self._selection,
        )
        self._public: PublicContext | None = None
        self._box_keys: dict[str, tuple[int, bytes]] = {}  # hospital -> (round, its certified box key for it)
        self._run = ""  # RunConfig.fingerprint of what every hospital is welcomed with, once known
        self._rounds_started = 0
        self._resumed_from = _checkpoint
        membership: tuple[dict, list] = ({}, [])
        if _checkpoint is None:
            self._initial_parameters = get_flat_parameters(self._model)  # the ledger's run begins once the run is named
        else:
            membership = self._restore(_checkpoint)
        self._open_channels(credentials, transcript, transcript_payloads, max_messages_per_second, membership)

    def _open_channels(
        self,
        credentials: Credentials,
        transcript: Path | None,
        transcript_payloads: bool,
        max_messages_per_second: float,
        membership: tuple[dict, list],
    ) -> None:
        """The server's socket, open to the roster's hospitals only, its transcript, and who takes part."""
        config, roster, limit = self._config, self._roster, self._config.message_limit()
        enrolled = {roster.party(name).curve_public: name for name in config.hospitals}
        address, rate = roster.server_address, max_messages_per_second
        self._transport = ServerTransport(address, credentials.curve, enrolled, limit, rate)
        self._transcript = (
            Transcript(transcript, payloads=transcript_payloads, max_payload_bytes=limit) if transcript else None
        )
        parties = PartyChannels(self._transport, accept=TO_SERVER, limit=limit, log=log, transcript=self._transcript)
        self._participants = Participants(parties, config.hospitals, log)
        departures, joins = membership
        self._participants.restore(active=[], departures=departures, joins=joins)
        self._blame = Blame(self._participants.drop, lambda: self._config)

    @property
    def config(self) -> RunConfig:
        return self._config

    @classmethod
    def resume(cls, *, out_dir: Path, **settings) -> "Server":
        """The server of the run checkpointed in ``out_dir``, to go on where it stopped (``protocol.run.checkpoint``)."""
        checkpoint = Checkpoint.load(out_dir)
        return cls(
            config=_checkpointed_config(checkpoint, out_dir), out_dir=out_dir, _checkpoint=checkpoint, **settings
        )

    @staticmethod
    def checkpointed_config(out_dir: Path) -> RunConfig:
        """The configuration of the run checkpointed in ``out_dir``, read without touching anything (``CheckpointError``)."""
        return _checkpointed_config(Checkpoint.load(out_dir), out_dir)

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
            for _ in range(2):  # and once more for those that said Hello while others were being welcomed
                if participants.joining:
                    self._admit()
            if len(participants.active) < quorum:
                break
            self._run_round(round_number)
        remaining = len(participants.active) + len(participants.joining)  # (one joining again is still in the run)
        if remaining < quorum:
            return f"only {remaining} hospitals remain, fewer than the quorum of {quorum}"
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
        self._run = self._config.fingerprint(self._initial_parameters.tobytes())
        self._record.begin_run(self._run)

    def _admit(self) -> None:
        """Welcome the hospitals that said Hello to the model as it is now; each answers with its box key
        for the next round (``protocol.secure_round.statement.box_key_context``), or is turned away."""
        participants, timeout_s = self._participants, self._timeouts.key_s
        deadline, next_round = time.monotonic() + timeout_s, self._rounds_started + 1
        welcome = Welcome(
            config=self._config.to_dict(),
            initial_parameters=self._initial_parameters.tobytes(),
            parameters=get_flat_parameters(self._model).tobytes(),
            optimizer_state=self._shared.state().tobytes(),
            next_round=next_round,
            server_wait_s=self._timeouts.server_silence_s(),
        )
        newcomers = participants.take_joining()
        for name in newcomers:
            participants.parties.send(name, welcome)
        ready: list[str] = []
        while set(ready) != set(newcomers) and (got := participants.next_message(deadline)) is not None:
            sender, message = got
            if sender not in newcomers or sender in ready or not isinstance(message, BoxKey):
                participants.parties.reject(sender, message, "expected nothing while hospitals join")
            elif reason := self._take_box_key(sender, message.round, message.certified_key, next_round):
                participants.parties.reject(sender, message, reason)
            else:
                ready.append(sender)
        for name in (
            set(newcomers) - set(ready) - set(participants.joining)
        ):  # (one that said Hello again is welcomed again)
            participants.turn_away(name, f"sent no box key within {timeout_s:g} s")
        # A Hello instead of a box key is a join too: it counts towards the cap, so that no hospital can
        # keep the server welcoming it while the others wait (review 4, finding 3).
        participants.joins += [
            {"hospital": name, "before_round": next_round, "broke_round": True}
            for name in newcomers
            if name in participants.joining
        ]
        participants.admit(ready, before_round=next_round)
        log.info("%d hospitals take part; the server holds parameters only", len(participants.active))
        participants.open_rounds()
        self._save_checkpoint()

    def _take_box_key(self, name: str, round_number: int, certified: bytes, expected_round: int) -> str:
        """Keep ``name``'s box key for ``round_number``; or say why not."""
        if self._config.aggregation == INSECURE_PLAINTEXT:
            return ""  # nothing is sealed in the plaintext benchmark
        if round_number != expected_round:
            return f"a box key for round {round_number}, not {expected_round}"
        try:
            verify_certified_key(
                certified,
                signer=self._roster.party(name).identity.signing,
                context=box_key_context(self._run, name, round_number),
            )
        except SealedBoxError as error:
            return f"the box key is not {name}'s for round {round_number}: {error}"
        self._box_keys[name] = (round_number, certified)
        return ""

    def _run_round(self, round_number: int) -> None:
        training, participants, timeout_s = self._shared.settings, self._participants, self._timeouts.round_s
        record = RoundRecord(round=round_number, status="aborted", contributors=[], round_state=training.round_state())
        insecure = self._config.aggregation == INSECURE_PLAINTEXT
        quorum = self._config.training.quorum
        box_keys = self._start_round(record, insecure)
        if box_keys is None:
            return
        started = time.perf_counter()
        setting = self._config.round_setting(self._run, round_number, self._params) if not insecure else None
        total = SumRound(setting, self._public) if setting else InsecurePlaintextSum(self._params)
        identities = self._identities()
        boxes_checked = (
            (lambda name, update: total.box_refusal(name, update.chunks, update.boxes, box_keys, identities))
            if setting
            else (lambda name, update: "")
        )
        updates, record.seconds["aggregate"] = collect_updates(
            participants, total, round_number, timeout_s, boxes_for=set(box_keys), check=boxes_checked
        )
        record.update_bytes = {
            name: sum(map(len, update.chunks)) + sum(map(len, update.boxes.values()))
            for name, update in updates.items()
        }
        # One that said Hello again since its upload is joining again: the others' sum goes on without it (review 4, finding 9).
        record.contributors = [
            name for name in self._config.hospitals if name in updates and name in participants.active
        ]
        record.seconds["collect"] = time.perf_counter() - started
        for name, update in updates.items():
            if round_number < self._config.rounds and (
                reason := self._take_box_key(name, round_number + 1, update.next_box_key, round_number + 1)
            ):
                log.warning("%s's box key for round %d is refused: %s", name, round_number + 1, reason)
        if len(record.contributors) < quorum:
            self._abort(record, f"{len(record.contributors)} contributions, fewer than the quorum of {quorum}")
            return
        started = time.perf_counter()
        if insecure:
            mean_gradient = self._open_plaintext(record, total)
        else:
            mean_gradient = self._open_secure(record, total, updates, box_keys)
        if mean_gradient is None:
            return
        record.seconds["release"] = time.perf_counter() - started
        started = time.perf_counter()
        self._shared.apply(mean_gradient, len(record.contributors))
        self._record.score(record, self._model, self._validation)
        record.seconds["evaluate"] = time.perf_counter() - started
        self._record.account(record)
        self._finish_round(record)

    def _start_round(self, record: RoundRecord, insecure: bool) -> dict[str, bytes] | None:
        """RoundStart, with the box keys, to the hospitals that hold one for this round; None, and the round
        aborted before anyone is charged, where fewer than the quorum do."""
        round_number, participants = record.round, self._participants
        self._rounds_started = round_number
        self._save_checkpoint(required=True)  # before RoundStart leaves: a resumed server never starts this round again
        for name in list(participants.active):
            if not insecure and self._box_keys.get(name, (0, b""))[0] != round_number:
                participants.drop(name, f"holds no box key for round {round_number}")
        quorum = self._config.training.quorum
        if len(participants.active) < quorum:
            self._abort(
                record,
                f"{len(participants.active)} hospitals hold a box key for this round, fewer than the quorum of {quorum}",
            )
            return None
        box_keys = {} if insecure else {name: self._box_keys[name][1] for name in participants.active}
        for name in participants.active:
            participants.parties.send(name, RoundStart(round=round_number, box_keys=box_keys))
        participants.begin_round()
        return box_keys

    def _open_secure(self, record: RoundRecord, total: SumRound, updates: dict, box_keys: dict[str, bytes]):
        """The round's mean, once every member endorsed, proved and released (``protocol.secure_round``);
        None where the round was aborted."""
        identities = self._identities()
        self._send_aggregates(record, total, updates, box_keys)
        try:
            evidence = Evidence(total, updates, box_keys, identities)
            releases = self._gather_releases(record, total, evidence, identities)
            if releases is None:
                return None
        except RoundRefused as refusal:
            self._abort(record, f"{refusal} (named: {', '.join(refusal.named) or 'nobody'})")
            return None
        try:
            slots = total.open(
                {n: released_from(self._public, r.share, r.masks, r.signature) for n, r in releases.items()},
                identities,
            )
        except RoundRefused as refusal:
            self._abort(record, f"{refusal} (named: {', '.join(refusal.named) or 'nobody'})")
            self._blame.failed_opening(refusal)
            return None
        self._blame.opened()
        members = record.contributors
        self._send_all(members, Releases.of(record.round, releases))
        digits = self._params.digits
        summed = digits.from_slots(slots[: digits.slots_for(self._params.vector_length)], self._params.vector_length)
        mean = self._shared.settings.read_sum(summed, len(members), self._shared.parameter_count)
        return self._confirmed(record, mean)

    def _send_aggregates(self, record: RoundRecord, total: SumRound, updates: dict, box_keys: dict[str, bytes]) -> None:
        """Each member gets the sum, every upload's digest, and the key shares the others dealt it."""
        members, number = record.contributors, record.round
        chunks = total.total(members, box_keys, round_state=record.round_state, previous_result=self._state_digest())
        digests = {name: total.digests[name] for name in members}
        for name in members:
            boxes = {dealer: updates[dealer].boxes[name] for dealer in members}
            self._participants.parties.send(
                name,
                Aggregate(
                    round=number, contributors=tuple(members), chunks=tuple(chunks), digests=digests, boxes=boxes
                ),
            )

    def _gather_releases(
        self, record: RoundRecord, total: SumRound, evidence: Evidence, identities: dict
    ) -> dict | None:
        """Endorsements, then proofs, then releases, each relayed once all are in; the ledger is charged before
        the proofs go out, since any tau releases after them open the sum. None where a step timed out."""
        members, number = record.contributors, record.round
        endorsements = self._step(
            record,
            Endorsement,
            "endorse the sum",
            lambda n, e: total.endorsement_refusal(n, _endorsed(e), identities[n]),
            evidence,
        )
        if endorsements is None:
            return None
        total.endorsed({n: _endorsed(e) for n, e in endorsements.items()}, identities)
        self._send_all(members, Endorsements.of(number, endorsements))
        proofs = self._step(
            record,
            Proof,
            "prove their dealing",
            lambda n, p: total.proof_refusal(n, _proved(p), identities[n]),
            evidence,
        )
        if proofs is None:
            return None
        evidence.proofs = {n: _proved(p) for n, p in proofs.items()}
        total.proved(evidence.proofs, identities)
        # From here on members release, and any tau releases open the sum: the ledger first (review 4, finding 12).
        coalition = self._config.coalition(len(self._roster.hospitals))
        self._record.charge(ledger_release(self._shared.settings, self._mechanism, len(members), coalition), number)
        self._send_all(members, Proofs.of(number, proofs))
        return self._step(
            record, Release, "release", lambda n, r: self._release_refusal(total, n, r, identities), evidence
        )

    def _open_plaintext(self, record: RoundRecord, total: InsecurePlaintextSum):
        """The plaintext benchmark's round: the sum goes back to the contributors as it is."""
        chunks, members = total.to_chunks(), record.contributors
        self._record.charge(
            ledger_release(
                self._shared.settings,
                self._mechanism,
                len(members),
                self._config.coalition(len(self._roster.hospitals)),
            ),
            record.round,
        )
        self._send_all(
            members,
            Aggregate(round=record.round, contributors=tuple(members), chunks=tuple(chunks), digests={}, boxes={}),
        )
        summed = InsecurePlaintextUploads(self._params).decrypt_sum(
            chunks, round_number=record.round, contributors=members
        )
        return self._confirmed(
            record, self._shared.settings.read_sum(summed, len(members), self._shared.parameter_count)
        )

    def _confirmed(self, record: RoundRecord, mean):
        """``mean``, once every member still in the round said it applied the same; a member that applied
        another, or refused the opened sum, leaves the run: its model has left the run's (review 4,
        finding 10). One that said Hello again takes the model as it is when it is welcomed."""
        expected = release_digest(record.round, mean.tobytes())
        confirmations, refusals = collect_from_members(
            self._participants,
            record.contributors,
            Confirmed,
            record.round,
            self._timeouts.round_s,
            every_member_needed=False,
        )
        for name, confirmation in confirmations.items():
            if confirmation.digest != expected:
                self._participants.drop(name, f"round {record.round}: it applied another mean than the sum's")
        for name, refusal in refusals.items():
            reason = f"{refusal.reason} (named: {', '.join(refusal.named) or 'nobody'})"
            self._participants.drop(name, f"round {record.round}: it refused the opened sum: {reason}")
        return mean

    def _step(self, record: RoundRecord, kind, what: str, check, evidence: Evidence):
        """Every member's ``kind`` message of the round, each passing ``check`` as it arrives, or None
        where one refused or fell silent (the round aborted). After the abort, which every member is told,
        a refusal's evidence is weighed (``Blame.weigh``), and the checkpoint saved again with whom it drops."""
        answers, refusals = collect_from_members(
            self._participants, record.contributors, kind, record.round, self._timeouts.round_s, check
        )
        if refusals:
            named = sorted({n for refusal in refusals.values() for n in refusal.named})
            reasons = "; ".join(f"{name}: {refusal.reason}" for name, refusal in sorted(refusals.items()))
            self._abort(
                record,
                f"refused by {', '.join(sorted(refusals))} ({reasons}; "
                f"named, unverified: {', '.join(named) or 'nobody'})",
            )
            self._blame.weigh(record.round, refusals, evidence)
            self._save_checkpoint()  # a resumed server must not let back in a member the evidence dropped
            return None
        if set(answers) != set(record.contributors):
            self._abort(record, f"{len(answers)} of {len(record.contributors)} contributors did {what}")
            return None
        return answers

    def _release_refusal(self, total: SumRound, name: str, message: Release, identities: dict) -> str:
        """Why a release is rejected (""); a member that signed wrong values leaves the run at once."""
        try:
            released = released_from(self._public, message.share, message.masks, message.signature)
        except BfvError as error:
            return f"{name}'s release is malformed: {error}"
        try:
            return total.release_refusal(name, released, identities[name])
        except RoundRefused as refusal:
            self._participants.drop(name, str(refusal))
            return str(refusal)

    def _send_all(self, members: list[str], message) -> None:
        for name in members:
            self._participants.parties.send(name, message)

    def _identities(self) -> dict:
        return {name: self._roster.party(name).identity.signing for name in self._config.hospitals}

    def _state_digest(self) -> bytes:
        """The model and update rule's state at the round's start: what every honest hospital holds too."""
        return state_digest(get_flat_parameters(self._model).tobytes(), self._shared.state().tobytes())

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
            initial_parameters=self._initial_parameters.tobytes(),
            parameters=get_flat_parameters(self._model).tobytes(),
            optimizer_state=self._shared.state().tobytes(),
            rounds_started=self._rounds_started,
            active=participants.active + participants.joining,  # whom a resumed server waits for
            rounds=[dataclasses.asdict(r) for r in self._record.rounds],
            departures=dict(participants.departures),
            selection=dataclasses.asdict(self._selection),
            joins=list(participants.joins),
        )
        if failure := save_checkpoint(checkpoint, self._out_dir, required=required):
            self._record.write_failures.append(failure)

    def _restore(self, checkpoint: Checkpoint) -> tuple[dict[str, str], list[dict]]:
        """Go on from ``checkpoint``; returns the departures and joins it recorded."""
        count = self._shared.parameter_count
        try:
            self._initial_parameters = float32_values(checkpoint.initial_parameters, count, "its initial model")
            set_flat_parameters(self._model, float32_values(checkpoint.parameters, count, "its model"))
            self._shared.load_state(
                float32_values(checkpoint.optimizer_state, self._shared.state().size, "its optimizer state")
            )
            rounds = [RoundRecord(**record) for record in checkpoint.rounds]
            if not all(type(r.round) is int for r in rounds):
                raise ValueError("round numbers must be integers")
            departures = {str(name): str(reason) for name, reason in dict(checkpoint.departures).items()}
            joins = [join_record(join) for join in checkpoint.joins]
        except (MessageError, TypeError, ValueError, KeyError) as error:
            raise CheckpointError(f"the checkpoint in {self._out_dir} is unusable: {error}") from None
        self._run = self._config.fingerprint(checkpoint.initial_parameters)
        charged_up_to = self._record.begin_run(self._run)
        self._record.restore(rounds)
        self._public = PublicContext(self._params)
        # Never a round number used before, even if the checkpoint on disk were older than the ledger.
        self._rounds_started = max(checkpoint.rounds_started, charged_up_to)
        if self._rounds_started > max((r.round for r in rounds), default=0):
            interrupted = "interrupted: the server stopped during this round"
            self._record.rounds.append(
                RoundRecord(round=self._rounds_started, status="aborted", contributors=[], reason=interrupted)
            )
        log.warning(
            "resuming run %s after round %d (its ledger last charged round %d)",
            self._config.run_id,
            self._rounds_started,
            charged_up_to,
        )
        return departures, joins

    def _report(self, finish_reason: str) -> dict:
        participants = self._participants
        self._record.end_selection(self._model)  # the model is the last released round's
        return {
            "config": self._config.to_dict(),
            "bfv": self._params.to_dict(),
            "mechanism": mechanism_report(self._mechanism, self._config),
            "parameter_count": self._shared.parameter_count,
            "finish_reason": finish_reason,
            "run_fingerprint": self._run,
            "rounds": [dataclasses.asdict(r) for r in self._record.rounds],
            "final": self._record.final(),
            "phase_seconds": self._record.phase_seconds,
            "rejected_messages": participants.parties.rejections.total,
            "dropped_messages_over_rate": dict(self._transport.dropped),
            "connection_limits": self._transport.limits,
            "write_failures": list(self._record.write_failures),
            "transcript_records_lost": self._transcript.lost if self._transcript else 0,
            "departures": participants.departures,
            "joins": participants.joins,
            "resumed": self._resumed_from is not None,
            "bytes_received": dict(self._transport.bytes_received),
            "bytes_sent": dict(self._transport.bytes_sent),
        }

    def _write_outputs(self, report: dict) -> None:
        write_retrying(lambda: write_report(self._out_dir, report), "the server's report")
        write_retrying(lambda: save_model(self._model, self._out_dir / "model.pt"), "the final model")

    def _close(self) -> None:
        self._transport.close()
        if self._transcript:
            self._transcript.close()


def _checkpointed_config(checkpoint: Checkpoint, out_dir: Path) -> RunConfig:
    try:
        return RunConfig.from_dict(checkpoint.config)
    except ConfigError as error:
        raise CheckpointError(f"the checkpoint in {out_dir} holds an unusable configuration: {error}") from None


def _endorsed(message: Endorsement) -> Endorsed:
    return Endorsed(message.hashes, message.commitment, message.signature)


def _proved(message: Proof) -> Proved:
    return Proved(message.seed, message.proof, message.signature)


def _selection_of(selection: Selection | None, checkpoint: Checkpoint | None, out_dir: Path) -> Selection:
    """The model selection a run uses: a resumed run keeps the one it began with, and refuses another."""
    if checkpoint is None:
        return selection or Selection()
    try:
        checkpointed = Selection(**checkpoint.selection)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"the checkpoint in {out_dir} is unusable: {error}") from None
    if selection not in (None, checkpointed):
        raise ConfigError(
            f"the checkpointed run selects its model on {checkpointed.on} among every {checkpointed.every}-th "
            f"round: resume it with --select-every {checkpointed.every} --select-on {checkpointed.on}, or "
            "without either flag"
        )
    return checkpointed
