"""A tallier: opens its own share of each hospital's votes, and with the other talliers reveals only the labels.

It joins like a hospital (Hello over CurveZMQ, enrolled in the roster), checks the run's
``VotingWelcome`` (it is one of the roster's talliers, in the roster's order, which is its MPC
party number), and sends a box key made for this run alone and certified with its identity. A run
it refuses gets ``TallyFailed`` for round 0, with the reason, instead.

Per ``Shares`` it marks each hospital's box (``protocol.voting.ballots.mark_box``): OK, NONE (not one
the hospital signed for it) or BAD (signed, and it does not open to a share), with a logged reason,
and refuses one from a party that is not a hospital of the run; it then runs the round's MPC with
the other talliers (``tallier.mpc``), which agrees on the marks (``tallier.voter_marks``), checks every
ballot and counts exactly the hospitals every tallier holds a valid share from and whose ballot
passes its checks, and sends the server the labels and the hospitals refused (or, in histogram
mode, the noisy totals too). A box that 1 to ``t`` talliers marked BAD voids the round, and the
tallier signs the dispute over it (``protocol.voting.box_dispute``); the server's ``Verdict`` then
shows who was at fault, and a tallier found to have lied is kept as a deviation. A ballot whose tag check fails
(a tallier changed its input, or its hospital sent wrong tags) gets no label released, and the
server stops the run. Too few agreed voters only costs the round.

**Crashes.** If the MPC fails (a tallier left or went silent), the tallier says so
(``TallyFailed.interrupted``) and waits: the server relays the same round again once every tallier
is back. Its box key and the last round it tallied live in its sealed run state
(``tallier.run_state``), so a tallier process started again with the same command rejoins with the
same key, and it tallies a round again only with the very boxes it had for it, counting the same
voters, a few times at most. If its connection to the server is made again (the server restarted),
it says Hello again and rejoins the run it began. When the server ends the run it deletes its run
state.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

import numpy as np

from consilium.protocol.voting.ballots import BAD, OK, mark_box, tallier_key_context
from consilium.protocol.voting.box_dispute import dispute_key, judge, sign_dispute
from consilium.protocol.voting.round_void import sign_void
from consilium.protocol.wire.channel import STOPPED, ServerChannel
from consilium.protocol.run.rules import ConfigError
from consilium.protocol.wire.messages import (
    TO_TALLIER,
    Finish,
    Labels,
    ProtocolError,
    RunKey,
    Shares,
    TallyFailed,
    Verdict,
    VotingWelcome,
)
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.wire.transcript import Transcript
from consilium.protocol.wire.transport import TransportError
from consilium.protocol.voting.voting_config import VotingConfig, welcomed_run
from consilium.tallier.mpc import DeviationError, MpcError, TamperError, VoterError, run_round
from consilium.tallier.voter_marks import DisputeError
from consilium.tallier.mpc_network import mpc_party
from consilium.tallier.run_state import KeptOutput, RunState, RunStateFile, boxes_digest
from consilium.tallier.tallier_policy import TallierPolicy

__all__ = ["Tallier"]

log = logging.getLogger("consilium.tallier")


class Tallier:
    def __init__(
        self,
        *,
        roster: Roster,
        credentials: Credentials,
        state_dir: Path,
        timeout_s: float = 180.0,
        mpc_timeout_s: float = 120.0,
        transcript: Path | None = None,
        policy: TallierPolicy = TallierPolicy(),
        mpc_listen: tuple[str, int] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        roster.check_own_entry(credentials)
        if credentials.name not in roster.talliers:
            raise ConfigError(f"{credentials.name} is not a tallier of the roster")
        self._name = credentials.name
        self._roster = roster
        self._credentials = credentials
        self._party = mpc_party(roster, credentials, mpc_listen)
        self._mpc_timeout_s = mpc_timeout_s
        self._policy = policy
        self._state_file = RunStateFile(state_dir, name=credentials.name, identity=credentials.identity)
        self._state: RunState | None = None
        self._channel = ServerChannel.connect(
            roster,
            credentials,
            accept=TO_TALLIER,
            timeout_s=timeout_s,
            log=log,
            transcript=Transcript(transcript, payloads=True) if transcript else None,
            stop=stop,  # a service's: every wait for the server ends within a second of it
        )
        self._rounds: list[dict] = []

    def run(self) -> dict:
        """Tally until the server finishes the run; returns what it did."""
        try:
            finish_reason = self._channel.take_part(VotingWelcome, self._take_part, self._name)
            if finish_reason != STOPPED:  # a stopped service's run may go on: it rejoins with the same key
                self._state_file.delete()  # the run is over: no later leak of long-term keys opens its boxes
        finally:
            self._channel.close()
        return {"finish_reason": finish_reason, "rounds": self._rounds}

    def _take_part(self, welcome: VotingWelcome) -> str:
        self._join(welcome)
        return self._rounds_loop()

    def _rounds_loop(self) -> str:
        """Tally each round the server relays; returns why the run ended."""
        while True:
            message = self._channel.expect(Shares, Verdict, Finish)
            if isinstance(message, Finish):
                return message.reason
            if isinstance(message, Verdict):
                self._take_verdict(message)
                continue
            digest = boxes_digest(message.boxes)
            if message.round == self._state.last_round and self._state.voided and digest == self._state.last_boxes:
                self._send_void(message.round, "it released nothing, and is void", pin=False)  # the same void again
                continue
            refusal = self._state.refusal(message.round, digest, self._config.rounds)
            if refusal:
                self._channel.rejections.reject("the server", message.TYPE, refusal)
                continue
            self._state = self._state.tallying(message.round, digest)
            self._state_file.save(self._state)  # before any share is opened: a restart keeps the same rule
            self._tally(message)

    def _pin(self, voters: tuple[str, ...]) -> None:
        """Keep the round's agreed voters, on disk before anything else of it is opened: a round tallied
        again must count the same (``ValueError`` if it would not)."""
        self._state = self._state.agreed(voters)
        self._state_file.save(self._state)

    def _no_labels(self, round_number: int, error: VoterError | TamperError | DeviationError | MpcError) -> None:
        """Tell the server why the round has no labels: with a signed void where it failed for too few voters
        before any output was computed (``protocol.voting.round_void``). A deviation is kept on disk first: this
        tallier tallies nothing more of the run, whatever a server relays."""
        log.warning("round %d: no labels: %s", round_number, error)
        disputes = self._disputes(round_number, error.disputes) if isinstance(error, DisputeError) else {}
        if isinstance(error, VoterError) and not self._state.output_begun:
            self._send_void(round_number, str(error), disputes=disputes)
            return
        if isinstance(error, (TamperError, DeviationError)):
            self._state = self._state.deviated(str(error))
            self._state_file.save(self._state)
        tampered = error.ballots if isinstance(error, TamperError) else ()
        interrupted = isinstance(error, MpcError)  # the server may relay the same round again
        self._channel.send(
            TallyFailed(
                round=round_number,
                reason=str(error),
                tampered=tampered,
                deviated=isinstance(error, (TamperError, DeviationError)),
                interrupted=interrupted,
                void=b"",
                disputes=disputes,
            )
        )

    def _disputes(self, round_number: int, disputes: tuple[tuple[str, str, int, bytes], ...]) -> dict[str, bytes]:
        """This tallier's signature of each dispute the talliers opened in step 1 (``protocol.voting.box_dispute``)."""
        keys = [dispute_key(*dispute) for dispute in disputes]
        signing = self._credentials.identity.signing
        return {key: sign_dispute(signing, run=self._run, round_number=round_number, key=key) for key in keys}

    def _take_verdict(self, verdict: Verdict) -> None:
        """Judge a settled dispute as the server did, from what the verdict carries alone; a tallier found to have
        lied is kept as a deviation, on disk: this tallier tallies nothing more of the run."""
        try:
            finding = judge(verdict, roster=self._roster, config=self._config, run=self._run)
        except ProtocolError as error:
            self._channel.rejections.reject("the server", verdict.TYPE, str(error))
            return
        if finding.named == verdict.tallier:
            log.error("%s", finding.reason)
            self._state = self._state.deviated(finding.reason)
            self._state_file.save(self._state)
        else:
            log.warning("%s", finding.reason)

    def _send_void(
        self, round_number: int, reason: str, *, pin: bool = True, disputes: dict[str, bytes] | None = None
    ) -> None:
        """Pin the round void, on disk before the signature leaves (it is never tallied again), unless it is
        pinned already, and send the signed void with the reason (``protocol.voting.round_void``)."""
        if pin:  # its disputes with it: a void sent again (a retry, a resumed server) still carries them
            self._state = self._state.void(disputes or {})
            self._state_file.save(self._state)
        void = sign_void(
            self._credentials.identity.signing,
            run=self._run,
            round_number=round_number,
            tallier=self._name,
            box_key=self._state.box_key.public_key(),
        )
        log.warning("round %d released nothing: this tallier signs its void", round_number)
        self._channel.send(
            TallyFailed(
                round=round_number,
                reason=reason,
                tampered=(),
                deviated=False,
                interrupted=False,
                void=void,
                disputes=self._state.disputes,
            )
        )

    def _keep(self, output: KeptOutput) -> None:
        """Keep the round's output as its computation begins (its placement, counted voters and this tallier's
        shares of its totals), on disk before any of it is computed: a round tallied again counts exactly this
        (``ValueError`` if one was kept already)."""
        self._state = self._state.keeping(output)
        self._state_file.save(self._state)

    def _join(self, welcome: VotingWelcome) -> None:
        try:
            config, run = self._check(welcome)
        except ProtocolError as refusal:  # said, so that the server stops now, not when it gives up on the box key
            with contextlib.suppress(TransportError):  # the refusal is the error to report, not the send
                self._channel.send(
                    TallyFailed(
                        round=0,
                        reason=str(refusal),
                        tampered=(),
                        deviated=False,
                        interrupted=False,
                        void=b"",
                        disputes={},
                    )
                )
            raise
        if self._state is None:
            self._state = self._state_file.load(run)
            if self._state is None:
                self._state = RunState.new(
                    run, identity=self._credentials.identity, context=tallier_key_context(run, self._name)
                )
                self._state_file.save(self._state)
            else:
                log.warning("%s rejoins run %s after round %d", self._name, config.run_id, self._state.last_round)
        self._config, self._run, self._field = config, run, config.field()
        self._channel.limit = config.message_limit()
        self._channel.send(RunKey(certified_key=self._state.certified_key))
        log.info("%s joined run %s and sent its box key", self._name, config.run_id)

    def _check(self, welcome: VotingWelcome) -> tuple[VotingConfig, str]:
        """The run ``welcome`` offers and its fingerprint, if this tallier takes part in it (``ProtocolError``)."""
        config, run = welcomed_run(welcome)
        if self._state is not None and run != self._state.run:
            raise ProtocolError(f"the server welcomed {self._name} to run {run}, not to the run it takes part in")
        if config.talliers != tuple(self._roster.talliers):
            raise ProtocolError(
                f"the run's talliers {list(config.talliers)} are not the roster's {self._roster.talliers}"
            )
        if refusal := self._policy.refusal(config):
            raise ProtocolError(refusal)
        if not set(config.hospitals) <= set(self._roster.hospitals):
            raise ProtocolError(
                f"the run names {sorted(set(config.hospitals) - set(self._roster.hospitals))} as hospitals; the roster does not"
            )
        return config, run

    def _marked_boxes(self, message: Shares) -> tuple[dict[str, np.ndarray], dict[str, bytes]]:
        """This tallier's share of each hospital's ballot whose box it marks OK, and the digest of each it marks BAD;
        a box marked NONE, or from a party that is not a hospital of the run, is rejected, its hospital left out."""
        config, layout = self._config, self._config.ballot_layout()
        shares, bad = {}, {}
        for hospital, box in message.boxes.items():
            if hospital not in config.hospitals:
                self._channel.rejections.reject(
                    "the server", message.TYPE, f"a share from {hospital!r}, not a hospital of the run"
                )
                continue
            marked = mark_box(
                box,
                recipient=self._state.box_key,
                hospital_key=self._roster.party(hospital).identity.signing,
                field=self._field,
                values=layout.values,
                run=self._run,
                round_number=message.round,
                hospital=hospital,
                tallier=self._name,
            )
            if marked.mark == OK:
                shares[hospital] = marked.share
                continue
            if marked.mark == BAD:
                bad[hospital] = marked.digest
            self._channel.rejections.reject("the server", message.TYPE, marked.reason)
        return shares, bad

    def _tally(self, message: Shares) -> None:
        config, layout, started = self._config, self._config.ballot_layout(), time.perf_counter()
        shares, bad = self._marked_boxes(message)
        log.info("round %d: valid shares from %d hospitals; the MPC starts", message.round, len(shares))
        try:
            result = run_round(
                self._party,
                message.round,
                shares,
                hospitals=config.hospitals,
                quorum=config.voting.quorum,
                layout=layout,
                field=self._field,
                reveal=config.reveal,
                label_threshold=config.label_threshold,
                timeout_s=self._mpc_timeout_s,
                on_voters=self._pin,
                kept=self._state.kept,
                on_output=self._keep,
                bad=bad,
            )
        except (VoterError, TamperError, DeviationError, MpcError) as error:
            self._no_labels(message.round, error)
            return
        seconds = time.perf_counter() - started
        self._channel.send(
            Labels(
                round=message.round,
                voters=result.voters,
                refused=tuple(result.refused),
                refused_because=tuple(result.refused.values()),
                labels=tuple(int(label) for label in result.labels),
                totals=b"" if result.totals is None else result.totals.astype("<i8").tobytes(),
                mpc_microseconds=round(seconds * 1e6),
                mpc_bytes=result.bytes_sent,
            )
        )
        if result.refused:
            log.warning(
                "round %d: ballots refused: %s",
                message.round,
                "; ".join(f"{name} ({why})" for name, why in result.refused.items()),
            )
        self._rounds.append(
            {
                "round": message.round,
                "voters": len(result.voters),
                "refused": list(result.refused),
                "seconds": seconds,
                "bytes_sent": result.bytes_sent,
            }
        )
