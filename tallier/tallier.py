"""A tallier: opens its own share of each hospital's votes, and with the other talliers reveals only the labels.

It joins like a hospital (Hello over CurveZMQ, enrolled in the roster), checks the run's
``VotingWelcome`` (it is one of the roster's talliers, in the roster's order, which is its MPC
party number), and sends a box key made for this run alone and certified with its identity, so
that no later leak of its long-term keys opens the shares a server recorded. A run it refuses gets
``TallyFailed`` for round 0, with the reason, instead.

Per ``Shares`` it opens each hospital's box (``protocol.ballots``), refusing, with a logged reason,
a box that does not open or holds no valid share (wrong length, outside the field), or one from a
party that is not a hospital of the run; it then runs the round's MPC with the other talliers
(``tallier.mpc``), which checks every ballot and counts exactly the hospitals every tallier holds
a valid share from and whose ballot passes its range check, and sends the server the labels and
the hospitals refused (or, in histogram mode, the noisy totals too). A ballot whose tag check fails
(a tallier changed its input, or its hospital sent wrong tags) gets no label released, and the
server stops the run. It takes part in each
round once, in increasing order.

If the MPC fails (a tallier left or went silent), MPyC's state in this process is unusable: the
tallier tells the server and stops. Too few agreed voters only costs the round.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from crypto.sealed_box import certify_key
from protocol.ballots import BallotError, open_share, tallier_key_context
from protocol.channel import ServerChannel
from protocol.config import ConfigError
from protocol.messages import (
    TO_TALLIER,
    Finish,
    Hello,
    Labels,
    ProtocolError,
    RunKey,
    Shares,
    TallyFailed,
    VotingWelcome,
)
from protocol.party_keys import Credentials
from protocol.roster import Roster
from protocol.transcript import Transcript
from protocol.transport import TransportError
from protocol.voting_config import VotingConfig
from tallier.mpc import MpcError, TamperError, VoterError, mpc_party, run_round

__all__ = ["Tallier"]

log = logging.getLogger("consilium.tallier")


class Tallier:
    def __init__(
        self,
        *,
        roster: Roster,
        credentials: Credentials,
        timeout_s: float = 180.0,
        mpc_timeout_s: float = 120.0,
        transcript: Path | None = None,
        allow_histogram: bool = False,
    ) -> None:
        roster.check_own_entry(credentials)
        if credentials.name not in roster.talliers:
            raise ConfigError(f"{credentials.name} is not a tallier of the roster")
        self._name = credentials.name
        self._roster = roster
        self._credentials = credentials
        self._party = mpc_party(roster, credentials)
        self._mpc_timeout_s = mpc_timeout_s
        self._allow_histogram = allow_histogram
        self._channel = ServerChannel.connect(
            roster,
            credentials,
            accept=TO_TALLIER,
            timeout_s=timeout_s,
            log=log,
            transcript=Transcript(transcript, payloads=True) if transcript else None,
        )
        self._rounds: list[dict] = []

    def run(self) -> dict:
        """Tally until the server finishes the run; returns what it did. ``MpcError`` if the MPC failed."""
        finish_reason = ""
        try:
            self._channel.send(Hello())
            welcome = self._channel.expect(VotingWelcome)
            try:
                self._join(welcome)
            except ProtocolError as refusal:  # said, so that the server stops now, not when it gives up on the box key
                with contextlib.suppress(TransportError):  # the refusal is the error to report, not the send
                    self._channel.send(TallyFailed(round=0, reason=str(refusal), tampered=()))
                raise
            last_round = 0
            while not finish_reason:
                message = self._channel.expect(Shares, Finish)
                if isinstance(message, Finish):
                    finish_reason = message.reason
                elif not last_round < message.round <= self._config.rounds:
                    self._channel.rejections.reject(
                        "the server",
                        message.TYPE,
                        f"round {message.round} after round {last_round} of {self._config.rounds}",
                    )
                else:
                    last_round = message.round
                    self._tally(message)
        finally:
            self._channel.close()
        return {"finish_reason": finish_reason, "rounds": self._rounds}

    def _join(self, welcome: VotingWelcome) -> None:
        try:
            config = VotingConfig.from_dict(welcome.config)
        except ConfigError as error:
            raise ProtocolError(f"the server's voting configuration is unusable: {error}") from None
        if config.talliers != tuple(self._roster.talliers):
            raise ProtocolError(
                f"the run's talliers {list(config.talliers)} are not the roster's {self._roster.talliers}"
            )
        if config.reveal != "labels" and not self._allow_histogram:
            raise ProtocolError(
                f"the run would reveal the noisy {config.reveal}; this tallier opens labels only (--allow-histogram)"
            )
        if not set(config.hospitals) <= set(self._roster.hospitals):
            raise ProtocolError(
                f"the run names {sorted(set(config.hospitals) - set(self._roster.hospitals))} as hospitals; the roster does not"
            )
        self._config, self._run, self._field = config, config.fingerprint(welcome.feature_map), config.field()
        self._channel.limit = config.message_limit()
        # Never written anywhere: a later leak of this tallier's long-term keys opens no recorded share.
        self._box_key = X25519PrivateKey.generate()
        certified = certify_key(
            self._box_key.public_key(),
            signer=self._credentials.identity.signing,
            context=tallier_key_context(self._run, self._name),
        )
        self._channel.send(RunKey(certified_key=certified))
        log.info("%s joined run %s and sent its box key", self._name, config.run_id)

    def _tally(self, message: Shares) -> None:
        config, layout, started = self._config, self._config.ballot_layout(), time.perf_counter()
        shares = {}
        for hospital, box in message.boxes.items():
            if hospital not in config.hospitals:
                self._channel.rejections.reject(
                    "the server", message.TYPE, f"a share from {hospital!r}, not a hospital of the run"
                )
                continue
            try:
                shares[hospital] = open_share(
                    box,
                    recipient=self._box_key,
                    hospital_key=self._roster.party(hospital).identity.signing,
                    field=self._field,
                    values=layout.values,
                    run=self._run,
                    round_number=message.round,
                    hospital=hospital,
                    tallier=self._name,
                )
            except BallotError as error:
                self._channel.rejections.reject("the server", message.TYPE, str(error))
        log.info("round %d: valid shares from %d hospitals; the MPC starts", message.round, len(shares))
        try:
            result = run_round(
                self._party,
                message.round,
                shares,
                hospitals=config.hospitals,
                quorum=config.voting.quorum,
                layout=layout,
                classes=config.classes,
                field=self._field,
                reveal=config.reveal,
                label_threshold=config.label_threshold,
                timeout_s=self._mpc_timeout_s,
            )
        except (VoterError, TamperError, MpcError) as error:
            log.warning("round %d: no labels: %s", message.round, error)
            tampered = error.ballots if isinstance(error, TamperError) else ()
            self._channel.send(TallyFailed(round=message.round, reason=str(error), tampered=tampered))
            if isinstance(error, MpcError):
                raise
            return
        seconds = time.perf_counter() - started
        self._channel.send(
            Labels(
                round=message.round,
                voters=result.voters,
                refused=result.refused,
                labels=tuple(int(label) for label in result.labels),
                totals=b"" if result.totals is None else result.totals.astype("<i8").tobytes(),
                mpc_microseconds=round(seconds * 1e6),
                mpc_bytes=result.bytes_sent,
            )
        )
        if result.refused:
            log.warning(
                "round %d: ballots refused (outside the run's range): %s", message.round, ", ".join(result.refused)
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
