"""A hospital: trains on its own data, encrypts what it sends, and keeps its own privacy ledger.

Per round it computes its noisy integer share with the run's method (``training.methods.registry``)
and uploads it under a key it draws for that upload alone, whose Shamir shares it seals to the other
hospitals; it endorses at most one sum a round, proves its dealing, releases its share of the sum's
key only once every contributor endorsed that same sum and every dealing to it checks, opens the
sum, applies its mean like every other party, and tells the server what it applied
(``protocol.secure_round``; ``docs/explanation/secure-round.md``). Where a check fails it refuses the
round, naming whom the check caught. It takes part only in a run of the method and aggregation mode
its own operator chose, training a model its own code builds (``protocol.run.config.accept_run``),
and, started by a service, within its site's policy (``protocol.run.site_policy``).

It does not trust the server's count of the privacy spent: before each update leaves (when nobody
knows how many hospitals will contribute), it charges its own durable ledger for the least noise a
decrypted sum can carry, a quorum's, refusing to take part once that would take its budget's view
over its budget (Dopamine, Algorithm 1, line 17). Ledger records are keyed by identifiers the
ledger draws, so a server cannot make releases count less by repeating a run id or a round.

**Joining again.** A hospital takes part in one run. If its connection to the server is made again
(the server restarted, say), or its process restarted, it says Hello again, accepts a Welcome only to
the run it began, takes the model the server has now, and takes part only in rounds after the last
its ledger charged: a restart on either side never releases an update twice or resets epsilon. Its
ledger records its endorsement and its release of a round before each leaves, and refuses to record
either twice. No key outlives its round.

Its encryption starts an offset after RoundStart that covers the step at the largest batch it will
draw, whatever the step took: compute time grows with the Poisson batch size, which DP does not
protect, and the server sees arrivals (``training.methods.step_timing``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import numpy as np

from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.sealed_box import SealedBoxError
from consilium.training.methods.step_timing import DEFAULT_SEND_OFFSET_S, SendOffset
from consilium.protocol.run.site_policy import DECLINED, MISFIT, Declined, Misfit, Offer
from consilium.protocol.run.config import INSECURE_PLAINTEXT, SECURE_AGGREGATION, RunConfig, accept_run, check_choices
from consilium.protocol.run.run_model import RunModel
from consilium.protocol.wire.messages import (
    TO_HOSPITAL,
    Aggregate,
    BoxKey,
    Confirmed,
    Endorsements,
    Finish,
    Proofs,
    ProtocolError,
    Refused,
    Releases,
    RoundAbort,
    RoundStart,
    Update,
    Welcome,
    Withdraw,
    release_digest,
)
from consilium.protocol.wire.codec import encode
from consilium.protocol.secure_round.box_keys import BoxKeyring
from consilium.protocol.secure_round.hospital_round import HospitalRound
from consilium.protocol.secure_round.member_messages import (
    endorsement,
    opened_sum,
    plaintext_sum,
    plaintext_update,
    proof,
    release,
    upload,
)
from consilium.protocol.secure_round.statement import RoundRefused, RoundSetting
from consilium.protocol.wire.channel import ServerChannel
from consilium.protocol.wire.transport import ClientTransport, TransportError
from consilium.protocol.run.hospital_metrics import Contribution, HospitalMetrics
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.training.privacy.accounting import Release as Charge
from consilium.training.privacy.ledger import LEDGER_FILE, PrivacyLedger
from consilium.training.privacy.budget import PrivacyBudget
from consilium.training.data.datasets import Split
from consilium.training.methods.registry import LocalStep, TrainingMethod
from consilium.training.models.build import ModelError, check_model_for

__all__ = ["Hospital"]

log = logging.getLogger("consilium.hospital")


class Hospital:
    def __init__(
        self,
        *,
        roster: Roster,
        credentials: Credentials,
        data: Split,
        budget: PrivacyBudget,
        state_dir: Path,
        timeout_s: float = 180.0,
        upgrade_ledger: bool = False,
        send_offset_s: float = DEFAULT_SEND_OFFSET_S,
        method: str,
        aggregation: str = SECURE_AGGREGATION,
        own_model: str | None = None,
        transport: ClientTransport | None = None,
        offer: Offer | None = None,
    ) -> None:
        roster.check_own_entry(credentials)
        self._name, self._roster, self._credentials = credentials.name, roster, credentials
        self._data, self._budget, self._state_dir = data, budget, state_dir
        self._upgrade_ledger = upgrade_ledger  # read an unchained (older) ledger once: its operator's say
        self._send_offset = SendOffset(send_offset_s)
        check_choices(method, aggregation)
        # This hospital's operator's choices; a server cannot change them.
        self._method, self._aggregation, self._own_model = method, aggregation, own_model
        self._ledger: PrivacyLedger | None = None
        # Set by the first Welcome, kept across joins: a hospital takes part in one run.
        self._config: RunConfig | None = None
        self._run = ""  # RunConfig.fingerprint
        self._identities: dict = {}
        self._model: RunModel | None = None
        self._step: LocalStep | None = None
        self._public: PublicContext | None = None
        self._box_keys = BoxKeyring(self._name, credentials.identity.signing)  # memory only
        self._last_round = 0  # the last round this hospital was charged for: it takes part only in later ones
        self._metrics = HospitalMetrics(state_dir, self._name)
        self._offer = offer  # a service's: the Welcome it took, its policy and its stop flag
        stop = offer.stop if offer else None
        self._channel = ServerChannel.connect(
            roster, credentials, accept=TO_HOSPITAL, timeout_s=timeout_s, log=log, transport=transport, stop=stop
        )

    def run(self) -> dict:
        """Take part until the server finishes the run or the budget is spent; returns the metrics."""
        finish_reason = ""
        try:
            welcomed = self._offer.welcome if self._offer else None
            finish_reason = self._channel.take_part(Welcome, self._take_part, self._name, welcomed)
        finally:
            if self._config is not None:
                self._metrics.write(self._config, finish_reason, rejected=self._channel.rejections.total)
            self._channel.close()
            if self._ledger is not None:
                self._ledger.close()
        return {"finish_reason": finish_reason, "rounds": self._metrics.rounds}

    def _take_part(self, welcome: Welcome) -> str:
        try:
            self._join(welcome)
        except ProtocolError as refusal:  # said, so that the server does not wait for it to come back
            # Why stays in this hospital's log: a misfit names facts of its data (its labels, shapes), a decline its policy.
            reason = DECLINED if isinstance(refusal, Declined) else MISFIT
            with contextlib.suppress(TransportError):  # the refusal is the error to report, not the send
                self._channel.send(Withdraw(round=0, reason=reason))
            raise
        return self._rounds_loop()

    def _join(self, welcome: Welcome) -> None:
        """Take the run's settings (the first time) and the model as it is now; then send a box key for the
        next round."""
        config = accept_run(
            welcome,
            name=self._name,
            method=self._method,
            aggregation=self._aggregation,
            roster_hospitals=self._roster.hospitals,
        )
        run = config.fingerprint(welcome.initial_parameters)
        if self._config is None:
            self._begin(config, run, welcome)
        elif run != self._run:
            raise ProtocolError(
                f"the server welcomed {self._name} to run {run}, not to the run it takes part in ({self._run})"
            )
        else:
            _load(self._model, welcome)
        self._channel.wait_at_least(welcome.server_wait_s)  # as long as the server may take (review 4, finding 7)
        self._metrics.joins += 1
        self._box_keys.forget_before(welcome.next_round)
        self._channel.send(BoxKey(round=welcome.next_round, certified_key=self._box_key(welcome.next_round)))

    def _box_key(self, round_number: int) -> bytes:
        """A fresh box key for ``round_number``, certified (b"" in the plaintext benchmark, which seals nothing)."""
        return b"" if self._aggregation == INSECURE_PLAINTEXT else self._box_keys.new(self._run, round_number)

    def _begin(self, config: RunConfig, run: str, welcome: Welcome) -> None:
        self._ledger = PrivacyLedger(  # read here; written from begin_run on
            self._state_dir / LEDGER_FILE, key=self._credentials.ledger_key, accept_unchained=self._upgrade_ledger
        )
        if self._offer is not None:  # on the configuration alone, before the data is read or the ledger written
            charge = config.quorum_release(len(self._roster.hospitals))
            self._offer.check(self._ledger, charge, rounds=config.rounds, run_id=config.run_id, fingerprint=run)
        try:
            check_model_for(config.model, self._data, self._own_model)
            model = RunModel(config)
        except ModelError as error:
            raise Misfit(f"{self._name} refuses the run: {error}") from None
        _load(model, welcome)  # before the ledger hears of the run: a malformed Welcome leaves no trace
        self._model = model
        # Before its box key is sent, and before the step is made: a step hooks the model it trains.
        self._send_offset.rehearse(config.training, model.network, self._data, self._name)
        self._step = self._local_step(config.training)  # a misfit too leaves no trace
        self._last_round = self._ledger.begin_run(config.run_id, run)
        if self._last_round:
            log.warning("%s resumes run %s after round %d", self._name, config.run_id, self._last_round)
            self._metrics.continue_run(config.run_id)
        self._channel.limit = config.message_limit()
        self._config, self._run = config, run
        self._identities = self._roster.identities(config.hospitals)  # the members' signing keys
        self._public = PublicContext(config.bfv_parameters()) if self._aggregation == SECURE_AGGREGATION else None

    def _local_step(self, training: TrainingMethod) -> LocalStep:
        try:
            return training.local_step(self._model.network, self._data)
        except ValueError as error:  # e.g. more sub-clients than this hospital has records
            raise Misfit(f"{self._name} cannot train in this run: {error}") from None

    def _rounds_loop(self) -> str:
        pending: Contribution | None = None
        if self._aggregation == INSECURE_PLAINTEXT:  # the server sends the sum as it is
            steps, last = {Aggregate: self._apply_plaintext}, Aggregate
        else:
            steps = {Aggregate: self._endorse, Endorsements: self._prove, Proofs: self._release, Releases: self._open}
            last = Releases
        while True:
            message = self._channel.expect(RoundStart, Aggregate, Endorsements, Proofs, Releases, RoundAbort, Finish)
            received = time.monotonic()
            if isinstance(message, Finish):
                return message.reason
            if isinstance(message, RoundStart):
                pending, refusal = self._start_round(message, received)
                if refusal:
                    return refusal
            elif pending is None or message.round != pending.round:
                self._channel.rejections.reject(
                    "the server", message.TYPE, f"no update of ours pending for round {message.round}"
                )
            elif isinstance(message, RoundAbort):
                log.warning("round %d aborted by the server: %s", message.round, message.reason)
                pending = None
            elif type(message) not in steps:
                self._channel.rejections.reject("the server", message.TYPE, "the plaintext benchmark has no such step")
            else:
                try:
                    steps[type(message)](message, pending)
                except (RoundRefused, SealedBoxError, BfvError) as refusal:  # a round that fails, not the run
                    if not isinstance(refusal, RoundRefused):
                        refusal = RoundRefused(f"round {message.round}: {refusal}")
                    self._refuse(message.round, refusal)
                    pending = None
                    continue
                if isinstance(message, last):
                    pending = None

    def _refuse(self, round_number: int, refusal: RoundRefused) -> None:
        log.warning("%s refuses round %d: %s", self._name, round_number, refusal)
        self._channel.send(
            Refused(round=round_number, reason=str(refusal), named=refusal.named, openings=refusal.openings)
        )

    def _start_round(self, message: RoundStart, received: float) -> tuple[Contribution | None, str]:
        """Take part in the round, or say why not (its budget spent): the update, or the refusal."""
        if message.round <= self._last_round:
            raise ProtocolError(f"the server started round {message.round} again after round {self._last_round}")
        if message.round > self._config.rounds:
            raise ProtocolError(f"the server started round {message.round} of a run of {self._config.rounds} rounds")
        self._last_round = message.round
        self._box_keys.forget_before(message.round)
        # What every update is charged: the least noise its sum can carry, a quorum's, at this round's settings.
        training = self._model.shared.settings
        least_noise = self._model.release(training.quorum, self._config.coalition(len(self._roster.hospitals)))
        refusal = self._budget.refusal(self._ledger, least_noise, message.round)
        if refusal:
            log.warning("%s withdraws: %s", self._name, refusal)
            self._channel.send(Withdraw(round=message.round, reason=refusal))
            self._ledger.finish_run(self._config.run_id)
            return None, refusal
        pending = self._contribute(training, least_noise, message, encrypt_at=received + self._send_offset.seconds())
        if pending is None:
            return None, ""
        if message.round == self._config.rounds:  # no later round exists: a replayed Welcome begins nothing
            self._ledger.finish_run(self._config.run_id)
        return pending, ""

    def _contribute(
        self, training: TrainingMethod, charge: Charge, message: RoundStart, *, encrypt_at: float
    ) -> "Contribution | None":
        """This hospital's update for the round, sent; None where it refuses the round before it is charged."""
        round_number = message.round
        setting = None
        if self._aggregation == SECURE_AGGREGATION:
            setting = self._config.round_setting(self._run, round_number, self._public.params)
            try:  # before the charge, so that a relay's fault costs nothing and ends nothing (review 4, finding 8)
                self._box_keys.check(setting, message.box_keys, self._identities)
            except RoundRefused as refusal:
                self._refuse(round_number, refusal)
                return None
        # Durable before the update leaves: a crash can only over-count.
        self._ledger.record(charge, run_id=self._config.run_id, round_number=round_number)
        log.info("%s contributes to round %d; %s", self._name, round_number, self._ledger.spent(self._budget.delta))
        if self._step.settings != training:  # adaptive v moved on
            self._step = self._local_step(training)
        contribution = Contribution.starting(round_number, training, self._channel.transport)
        started = time.perf_counter()
        try:
            share, _ = self._step()
        except ValueError as error:
            raise ProtocolError(f"round {round_number}: {error}") from None
        contribution.seconds["train"] = time.perf_counter() - started
        late = self._channel.wait_until(encrypt_at)  # what follows takes as long whatever the batch: its send time
        if late and self._send_offset.floor_s > 0:  # tells nothing of the step's (an offset of 0 sends at once)
            contribution.overran_send_offset = True
            log.warning(
                "round %d: the step took %.3f s longer than the send offset; its send time may reveal the batch "
                "size (raise --send-offset)",
                round_number,
                late,
            )
        started = time.perf_counter()
        update = encode(self._update(contribution, setting, share, message))
        contribution.seconds["encrypt"] = time.perf_counter() - started
        contribution.update_bytes = len(update)
        self._channel.transport.send(update)
        return contribution

    def _update(
        self, contribution: Contribution, setting: RoundSetting | None, share: np.ndarray, message: RoundStart
    ) -> Update:
        """The share under this round's one-time key, with that key's shares sealed to the members, and this
        hospital's box key for the next round (the plaintext benchmark: the share in the clear)."""
        round_number = message.round
        next_key = self._box_key(round_number + 1) if round_number < self._config.rounds else b""
        if self._aggregation == INSECURE_PLAINTEXT:
            return plaintext_update(self._config.bfv_parameters(), share, message, name=self._name, next_key=next_key)
        contribution.round_keys = HospitalRound(
            setting,
            self._public,
            name=self._name,
            signing=self._credentials.identity.signing,
            box=self._box_keys.take(round_number),
        )
        identities = self._identities
        return upload(contribution.round_keys, self._public.params, share, message, identities, next_key=next_key)

    def _endorse(self, message: Aggregate, pending: "Contribution") -> None:
        pending.summed_by(message.contributors, self._channel.transport)
        answer = endorsement(
            pending.round_keys,
            message,
            self._identities,
            round_state=pending.settings.round_state(),
            previous_result=self._model.digest(),
        )
        self._ledger.record_step("endorsed", run_id=self._config.run_id, round_number=message.round)
        self._channel.send(answer)

    def _prove(self, message: Endorsements, pending: "Contribution") -> None:
        self._channel.send(proof(pending.round_keys, message, self._identities))

    def _release(self, message: Proofs, pending: "Contribution") -> None:
        answer = release(pending.round_keys, self._public, message, self._identities)
        self._ledger.record_step("released", run_id=self._config.run_id, round_number=message.round)
        self._channel.send(answer)

    def _open(self, message: Releases, pending: "Contribution") -> None:
        """Open the sum from every member's release, apply its mean, and say what was applied."""
        started = time.perf_counter()
        total = opened_sum(pending.round_keys, self._public, message, self._identities)
        pending.seconds["decrypt"] = time.perf_counter() - started
        self._apply(message.round, pending, total)

    def _apply_plaintext(self, message: Aggregate, pending: "Contribution") -> None:
        """The plaintext benchmark: the server sends the sum as it is."""
        pending.summed_by(message.contributors, self._channel.transport)
        started = time.perf_counter()
        total = plaintext_sum(self._config.bfv_parameters(), message)
        pending.seconds["decrypt"] = time.perf_counter() - started  # reading the sum: no key in this mode
        self._apply(message.round, pending, total)

    def _apply(self, round_number: int, pending: "Contribution", total: np.ndarray) -> None:
        contributors = len(pending.contributors)
        mean = self._model.mean(total, contributors, pending.settings)
        self._model.move(mean, contributors)
        self._channel.send(Confirmed(round=round_number, digest=release_digest(round_number, mean.tobytes())))
        sent_bytes = self._channel.transport.bytes_sent - pending.bytes_sent_before
        self._metrics.released(pending, contributors, sent_bytes, self._ledger.epsilons(self._budget.delta))


def _load(model: RunModel, welcome: Welcome) -> None:
    """The model and update rule's state as a Welcome carries them (``ProtocolError`` where unusable)."""
    try:
        model.load(welcome, whose="the server's")
    except ValueError as error:  # a MessageError among them
        raise ProtocolError(f"the server's Welcome is unusable: {error}") from None
