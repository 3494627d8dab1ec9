"""A hospital: trains on its own data, encrypts what it sends, and keeps its own privacy ledger.

Per round it computes its noisy integer share with the run's method (``training.methods.registry``:
Dopamine's DP-SGD step, or DP-FedAvg's sub-client updates) and uploads it under a key it draws for
that upload alone, whose Shamir shares it seals to the other hospitals; it endorses at most one sum
a round, proves its dealing, and releases its share of the sum's key only once every contributor
has endorsed that same sum and every dealing to it checks (``docs/explanation/secure-round.md``;
the checks are ``protocol.secure_round``'s). It then opens the sum from every member's release,
applies the mean with the method's update rule like every other party, and tells the server what
it applied. Where a check fails it refuses the round, naming whom the check caught.

It does not trust the server's count of the privacy spent: before each update leaves (when nobody
knows how many hospitals will contribute), it charges its own durable ledger for the least noise a
decrypted sum can carry, a quorum's (exact with the default quorum of all hospitals), refusing to
take part once that would take the worse of the server's and a fellow hospital's epsilon over its
budget (Dopamine, Algorithm 1, line 17). Ledger records are keyed by identifiers the ledger draws,
so a server cannot make releases count less by repeating a run id or a round.

**Joining again.** A hospital takes part in one run. If its connection to the server is made
again (the server restarted, say), what was in flight is dropped and it says Hello again; a
restarted hospital process does the same. It accepts a Welcome only to the run it began (the same
fingerprint), takes the model and update rule's state the server has now, and takes part only in
rounds after the last one its ledger charged, so a restart on either side never releases an update
twice or resets epsilon; its ledger records its endorsement and its release of a round before each
leaves, and refuses to record either twice. No key outlives its round: a hospital that restarted makes a box key for
the next round, and nothing else.

It takes part only in a run of the method and aggregation mode its own operator chose (a server
cannot switch it to plaintext uploads, or to another method, whose ledger entries would mean
something else), and trains a model its own code builds, with the digest the run announces.

Its update leaves a fixed ``send_offset_s`` after RoundStart, whatever the computation took:
local compute time grows with the Poisson batch size, which DP does not protect, and the server
sees when each update arrives.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
from torch import nn

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.insecure_plaintext import InsecurePlaintextUploads
from consilium.crypto.one_time_keys import pack_ring
from consilium.crypto.sealed_box import SealedBoxError, certify_key
from consilium.protocol.run.config import INSECURE_PLAINTEXT, SECURE_AGGREGATION, RunConfig, check_aggregation
from consilium.protocol.run.rules import ConfigError
from consilium.protocol.wire.messages import (
    TO_HOSPITAL,
    Aggregate,
    BoxKey,
    Confirmed,
    Endorsement,
    Endorsements,
    Finish,
    Message,
    MessageError,
    Proof,
    Proofs,
    ProtocolError,
    Refused,
    Release,
    Releases,
    RoundAbort,
    RoundStart,
    Update,
    Welcome,
    Withdraw,
    float32_values,
    release_digest,
)
from consilium.protocol.wire.codec import encode
from consilium.protocol.secure_round.hospital_round import HospitalRound
from consilium.protocol.secure_round.statement import (
    Endorsed,
    Proved,
    RoundRefused,
    RoundSetting,
    box_key_context,
    check_box_keys,
    released_from,
    state_digest,
)
from consilium.protocol.wire.channel import ServerChannel
from consilium.protocol.run.hospital_metrics import Contribution, HospitalMetrics
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.training.privacy.accounting import Release as Charge
from consilium.training.privacy.ledger import LEDGER_FILE, PrivacyBudget, PrivacyLedger
from consilium.training.data.datasets import Split
from consilium.training.methods.registry import METHODS, LocalStep, SharedState, TrainingMethod, ledger_release
from consilium.training.models.build import (
    ModelError,
    build_model,
    check_model_for,
    get_flat_parameters,
    parameter_count,
    set_flat_parameters,
)

__all__ = ["DEFAULT_SEND_OFFSET_S", "Hospital"]

log = logging.getLogger("consilium.hospital")


# Measured: the default run's slowest train + encrypt step on a 2-core machine took 0.04 s (its
# first); the offset is six times that, so that a large batch does not overrun it. See docs/tutorials/first-federation.md.
DEFAULT_SEND_OFFSET_S = 0.25
MAX_SERVER_WAIT_S = 24 * 3600  # the most a Welcome may say the server keeps a hospital waiting


def _float32s(payload: bytes, count: int, what: str) -> np.ndarray:
    try:
        return float32_values(payload, count, f"{what} from the server")
    except MessageError as error:
        raise ProtocolError(str(error)) from None


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
    ) -> None:
        roster.check_own_entry(credentials)
        self._name = credentials.name
        self._roster = roster
        self._credentials = credentials
        self._data = data
        self._budget = budget
        self._state_dir = state_dir
        self._upgrade_ledger = upgrade_ledger  # read an unchained (older) ledger once: its operator's say
        self._send_offset_s = send_offset_s
        check_aggregation(aggregation)
        if method not in METHODS:
            raise ConfigError(f"a hospital of the secure round trains with one of {', '.join(METHODS)}, not {method!r}")
        # This hospital's operator's choices; a server cannot change them.
        self._method, self._aggregation, self._own_model = method, aggregation, own_model
        self._ledger: PrivacyLedger | None = None
        # Set by the first Welcome, kept across joins: a hospital takes part in one run.
        self._config: RunConfig | None = None
        self._run = ""  # RunConfig.fingerprint
        self._model: nn.Module | None = None
        self._step: LocalStep | None = None
        self._shared: SharedState | None = None
        self._public: PublicContext | None = None
        # round -> this hospital's box key for it and its certificate (memory only, dropped once the round began)
        self._box_keys: dict[int, tuple[X25519PrivateKey, bytes]] = {}
        self._last_round = 0  # the last round this hospital was charged for: it takes part only in later ones
        self._metrics = HospitalMetrics(state_dir, self._name)
        self._channel = ServerChannel.connect(roster, credentials, accept=TO_HOSPITAL, timeout_s=timeout_s, log=log)

    def run(self) -> dict:
        """Take part until the server finishes the run or the budget is spent; returns the metrics."""
        finish_reason = ""
        try:
            finish_reason = self._channel.take_part(Welcome, self._take_part, self._name)
        finally:
            if self._config is not None:
                self._metrics.write(self._config, finish_reason, rejected=self._channel.rejections.total)
            self._channel.close()
        return {"finish_reason": finish_reason, "rounds": self._metrics.rounds}

    def _take_part(self, welcome: Welcome) -> str:
        self._join(welcome)
        return self._rounds_loop()

    def _join(self, welcome: Welcome) -> None:
        """Take the run's settings (the first time) and the model as it is now; then send a box key for the
        next round."""
        training = welcome.config.get("training")
        announced = training.get("method") if isinstance(training, dict) else None
        announced = announced if isinstance(announced, str) and len(announced) <= 64 else None  # shown in one line
        if announced != self._method:  # before any method's code reads the server's settings
            raise ProtocolError(
                f"the server's run trains with {announced!r}; {self._name} was started for {self._method!r}"
            )
        try:
            config = RunConfig.from_dict(welcome.config)
        except ConfigError as error:
            raise ProtocolError(f"the server's run configuration is unusable: {error}") from None
        if config.aggregation != self._aggregation:
            raise ProtocolError(
                f"the server's run uses {config.aggregation!r} aggregation; {self._name} was started for {self._aggregation!r}"
            )
        run = config.fingerprint(welcome.initial_parameters)
        if self._config is None:
            self._begin(config, run, welcome.initial_parameters)
        elif run != self._run:
            raise ProtocolError(
                f"the server welcomed {self._name} to run {run}, not to the run it takes part in ({self._run})"
            )
        if not 0 < welcome.server_wait_s <= MAX_SERVER_WAIT_S:
            raise ProtocolError(
                f"the server says it may keep a hospital waiting {welcome.server_wait_s} s; at most {MAX_SERVER_WAIT_S} s is accepted"
            )
        self._channel.wait_at_least(welcome.server_wait_s)  # as long as the server may take (review 4, finding 7)
        self._metrics.joins += 1
        set_flat_parameters(self._model, _float32s(welcome.parameters, self._shared.parameter_count, "the model"))
        try:
            self._shared.load_state(
                _float32s(welcome.optimizer_state, self._shared.state().size, "the optimizer state")
            )
        except ValueError as error:
            raise ProtocolError(f"the server's optimizer state is unusable: {error}") from None
        self._forget_box_keys(welcome.next_round)
        self._channel.send(BoxKey(round=welcome.next_round, certified_key=self._box_key(welcome.next_round)))

    def _box_key(self, round_number: int) -> bytes:
        """A fresh box key for ``round_number``, certified for it; its private half stays in memory (b"" in
        the plaintext benchmark, which seals nothing)."""
        if self._aggregation == INSECURE_PLAINTEXT:
            return b""
        key = X25519PrivateKey.generate()
        context = box_key_context(self._run, self._name, round_number)
        certified = certify_key(key.public_key(), signer=self._credentials.identity.signing, context=context)
        self._box_keys[round_number] = (key, certified)
        return certified

    def _forget_box_keys(self, before_round: int) -> None:
        """Drop every box key for a round before ``before_round``: shares sealed to one can never be
        opened after its round (review 4, finding 11)."""
        for number in [number for number in self._box_keys if number < before_round]:
            del self._box_keys[number]

    def _begin(self, config: RunConfig, run: str, initial_parameters: bytes) -> None:
        if self._name not in config.hospitals:
            raise ProtocolError(f"{self._name} is not among the run's hospitals")
        strangers = set(config.hospitals) - set(self._roster.hospitals)
        if strangers:  # e.g. the server naming itself a hospital, to hold the key
            raise ProtocolError(f"the run names {sorted(strangers)} as hospitals; the roster does not")
        try:
            check_model_for(config.model, self._data, self._own_model)
            model = build_model(config.model)
        except ModelError as error:
            raise ProtocolError(f"{self._name} refuses the run: {error}") from None
        set_flat_parameters(model, _float32s(initial_parameters, parameter_count(model), "the initial parameters"))
        self._ledger = PrivacyLedger(
            self._state_dir / LEDGER_FILE, key=self._credentials.ledger_key, accept_unchained=self._upgrade_ledger
        )
        self._last_round = self._ledger.begin_run(config.run_id, run)
        if self._last_round:
            log.warning(
                "%s resumes run %s after round %d, the last its ledger charged",
                self._name,
                config.run_id,
                self._last_round,
            )
            self._metrics.continue_run(config.run_id)
        self._channel.limit = config.message_limit()
        self._config, self._run = config, run
        self._public = PublicContext(config.bfv_parameters()) if self._aggregation == SECURE_AGGREGATION else None
        self._model = model
        self._step = self._local_step(config.training)
        self._shared = SharedState(config.training, model)

    def _local_step(self, training: TrainingMethod) -> LocalStep:
        try:
            return training.local_step(self._model, self._data)
        except ValueError as error:  # e.g. more sub-clients than this hospital has records
            raise ProtocolError(f"{self._name} cannot train in this run: {error}") from None

    def _rounds_loop(self) -> str:
        pending: Contribution | None = None
        steps = {Aggregate: self._endorse, Endorsements: self._prove, Proofs: self._release, Releases: self._open}
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
                self._reject(message, f"no update of ours is pending for round {message.round}")
            elif isinstance(message, RoundAbort):
                log.warning("round %d aborted by the server: %s", message.round, message.reason)
                pending = None
            elif self._aggregation == INSECURE_PLAINTEXT:
                if isinstance(message, Aggregate):
                    self._apply_plaintext(message, pending)
                    pending = None
                else:
                    self._reject(message, "the plaintext benchmark's round has no such step")
            else:
                try:
                    steps[type(message)](message, pending)
                except (RoundRefused, SealedBoxError, BfvError) as refusal:  # a round that fails, not the run
                    if not isinstance(refusal, RoundRefused):
                        refusal = RoundRefused(f"round {message.round}: {refusal}")
                    self._refuse(message.round, refusal)
                    pending = None
                    continue
                if isinstance(message, Releases):
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
        self._forget_box_keys(message.round)
        # What every update is charged: the least noise its sum can carry, a quorum's, at this round's settings.
        training = self._shared.settings
        least_noise = ledger_release(
            training, self._shared.mechanism, training.quorum, self._config.coalition(len(self._roster.hospitals))
        )
        refusal = self._budget.refusal(self._ledger, least_noise, message.round)
        if refusal:
            log.warning("%s withdraws: %s", self._name, refusal)
            self._channel.send(Withdraw(round=message.round, reason=refusal))
            self._ledger.finish_run(self._config.run_id)
            return None, refusal
        pending = self._contribute(training, least_noise, message, send_at=received + self._send_offset_s)
        if pending is None:
            return None, ""
        if message.round == self._config.rounds:  # no later round exists: a replayed Welcome begins nothing
            self._ledger.finish_run(self._config.run_id)
        return pending, ""

    def _contribute(
        self, training: TrainingMethod, charge: Charge, message: RoundStart, *, send_at: float
    ) -> "Contribution | None":
        """This hospital's update for the round, sent; None where it refuses the round before it is charged."""
        round_number = message.round
        setting = None
        if self._aggregation == SECURE_AGGREGATION:
            setting = self._config.round_setting(self._run, round_number, self._public.params)
            if not self._box_keys_check(setting, message):
                return None
        # Durable before the update leaves: a crash can only over-count.
        self._ledger.record(charge, run_id=self._config.run_id, round_number=round_number)
        if self._step.settings != training:  # adaptive v moved on
            self._step = self._local_step(training)
        contribution = Contribution(
            round=round_number,
            settings=training,
            bytes_sent_before=self._channel.transport.bytes_sent,
            bytes_received_before=self._channel.transport.bytes_received,
        )
        started = time.perf_counter()
        try:
            share, _ = self._step()
        except ValueError as error:
            raise ProtocolError(f"round {round_number}: {error}") from None
        contribution.seconds["train"] = time.perf_counter() - started
        started = time.perf_counter()
        update = encode(self._update(contribution, setting, share, message))
        contribution.seconds["encrypt"] = time.perf_counter() - started
        contribution.update_bytes = len(update)
        self._send_at(update, send_at, contribution)
        return contribution

    def _box_keys_check(self, setting: RoundSetting, message: RoundStart) -> bool:
        """Whether the round's box keys check, this hospital's own among them; a failure refuses the round before
        the charge, so that a relay's fault costs nothing and ends nothing (review 4, finding 8)."""
        round_number = message.round
        try:
            check_box_keys(setting, self._name, message.box_keys, self._identities())
            own = self._box_keys.get(round_number)
            if own is None or message.box_keys[self._name] != own[1]:  # e.g. one certified before a restart
                raise RoundRefused(
                    f"round {round_number}: the box key listed for {self._name} is not the one it holds",
                    named=["server"],
                )
        except RoundRefused as refusal:
            self._box_keys.pop(round_number, None)
            self._refuse(round_number, refusal)
            return False
        return True

    def _update(
        self, contribution: Contribution, setting: RoundSetting | None, share: np.ndarray, message: RoundStart
    ) -> Update:
        """The share under this round's one-time key, with that key's shares sealed to the members, and this
        hospital's box key for the next round (the plaintext benchmark: the share in the clear)."""
        round_number = message.round
        next_key = self._box_key(round_number + 1) if round_number < self._config.rounds else b""
        if self._aggregation == INSECURE_PLAINTEXT:
            chunks = InsecurePlaintextUploads(self._config.bfv_parameters()).encrypt_update(
                share, round_number=round_number, hospital=self._name
            )
            return Update(round=round_number, chunks=tuple(chunks), boxes={}, next_box_key=next_key)
        box, _ = self._box_keys.pop(round_number)
        contribution.round_keys = HospitalRound(
            setting, self._public, name=self._name, signing=self._credentials.identity.signing, box=box
        )
        try:
            chunks, boxes = contribution.round_keys.upload(self._slots(share), message.box_keys, self._identities())
        except RoundRefused as refusal:
            raise ProtocolError(f"round {round_number}: {refusal}") from None
        return Update(round=round_number, chunks=tuple(chunks), boxes=boxes, next_box_key=next_key)

    def _send_at(self, update: bytes, send_at: float, contribution: Contribution) -> None:
        """Send at the round's send offset, so that the send time does not reveal how long the step took."""
        wait = send_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        elif self._send_offset_s > 0:  # an offset of 0 sends at once, by the operator's choice
            contribution.overran_send_offset = True
            log.warning(
                "round %d: the update took %.3f s longer than the send offset of %g s; its send time may "
                "reveal the batch size (raise --send-offset)",
                contribution.round,
                -wait,
                self._send_offset_s,
            )
        self._channel.transport.send(update)

    def _endorse(self, message: Aggregate, pending: "Contribution") -> None:
        """Check the sum and the set, open this hospital's shares, and sign the round's one statement."""
        pending.bytes_received_aggregate = self._channel.transport.bytes_received - pending.bytes_received_before
        pending.contributors = tuple(message.contributors)
        endorsed = pending.round_keys.endorse(
            message.contributors,
            message.digests,
            message.chunks,
            message.boxes,
            self._identities(),
            round_state=pending.settings.round_state(),
            previous_result=state_digest(get_flat_parameters(self._model).tobytes(), self._shared.state().tobytes()),
        )
        self._ledger.record_step("endorsed", run_id=self._config.run_id, round_number=message.round)
        self._channel.send(
            Endorsement(
                round=message.round,
                hashes=endorsed.hashes,
                commitment=endorsed.commitment,
                signature=endorsed.signature,
            )
        )

    def _prove(self, message: Endorsements, pending: "Contribution") -> None:
        if not set(message.hashes) == set(message.commitments) == set(message.signatures):
            raise RoundRefused(f"round {message.round}: endorsements with parts missing", named=["server"])
        endorsements = {
            name: Endorsed(message.hashes[name], message.commitments[name], message.signatures[name])
            for name in message.signatures
        }
        proved = pending.round_keys.prove(endorsements, self._identities())
        self._channel.send(Proof(round=message.round, seed=proved.seed, proof=proved.proof, signature=proved.signature))

    def _release(self, message: Proofs, pending: "Contribution") -> None:
        """Release this hospital's share of the sum's key, once every dealing to it checks."""
        if not set(message.seeds) == set(message.proofs) == set(message.signatures):
            raise RoundRefused(f"round {message.round}: proofs with parts missing", named=["server"])
        proofs = {
            name: Proved(message.seeds[name], message.proofs[name], message.signatures[name]) for name in message.seeds
        }
        released = pending.round_keys.release(proofs, self._identities())
        share = pack_ring(self._public, released.release.share[np.newaxis])[0]
        self._ledger.record_step("released", run_id=self._config.run_id, round_number=message.round)
        self._channel.send(
            Release(round=message.round, share=share, masks=released.release.masks, signature=released.signature)
        )

    def _open(self, message: Releases, pending: "Contribution") -> None:
        """Open the sum from every member's release, apply its mean, and say what was applied."""
        if not set(message.shares) == set(message.masks) == set(message.signatures):
            raise RoundRefused(f"round {message.round}: releases with parts missing", named=["server"])
        started = time.perf_counter()
        try:
            releases = {
                name: released_from(self._public, message.shares[name], message.masks[name], message.signatures[name])
                for name in message.shares
            }
        except BfvError as error:
            raise RoundRefused(f"round {message.round}: {error}", named=["server"]) from None
        slots = pending.round_keys.open(releases, self._identities())
        params = self._public.params
        total = params.digits.from_slots(slots[: params.digits.slots_for(params.vector_length)], params.vector_length)
        pending.seconds["decrypt"] = time.perf_counter() - started
        self._apply(message.round, pending, total)

    def _apply_plaintext(self, message: Aggregate, pending: "Contribution") -> None:
        """The plaintext benchmark: the server sends the sum as it is."""
        pending.bytes_received_aggregate = self._channel.transport.bytes_received - pending.bytes_received_before
        pending.contributors = tuple(message.contributors)
        started = time.perf_counter()
        try:
            total = InsecurePlaintextUploads(self._config.bfv_parameters()).decrypt_sum(
                message.chunks, round_number=message.round, contributors=message.contributors
            )
        except BfvError as error:
            raise ProtocolError(f"round {message.round}: the server's plaintext sum is unusable: {error}") from None
        pending.seconds["decrypt"] = time.perf_counter() - started  # reading the sum: no key in this mode
        self._apply(message.round, pending, total)

    def _apply(self, round_number: int, pending: "Contribution", total: np.ndarray) -> None:
        contributors = len(pending.contributors)
        mean = pending.settings.read_sum(total, contributors, self._shared.parameter_count)
        self._shared.apply(mean, contributors)
        self._channel.send(Confirmed(round=round_number, digest=release_digest(round_number, mean.tobytes())))
        sent_bytes = self._channel.transport.bytes_sent - pending.bytes_sent_before
        self._metrics.released(pending, contributors, sent_bytes, self._ledger.epsilons(self._budget.delta))

    def _slots(self, share: np.ndarray) -> np.ndarray:
        """An update's slots: its values as digits (``crypto.slot_digits``), the zero slots after them."""
        params = self._public.params
        values = np.asarray(share)
        if values.shape != (params.vector_length,) or not np.issubdtype(values.dtype, np.integer):
            raise ProtocolError(
                f"an update of {values.dtype} and shape {values.shape}, not {params.vector_length} integers"
            )
        slots = np.zeros(params.chunk_count * params.poly_modulus_degree, dtype=np.int64)
        digits = params.digits.to_slots(values)
        slots[: digits.size] = digits
        return slots

    def _identities(self) -> dict:
        return {name: self._roster.party(name).identity.signing for name in self._config.hospitals}

    def _reject(self, message: Message, reason: str) -> None:
        self._channel.rejections.reject("the server", message.TYPE, reason)
