"""A hospital in a voting run: votes on the server's public queries, and only sealed shares leave it.

On ``VotingWelcome`` it checks the run (it is one of the hospitals; the talliers are the roster's,
each with a box key it certified for this run) and prepares its votes: AE-DPFL trains a teacher on
its own records, kNN-DPFL takes the public feature map the server sent (``training.voting.votes``).

Per ``VoteRequest`` it charges its own durable ledger, before anything leaves, for the least noise
the talliers' totals can carry (a quorum's, at the record level: one of its records changes,
``training.voting.vote_privacy``), refusing once that would take it over its budget, or once the run
has had ``MAX_VOIDS`` void rounds (no void could cancel another charge). It then adds its
Skellam share of the noise to its votes, splits them into one checked share per tallier (each count
as bits under a tag, within the run's range: ``crypto.checked_shares``) and sends each sealed to
its tallier (``protocol.voting.ballots``). Round numbers only go up, to the run's number of rounds,
so a server that asks again about a round gets no second ballot; the ledger's keys are its own, so
repeats still count. Its own policy comes first: it joins no run whose quorum is below its
``min_quorum`` (a server alone with one hospital would see that hospital's votes through the noise
of one), and none that opens the noisy totals unless it allows it. A run it refuses gets a
``Withdraw`` with the reason before the hospital exits.

**Joining again.** If its connection to the server is made again (the server restarted with
``--resume``), it says Hello again, accepts a welcome only to the run it began, checks the
talliers' keys again, and votes only in rounds after the last one its ledger charged: a round
interrupted by the crash is never voted on twice.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from consilium.protocol.voting.ballots import seal_ballot, tallier_box_keys
from consilium.protocol.voting.box_dispute import SealedBallot, reveal_for
from consilium.protocol.voting.round_void import MAX_VOIDS, VoidError, check_void
from consilium.protocol.run.site_policy import DECLINED, MISFIT, Declined, Misfit, Offer
from consilium.protocol.wire.channel import ServerChannel
from consilium.protocol.wire.messages import (
    TO_VOTING_HOSPITAL,
    Ballot,
    Dispute,
    Finish,
    ProtocolError,
    RoundVoid,
    VoteRequest,
    VotingWelcome,
    Withdraw,
)
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.wire.transport import ClientTransport, TransportError
from consilium.protocol.voting.voting_config import VotingConfig, welcomed_run
from consilium.training.privacy.accounting import Release
from consilium.training.privacy.ledger import LEDGER_FILE, PrivacyLedger
from consilium.training.privacy.budget import PrivacyBudget
from consilium.training.data.datasets import Split
from consilium.training.models.build import ModelError, check_model_for
from consilium.training.privacy.secure_random import secure_generator
from consilium.training.voting.votes import PcaFeatures, knn_votes, noise_share, teacher_votes, train_classifier

__all__ = ["VotingHospital"]

log = logging.getLogger("consilium.voting_hospital")


class VotingHospital:
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
        min_quorum: int = 2,
        allow_histogram: bool = False,
        own_model: str | None = None,
        transport: ClientTransport | None = None,
        offer: Offer | None = None,
    ) -> None:
        roster.check_own_entry(credentials)
        self._name = credentials.name
        self._roster = roster
        self._credentials = credentials
        self._data = data
        self._budget = budget
        self._state_dir = state_dir
        self._upgrade_ledger = upgrade_ledger  # read an unchained (older) ledger once: its operator's say
        self._own_model = own_model  # the name of the model its operator named (--model), if any
        self._offer = offer  # a service's: the Welcome it took, its policy and its stop flag
        self._channel = ServerChannel.connect(
            roster,
            credentials,
            accept=TO_VOTING_HOSPITAL,
            timeout_s=timeout_s,
            log=log,
            transport=transport,
            stop=offer.stop if offer else None,
        )
        self._generator = secure_generator()
        self._min_quorum = min_quorum
        self._allow_histogram = allow_histogram
        self._rounds: list[dict] = []
        self._config: VotingConfig | None = None
        self._last_round = 0  # the last round this hospital was charged for: it votes only in later ones
        self._sealed: tuple[int, dict[str, X25519PublicKey]] = (0, {})  # its last ballot's round and box keys
        self._ballot: SealedBallot | None = None  # its last ballot's boxes and their secrets, for a dispute
        self._ledger: PrivacyLedger | None = None

    def run(self) -> dict:
        """Vote until the server finishes the run or the budget is spent; returns what it did."""
        try:
            welcomed = self._offer.welcome if self._offer else None
            finish_reason = self._channel.take_part(VotingWelcome, self._take_part, self._name, welcomed)
        finally:
            self._channel.close()
            if self._ledger is not None:
                self._ledger.close()
        return {"finish_reason": finish_reason, "rounds": self._rounds}

    def _take_part(self, welcome: VotingWelcome) -> str:
        self._welcome(welcome)
        return self._rounds_loop()

    def _welcome(self, welcome: VotingWelcome) -> None:
        """Join the run (the first time), or take the talliers' keys again for the run it began."""
        if self._config is not None:
            if welcomed_run(welcome)[1] != self._run:
                raise ProtocolError(f"the server welcomed {self._name} to another run than the one it takes part in")
            self._tallier_keys = self._certified_tallier_keys(self._config, welcome.tallier_keys)
            return
        try:
            self._join(welcome)
        except ProtocolError as refusal:  # said, so that the server drops it now, not at the round's deadline
            # A decline's caps and a misfit's facts of the data stay in the site's log.
            reason = (
                DECLINED if isinstance(refusal, Declined) else MISFIT if isinstance(refusal, Misfit) else str(refusal)
            )
            with contextlib.suppress(TransportError):  # the refusal is the error to report, not the send
                self._channel.send(Withdraw(round=0, reason=reason))
            raise
        self._last_round = self._ledger.begin_run(self._config.run_id, self._run)
        if self._last_round:
            log.warning("%s resumes run %s after round %d", self._name, self._config.run_id, self._last_round)

    def _rounds_loop(self) -> str:
        """Vote in each round after the last one this hospital's ledger charged; returns why it stopped."""
        while True:
            message = self._channel.expect(VoteRequest, RoundVoid, Dispute, Finish)
            if isinstance(message, Finish):
                return message.reason
            if isinstance(message, RoundVoid):
                self._void(message)
                continue
            if isinstance(message, Dispute):
                self._reveal(message)
                continue
            if not self._last_round < message.round <= self._config.rounds:
                raise ProtocolError(
                    f"the server asked for votes on round {message.round} after round {self._last_round} of {self._config.rounds}"
                )
            self._last_round = message.round
            finish_reason = self._vote(message)
            if finish_reason or self._last_round == self._config.rounds:
                self._ledger.finish_run(self._config.run_id)
            if finish_reason:
                return finish_reason

    def _reveal(self, dispute: Dispute) -> None:
        """Reveal the disputed box's ephemeral secret where ``t + 1`` talliers attest it (``protocol.voting.box_dispute``);
        otherwise reveal nothing, and say why."""
        try:
            reveal = reveal_for(
                dispute,
                self._ballot,
                signing=self._credentials.identity.signing,
                hospital=self._name,
                roster=self._roster,
                config=self._config,
                run=self._run,
            )
        except ProtocolError as refusal:
            log.warning("%s reveals nothing: %s", self._name, refusal)
            return
        log.warning("%s reveals its box to %s of round %d, disputed", self._name, dispute.tallier, dispute.round)
        self._channel.send(reveal)

    def _void(self, message: RoundVoid) -> None:
        """Cancel the charge of the round this hospital last voted in, on every tallier's proof that it released
        nothing (``protocol.voting.round_void``); a void that proves less leaves the charge, and says why."""
        round_number, run_id = message.round, self._config.run_id
        try:
            check_void(
                message.signatures,
                round_number=round_number,
                last_ballot=self._sealed,
                voids=self._ledger.voids(run_id),
                identities=self._roster.identities(self._config.talliers),
                run=self._run,
            )
        except VoidError as error:
            log.warning("%s keeps round %d's charge: %s", self._name, message.round, error)
            return
        self._ledger.void(
            run_id=run_id, round_number=round_number, evidence={t: s.hex() for t, s in message.signatures.items()}
        )
        self._sealed = (0, {})
        log.info(
            "round %d released nothing: its charge is cancelled; %s",
            round_number,
            self._ledger.spent(self._budget.delta),
        )
        self._rounds.append({"round": round_number, "void": True, "epsilon": self._ledger.epsilons(self._budget.delta)})

    def _join(self, welcome: VotingWelcome) -> None:
        config, run = welcomed_run(welcome)
        if self._name not in config.hospitals or not set(config.hospitals) <= set(self._roster.hospitals):
            raise ProtocolError(
                f"the run's hospitals {list(config.hospitals)} do not include {self._name}, or are not all the roster's"
            )
        if config.talliers != tuple(self._roster.talliers):
            raise ProtocolError(
                f"the run's talliers {list(config.talliers)} are not the roster's {self._roster.talliers}"
            )
        if config.voting.quorum < self._min_quorum:
            raise ProtocolError(
                f"the run's quorum of {config.voting.quorum} is below this hospital's minimum of {self._min_quorum}"
            )
        if config.reveal != "labels" and not self._allow_histogram:
            raise ProtocolError(
                f"the run would reveal the noisy {config.reveal}; this hospital allows labels only (--allow-histogram)"
            )
        self._ledger = PrivacyLedger(  # read here; written from begin_run on
            self._state_dir / LEDGER_FILE, key=self._credentials.ledger_key, accept_unchained=self._upgrade_ledger
        )
        if self._offer is not None:  # on the configuration alone, before the data is read or the ledger written
            charge = _charge(config, len(self._roster.hospitals))
            self._offer.check(self._ledger, charge, rounds=config.rounds, run_id=config.run_id, fingerprint=run)
        if config.voting.method == "knn-dpfl" and config.voting.neighbours >= len(self._data):
            raise Misfit(f"{config.voting.neighbours} neighbours need more records than this hospital has")
        try:
            check_model_for(config.model, self._data, self._own_model)
        except ModelError as error:
            raise Misfit(f"this hospital refuses the run: {error}") from None
        self._run = run
        self._tallier_keys = self._certified_tallier_keys(config, welcome.tallier_keys)
        if config.voting.method == "knn-dpfl":
            try:
                features = PcaFeatures.from_bytes(
                    welcome.feature_map, features=config.features, dimensions=config.feature_dimensions
                )
            except ValueError as error:
                raise ProtocolError(f"the server's feature map is unusable: {error}") from None
            self._votes = lambda queries: knn_votes(
                features, self._data, queries, neighbours=config.voting.neighbours, classes=config.classes
            )
        elif welcome.feature_map:
            raise ProtocolError("AE-DPFL takes no feature map")
        else:
            try:
                teacher = train_classifier(config.model, self._data, epochs=config.teacher_epochs)
            except ModelError as error:
                raise Misfit(f"this hospital refuses the run: {error}") from None
            self._votes = lambda queries: teacher_votes(
                teacher, queries, config.classes, min_confidence=config.teacher_confidence
            )
        self._channel.limit = config.message_limit()
        self._field = config.field()
        self._config = config

    def _certified_tallier_keys(
        self, config: VotingConfig, tallier_keys: dict[str, bytes]
    ) -> dict[str, X25519PublicKey]:
        """Each tallier's box key for this run, checked against its identity in the roster, in the run's order."""
        if set(tallier_keys) != set(config.talliers):
            raise ProtocolError(
                f"the server relays box keys for {sorted(tallier_keys)}, not for the talliers {list(config.talliers)}"
            )
        in_order = {name: tallier_keys[name] for name in config.talliers}
        return tallier_box_keys(in_order, roster=self._roster, run=self._run)

    def _vote(self, request: VoteRequest) -> str:
        """Send this round's ballot, or withdraw (for the budget, or past the cap on void rounds); returns why it stops voting, or ""."""
        config = self._config
        queries = (
            np.frombuffer(request.queries, dtype="<f4") if len(request.queries) % 4 == 0 else np.empty(0, dtype="<f4")
        )
        if queries.size != config.queries_per_round * config.features or not np.all(np.isfinite(queries)):
            raise ProtocolError(
                f"round {request.round}: the queries are not {config.queries_per_round} finite records of {config.features} values"
            )
        least_noise = _charge(config, len(self._roster.hospitals))
        refusal = self._budget.refusal(self._ledger, least_noise, request.round) or _past_the_void_cap(
            self._ledger.voids(config.run_id)
        )
        if refusal:
            log.warning("%s withdraws: %s", self._name, refusal)
            self._channel.send(Withdraw(round=request.round, reason=refusal))
            return refusal
        # Durable before the ballot leaves: a crash can only over-count.
        self._ledger.record(least_noise, run_id=config.run_id, round_number=request.round)
        log.info("%s votes in round %d; %s", self._name, request.round, self._ledger.spent(self._budget.delta))
        votes = self._votes(queries.reshape(config.queries_per_round, *config.model.input_shape).copy())
        mechanism = config.voting.mechanism(queries=config.queries_per_round, classes=config.classes, level="record")
        layout = config.ballot_layout()
        noise = noise_share(mechanism, layout.noise_pool, generator=self._generator)
        boxes, secrets = seal_ballot(
            layout.with_abstentions(votes),
            noise,
            tallier_keys=self._tallier_keys,
            field=self._field,
            layout=layout,
            sender=self._credentials.identity.signing,
            run=self._run,
            round_number=request.round,
            hospital=self._name,
        )
        self._sealed = (request.round, dict(self._tallier_keys))  # a void of this round must name these keys
        self._ballot = SealedBallot(request.round, boxes, secrets)  # kept past a void: a dispute comes after it
        self._channel.send(Ballot(round=request.round, boxes=boxes))
        self._rounds.append({"round": request.round, "epsilon": self._ledger.epsilons(self._budget.delta)})
        return ""


def _past_the_void_cap(voids: int) -> str:
    """Why this hospital votes no more in a run with ``voids`` void rounds, or "": past the cap no void could
    cancel a round's charge, so a round that released nothing would charge it (docs/explanation/void-rounds.md,
    "After the cap")."""
    if voids < MAX_VOIDS:
        return ""
    return f"{voids} rounds of this run were void, the most a run may cancel; this hospital votes no more in it"


def _charge(config: VotingConfig, consortium: int) -> Release:
    """What each round charges a hospital's ledger before its ballot leaves: the least noise, a quorum's."""
    return config.voting.release(
        queries=config.queries_per_round,
        classes=config.classes,
        contributors=config.voting.quorum,
        coalition=config.coalition(consortium),
        level="record",
    )
