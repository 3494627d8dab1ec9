"""A hospital: trains on its own data, encrypts what it sends, and keeps its own privacy ledger.

Per round it computes ``g_k`` (``training.dopamine``), encrypts it under the federation's shared
BFV key and sends the ciphertexts to the server. It accepts only a sum of at least the quorum whose
check slots prove it is one fresh contribution from each contributor the server names
(``crypto.membership``), endorses at most one such aggregate per round, and uses the sum only once
every contributor has endorsed that same aggregate (``crypto.endorsement``), so that its update is
released at most once. It then applies the mean with momentum like every other party and tells
the server what it decrypted (the first contributor also sends the mean itself: the DP-protected
release).

It does not trust the server's count of the privacy spent: before each update leaves, it charges
its own durable ledger for the least noise a decrypted sum can carry (a quorum's), refusing to take
part once that would take the worse of the server's and a fellow hospital's epsilon over its budget
(Dopamine, Algorithm 1, line 17). The charge is made before the update leaves, when nobody knows
how many hospitals will contribute, and stays at a quorum's noise; with the default quorum of all
hospitals it is exact.
Ledger records are keyed by identifiers the ledger draws, and a run id it has seen before
is refused, so a server cannot make releases count less by repeating a run id or a round.

Its update leaves a fixed ``send_offset_s`` after RoundStart, whatever the computation took:
local compute time grows with the Poisson batch size, which DP does not protect, and the server
sees when each update arrives.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from crypto.bfv import BfvError, SecretContext
from crypto.bfv_parameters import BfvParameters
from crypto.endorsement import EndorsementError, aggregate_statement, check_endorsements, endorse
from crypto.sealed_box import SealedBoxError, certify_key, open_box, seal, verify_certified_key
from protocol.config import ConfigError, RunConfig
from protocol.messages import (
    TO_HOSPITAL,
    Aggregate,
    Endorsement,
    Endorsements,
    Finish,
    Hello,
    KeyReady,
    KeyRequest,
    KeySetup,
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
    decode,
    encode,
    release_digest,
)
from protocol.rejections import RejectionLog
from protocol.roster import Credentials, Roster
from protocol.transport import ClientTransport
from training.accounting import LEDGER_FILE, PrivacyLedger, Release, release_of
from training.datasets import Split
from training.dopamine import MomentumUpdate, NoisyGradientStep, mean_gradient
from training.models import build_model, set_flat_parameters

__all__ = ["DEFAULT_SEND_OFFSET_S", "Hospital", "PrivacyBudget", "run_key_context", "sealed_key_context"]

log = logging.getLogger("consilium.hospital")

_HELLO_LIMIT_BYTES = 64 * 1024 * 1024  # before the run's parameters are known
M = TypeVar("M", bound=Message)


# Measured: the default run's slowest train + encrypt step on a 2-core machine took 0.04 s (its
# first); the offset is six times that, so that a large batch does not overrun it. See the README.
DEFAULT_SEND_OFFSET_S = 0.25


@dataclass(frozen=True)
class PrivacyBudget:
    epsilon: float
    delta: float


@dataclass
class _Contribution:
    """What a hospital remembers of its update while the round is open."""

    round: int
    bytes_sent_before: int
    bytes_received_before: int
    bytes_received_aggregate: int = 0
    update_bytes: int = 0
    overran_send_offset: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    # Set once this hospital has endorsed an aggregate of the round: it endorses no other.
    endorsed: tuple[str, ...] | None = None  # that aggregate's contributors
    statement: bytes = b""
    mean: np.ndarray | None = None


def sealed_key_context(run: str, recipient: str) -> bytes:
    """What a sealed BFV secret context is bound to: this run (``RunConfig.fingerprint``), this recipient."""
    return f"consilium/bfv-secret-context/v2|{run}|{recipient}".encode()


def run_key_context(run: str, owner: str) -> bytes:
    """What a hospital's per-run box key is certified for: this run (``RunConfig.fingerprint``), this hospital."""
    return f"consilium/run-box-key/v2|{run}|{owner}".encode()


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
        send_offset_s: float = DEFAULT_SEND_OFFSET_S,
    ) -> None:
        roster.check_credentials(credentials)
        self._name = credentials.name
        self._roster = roster
        self._credentials = credentials
        self._data = data
        self._budget = budget
        self._state_dir = state_dir
        self._timeout_s = timeout_s
        self._send_offset_s = send_offset_s
        self._limit = _HELLO_LIMIT_BYTES
        self._ledger: PrivacyLedger | None = None
        self._run = ""  # RunConfig.fingerprint, once welcomed
        self._rounds: list[dict] = []
        self._rejections = RejectionLog(log)
        self._transport = ClientTransport(
            roster.server_address, roster.server.curve_public, credentials.curve, _HELLO_LIMIT_BYTES
        )

    def run(self) -> dict:
        """Take part until the server finishes the run or the budget is spent; returns the metrics."""
        finish_reason = ""
        config = None
        try:
            self._send(Hello())
            welcome = self._expect(Welcome)
            try:
                config = RunConfig.from_dict(welcome.config)
            except ConfigError as error:
                raise ProtocolError(f"the server's run configuration is unusable: {error}") from None
            if self._name not in config.hospitals:
                raise ProtocolError(f"{self._name} is not among the run's hospitals")
            strangers = set(config.hospitals) - set(self._roster.hospitals)
            if strangers:  # e.g. the server naming itself a hospital, to hold the key
                raise ProtocolError(f"the run names {sorted(strangers)} as hospitals; the roster does not")
            params = config.bfv_parameters()
            self._limit = config.message_limit()
            self._ledger = PrivacyLedger(self._state_dir / LEDGER_FILE)
            self._ledger.begin_run(config.run_id)
            model = build_model(config.model)
            initial = np.frombuffer(welcome.initial_parameters, dtype="<f4")
            if initial.size != params.vector_length or not np.all(np.isfinite(initial)):
                raise ProtocolError(f"the initial parameters are not {params.vector_length} finite float32 values")
            set_flat_parameters(model, initial)
            self._run = config.fingerprint(welcome.initial_parameters)
            secret = self._key_ceremony(config, params)
            step = NoisyGradientStep(model, self._data.x, self._data.y, config.dopamine)
            momentum = MomentumUpdate(model, config.dopamine)
            finish_reason = self._rounds_loop(config, secret, step, momentum)
        finally:
            self._write_metrics(config, finish_reason)
            self._transport.close()
        return {"finish_reason": finish_reason, "rounds": self._rounds}

    def _key_ceremony(self, config: RunConfig, params: BfvParameters) -> SecretContext:
        holder = self._roster.party(config.key_holder)
        if self._name == config.key_holder:
            recipients = self._certified_run_keys(config, self._expect(KeyRequest).run_keys)
            secret = SecretContext.generate(params, run_id=config.run_id)
            secret_bytes = secret.to_bytes()
            sealed = {
                name: seal(
                    secret_bytes,
                    recipient=run_key,
                    sender=self._credentials.identity.signing,
                    context=sealed_key_context(self._run, name),
                )
                for name, run_key in recipients.items()
            }
            self._send(KeySetup(sealed_keys=sealed))
            return secret
        # A box key for this run alone, never written anywhere: once the box is open it is gone, and
        # no later leak of this hospital's long-term keys opens the box in anyone's records.
        run_key = X25519PrivateKey.generate()
        certified = certify_key(
            run_key.public_key(), signer=self._credentials.identity.signing, context=run_key_context(self._run, self._name)
        )
        self._send(RunKey(certified_key=certified))
        box = self._expect(SealedKey).box
        try:
            secret_bytes = open_box(
                box, recipient=run_key, sender=holder.identity.signing, context=sealed_key_context(self._run, self._name)
            )
            secret = SecretContext.from_bytes(secret_bytes, params, run_id=config.run_id)
        except (SealedBoxError, BfvError) as error:
            raise ProtocolError(f"the BFV key from {holder.name} is unusable: {error}") from None
        finally:
            del run_key
        self._send(KeyReady())
        return secret

    def _certified_run_keys(self, config: RunConfig, run_keys: dict[str, bytes]) -> dict[str, X25519PublicKey]:
        """The other hospitals' run keys, each checked against its owner's identity in the roster."""
        expected = set(config.hospitals) - {self._name}
        if not set(run_keys) <= expected:
            raise ProtocolError(f"the server asks to seal the key to {sorted(set(run_keys) - expected)}, not in this run")
        keys = {}
        for name, certified in run_keys.items():
            try:
                keys[name] = verify_certified_key(
                    certified, signer=self._roster.party(name).identity.signing, context=run_key_context(self._run, name)
                )
            except SealedBoxError as error:
                raise ProtocolError(f"the run key the server relays for {name} is not {name}'s: {error}") from None
        return keys

    def _rounds_loop(
        self, config: RunConfig, secret: SecretContext, step: NoisyGradientStep, momentum: MomentumUpdate
    ) -> str:
        pending: _Contribution | None = None
        last_round = 0
        while True:
            message = self._expect(RoundStart, Aggregate, Endorsements, RoundAbort, Finish)
            received = time.monotonic()
            if isinstance(message, Finish):
                return message.reason
            if isinstance(message, RoundStart):
                if message.round <= last_round:
                    raise ProtocolError(f"the server started round {message.round} again after round {last_round}")
                last_round = message.round
                # What every update is charged: the least noise its sum can carry, a quorum's.
                least_noise = release_of(step.mechanism, sample_rate=config.dopamine.sample_rate, contributors=config.dopamine.quorum)
                refusal = self._budget_refusal(least_noise, message.round)
                if refusal:
                    log.warning("%s withdraws: %s", self._name, refusal)
                    self._send(Withdraw(round=message.round, reason=refusal))
                    return refusal
                pending = self._contribute(
                    config, secret, step, least_noise, message.round, send_at=received + self._send_offset_s
                )
            elif pending is None or message.round != pending.round:
                self._rejections.reject("the server", message.TYPE, f"no update of ours is pending for round {message.round}")
            elif isinstance(message, RoundAbort):
                log.warning("round %d aborted by the server: %s", message.round, message.reason)
                pending = None
            elif isinstance(message, Aggregate) and pending.endorsed is not None:
                self._rejections.reject("the server", message.TYPE, "a second aggregate: a hospital endorses one per round")
            elif isinstance(message, Aggregate):
                self._endorse(config, secret, step, message, pending)
            elif pending.endorsed is None:
                self._rejections.reject("the server", message.TYPE, "endorsements before the round's aggregate")
            else:
                self._release(momentum, message, pending)
                pending = None

    def _budget_refusal(self, charge: Release, round_number: int) -> str:
        """Why this hospital must not take part in the round, or "" if it may (Algorithm 1, line 17)."""
        projected, view = self._ledger.worst_epsilon(self._budget.delta, extra=charge)
        if projected <= self._budget.epsilon:
            return ""
        return (
            f"privacy budget: round {round_number} would bring epsilon against the {view.replace('_', ' ')} "
            f"to {projected:.3f} > {self._budget.epsilon:g} at delta {self._budget.delta:g}"
        )

    def _contribute(
        self,
        config: RunConfig,
        secret: SecretContext,
        step: NoisyGradientStep,
        charge: Release,
        round_number: int,
        *,
        send_at: float,
    ) -> "_Contribution":
        # Durable before the update leaves: a crash can only over-count.
        self._ledger.record(charge, run_id=config.run_id, round_number=round_number)
        contribution = _Contribution(
            round=round_number,
            bytes_sent_before=self._transport.bytes_sent,
            bytes_received_before=self._transport.bytes_received,
        )
        started = time.perf_counter()
        try:
            share, _ = step()
        except ValueError as error:
            raise ProtocolError(f"round {round_number}: {error}") from None
        contribution.seconds["train"] = time.perf_counter() - started
        started = time.perf_counter()
        chunks = secret.encrypt_update(share, round_number=round_number, hospital=self._name)
        update = encode(Update(round=round_number, chunks=tuple(chunks)))
        contribution.seconds["encrypt"] = time.perf_counter() - started
        contribution.update_bytes = len(update)
        wait = send_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        else:
            contribution.overran_send_offset = True
            log.warning(
                "round %d: the update took %.3f s longer than the send offset of %g s; its send time may "
                "reveal the batch size (raise --send-offset)", round_number, -wait, self._send_offset_s
            )
        self._transport.send(update)
        return contribution

    def _endorse(
        self, config: RunConfig, secret: SecretContext, step: NoisyGradientStep, message: Aggregate, pending: "_Contribution"
    ) -> None:
        """Check the aggregate and decrypt it for this hospital alone; then sign it: the one endorsement of the round."""
        contributors = list(message.contributors)
        if (
            self._name not in contributors
            or len(contributors) != len(set(contributors))
            or not set(contributors) <= set(config.hospitals)
        ):
            raise ProtocolError(f"round {message.round}: the contributor list {contributors} is inconsistent")
        if len(contributors) < config.dopamine.quorum:
            raise ProtocolError(f"round {message.round}: {len(contributors)} contributors, fewer than the quorum")
        pending.bytes_received_aggregate = self._transport.bytes_received - pending.bytes_received_before
        started = time.perf_counter()
        try:
            total = secret.decrypt_sum(message.chunks, round_number=message.round, contributors=contributors)
        except BfvError as error:
            raise ProtocolError(f"round {message.round}: refusing the server's sum: {error}") from None
        pending.mean = mean_gradient(total, len(contributors), mechanism=step.mechanism, settings=config.dopamine)
        pending.seconds["decrypt"] = time.perf_counter() - started
        pending.endorsed = message.contributors
        pending.statement = aggregate_statement(
            run=self._run, round_number=message.round, contributors=message.contributors, chunks=message.chunks
        )
        self._send(Endorsement(round=message.round, signature=endorse(pending.statement, self._credentials.identity.signing)))

    def _release(self, momentum: MomentumUpdate, message: Endorsements, pending: "_Contribution") -> None:
        """Use and release the sum, once every contributor has endorsed the aggregate this hospital endorsed."""
        contributors = pending.endorsed
        signers = {name: self._roster.party(name).identity.signing for name in contributors}
        try:
            check_endorsements(pending.statement, message.signatures, signers)
        except EndorsementError as error:
            raise ProtocolError(f"round {message.round}: refusing to release the sum: {error}") from None
        momentum.apply(pending.mean)
        payload = pending.mean.tobytes()
        releaser = contributors[0] == self._name
        self._send(
            Released(round=message.round, digest=release_digest(message.round, payload), mean_gradient=payload if releaser else b"")
        )
        self._rounds.append(
            {
                "round": message.round,
                "contributors": len(contributors),
                "overran_send_offset": pending.overran_send_offset,
                "seconds": pending.seconds,
                "update_bytes": pending.update_bytes,
                "received_bytes": pending.bytes_received_aggregate,
                "sent_bytes": self._transport.bytes_sent - pending.bytes_sent_before,
                "epsilon": self._ledger.epsilons(self._budget.delta),
            }
        )

    def _expect(self, *types: type[M]) -> M:
        """The next message of one of ``types``; others are logged and skipped. Times out."""
        deadline = time.monotonic() + self._timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            payload = self._transport.receive(remaining)
            if payload is None:
                break
            try:
                message = decode(payload, accept=TO_HOSPITAL, max_bytes=self._limit)
            except MessageError as error:
                self._rejections.reject("the server", "a message", str(error))
                continue
            if isinstance(message, Finish) and Finish not in types:
                raise ProtocolError(f"the server ended the run: {message.reason}")
            if isinstance(message, types):
                return message
            self._rejections.reject("the server", message.TYPE, "not expected now")
        raise ProtocolError(f"no {' or '.join(t.TYPE for t in types)} from the server within {self._timeout_s:g} s")

    def _send(self, message: Message) -> None:
        self._transport.send(encode(message))

    def _write_metrics(self, config: RunConfig | None, finish_reason: str) -> None:
        if config is None:
            return
        self._state_dir.mkdir(parents=True, exist_ok=True)
        metrics = {
            "hospital": self._name,
            "run_id": config.run_id,
            "finish_reason": finish_reason,
            "rejected_messages": self._rejections.total,
            "rounds": self._rounds,
        }
        (self._state_dir / f"metrics-{config.run_id}.json").write_text(json.dumps(metrics, indent=1))
