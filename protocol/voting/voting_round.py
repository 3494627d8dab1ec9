"""The voting server's side of one round: ballots in, labels back.

1. ``collect_ballots``: each active hospital sends one sealed box per tallier (``protocol.voting.ballots``),
   of the length its noisy votes make; the server can open none of them. A hospital that sends none
   in time is dropped; one that sends a box it did not sign for its tallier, the run and the round
   (``BallotSeals``) is expelled, named, and its ballot is not relayed.
2. The server relays each tallier its boxes (``Shares``); ``collect_labels`` then waits for every
   tallier's answer. Every tallier must report the same voters, refused hospitals (whose ballots
   failed a check inside the MPC), labels and totals. If every one reports the same failure of
   too few agreed voters (fewer ballots than the quorum are relayed too, to end so), the round is
   lost and the run goes on, and where every tallier's void verifies the hospitals get it (a tallier
   that withholds a void ``t + 1`` others signed is named, and the run stops). If the
   MPC was interrupted (a tallier reports it did not finish, or sends nothing: it left),
   ``TallyInterrupted`` names the talliers that did not answer, so that the server can relay the
   same boxes again once they are back (``tally`` does so up to ``MAX_TALLY_ATTEMPTS`` times a
   round). A deviation (a ballot's tag check or a MAC check failed: a tallier deviated,
   or a hospital sent wrong tags), any other failure, or disagreement stops the run, as do
   talliers that count voters or refuse ballots the server did not relay.
3. A round that failed with disputed boxes (a box 1 to ``t`` talliers marked BAD) has them settled
   before it ends, however it failed (``protocol.voting.box_dispute``): the hospital reveals that
   box's secret, and the tallier or the hospital at fault is named.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from consilium.protocol.identity.roster import Roster
from consilium.protocol.voting.ballots import BallotError, box_bytes, tallier_box_keys, verify_ballot
from consilium.protocol.voting.box_dispute import BoxDisputes
from consilium.protocol.voting.round_void import void_signers
from consilium.protocol.wire.messages import Ballot, Labels, ProtocolError, RoundVoid, Shares, TallyFailed
from consilium.protocol.run.participants import Participants
from consilium.protocol.voting.tallier_keys import TallierKeys
from consilium.protocol.voting.voting_config import VotingConfig

__all__ = [
    "MAX_TALLY_ATTEMPTS",
    "BallotSeals",
    "RoundRecord",
    "TallyInterrupted",
    "collect_ballots",
    "collect_labels",
    "tally",
]

MAX_TALLY_ATTEMPTS = 3  # per round: the first, and two more after interrupted MPCs

log = logging.getLogger("consilium.voting_server")


class TallyInterrupted(ProtocolError):
    """The talliers' MPC did not finish; ``silent`` sent no answer (left, or were cut off)."""

    def __init__(self, reason: str, silent: list[str]) -> None:
        super().__init__(reason)
        self.silent = silent


@dataclass
class RoundRecord:
    round: int
    status: str  # "labelled", "aborted", or "stopped" (the run stopped in it)
    tally_attempts: int = 0  # how often the talliers were given the round's boxes (more after an interrupted MPC)
    voters: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # ballots that failed the talliers' checks, left out
    refused_because: list[str] = field(default_factory=list)  # the check each failed
    void: dict[str, str] = field(default_factory=dict)  # every tallier's signed void (hex), if it released nothing
    disputes: list[str] = field(default_factory=list)  # what became of each disputed box (who was at fault)
    label_accuracy: float | None = None  # of the released labels
    labels_withheld: int = 0  # queries whose noisy top total was below the label threshold
    epsilon: dict[str, dict[str, float]] = field(default_factory=dict)  # level -> view -> epsilon
    mpc_seconds: float | None = None  # the slowest tallier's, shares opened and MPC
    mpc_bytes: dict[str, int] = field(default_factory=dict)  # per tallier, sent to the others
    seconds: dict[str, float] = field(default_factory=dict)
    reason: str = ""


class BallotSeals:
    """What the server checks of a ballot's boxes, besides their length: that the hospital signed each for its
    tallier's box key of the run (as each tallier certified it), the run and the round (``verify_ballot``)."""

    def __init__(self, roster: Roster, run: str, certified_keys: dict[str, bytes]) -> None:
        self.talliers, self._roster, self._run = tuple(certified_keys), roster, run
        self._keys = tallier_box_keys(certified_keys, roster=roster, run=run)  # as the hospitals seal to them

    def refusal(self, hospital: str, round_number: int, boxes: dict[str, bytes]) -> str:
        """Why ``hospital``'s boxes of ``round_number`` are refused, or "" if every one verifies."""
        try:
            verify_ballot(
                boxes,
                tallier_keys=self._keys,
                hospital_key=self._roster.party(hospital).identity.signing,
                run=self._run,
                round_number=round_number,
                hospital=hospital,
            )
        except BallotError as error:
            return str(error)
        return ""

    def void_signers(self, signatures: dict[str, bytes], round_number: int) -> set[str]:
        """The talliers whose void of ``round_number`` verifies under the box key the boxes were sealed to, as a
        hospital checks it (``protocol.voting.round_void``)."""
        return void_signers(
            signatures,
            run=self._run,
            round_number=round_number,
            identities=self._roster.identities(self.talliers),
            box_keys=self._keys,
        )


def collect_ballots(
    participants: Participants, round_number: int, seals: BallotSeals, values: int, timeout_s: float
) -> dict[str, dict[str, bytes]]:
    """Each active hospital's boxes, one per tallier of the length a share of ``values`` field elements makes,
    each signed by it (``seals``); the late are dropped, and a hospital whose box is not its own is expelled."""
    parties = participants.parties
    ballots: dict[str, dict[str, bytes]] = {}
    deadline = time.monotonic() + timeout_s
    length = box_bytes(values)

    def waiting() -> bool:  # checked again after a withdrawal, which next_message takes in and does not return
        return not set(participants.active) <= set(ballots)

    while waiting() and (got := participants.next_message(deadline, waiting)) is not None:
        sender, message = got
        if not (isinstance(message, Ballot) and sender in participants.active and message.round == round_number):
            parties.reject(sender, message, f"expected a ballot for round {round_number}")
        elif sender in ballots:
            parties.reject(sender, message, f"second ballot for round {round_number}")
        elif set(message.boxes) != set(seals.talliers) or any(len(box) != length for box in message.boxes.values()):
            parties.reject(sender, message, f"a ballot needs one box of {length} bytes for each tallier")
        elif refusal := seals.refusal(sender, round_number, message.boxes):
            participants.expel(sender, f"round {round_number}: {refusal}")  # no honest hospital sends it
        else:
            ballots[sender] = message.boxes
    for name in set(participants.active) - set(ballots):
        participants.drop(name, f"sent no ballot for round {round_number} within {timeout_s:g} s")
    return ballots


def tally(
    participants: Participants,
    talliers: TallierKeys,
    config: VotingConfig,
    record: RoundRecord,
    ballots: dict[str, dict[str, bytes]],
    timeout_s: float,
    disputes: BoxDisputes,
    seals: BallotSeals,
) -> np.ndarray | None:
    """Relay each tallier its boxes and take the labels (``collect_labels``), relaying the same boxes again
    after an interrupted MPC once every silent tallier is back; then check that the talliers counted a
    quorum of the relayed ballots and refused only ballots they left out. A failed round's disputed boxes
    are settled (``disputes``) before it ends. It is void where every tallier's void verifies (``seals``);
    a tallier that withholds a void ``t + 1`` others signed is named, and the run stops."""
    claims: dict[str, dict[str, bytes]] = {}  # each tallier's signed disputes, from its latest answer
    try:
        labels = _tally_attempts(participants, talliers, config, record, ballots, timeout_s, claims)
    except ProtocolError:  # a tallier that answers otherwise than the others, or late, does not escape its dispute
        record.disputes = disputes.settle(participants, record.round, ballots, claims, timeout_s)
        raise
    if labels is None:
        offered = {name: bytes.fromhex(signature) for name, signature in record.void.items()}
        signers = seals.void_signers(offered, record.round)
        record.void = record.void if signers == set(config.talliers) else {}
        if record.void:  # nothing was computed: the hospitals' charges are cancelled
            for hospital in ballots:
                participants.parties.send(hospital, RoundVoid(round=record.round, signatures=offered))
        record.disputes = disputes.settle(participants, record.round, ballots, claims, timeout_s)
        if len(signers) > config.corrupt_talliers and (withheld := sorted(set(config.talliers) - signers)):
            raise ProtocolError(_withheld_void(record, withheld, signers))
        return None
    if set(record.voters) - set(ballots) or len(record.voters) < config.voting.quorum:
        raise ProtocolError(
            f"round {record.round}: the talliers counted voters {record.voters}, not a quorum of those relayed"
        )
    if (
        set(record.refused) - set(ballots)
        or set(record.refused) & set(record.voters)
        or len(record.refused_because) != len(record.refused)
    ):
        raise ProtocolError(f"round {record.round}: the talliers refused {record.refused}, not ballots they left out")
    return labels


def _withheld_void(record: RoundRecord, withheld: list[str], signers: set[str]) -> str:
    """Why the run stops where ``t + 1`` talliers (``signers``) voided the round and the others (``withheld``) did
    not: in a round tallied once, honest talliers sign alike, so those others withheld it; tallied again, an honest
    tallier may have begun its output in an earlier tally and rightly sign nothing, so no one is named."""
    voided = f"round {record.round}: {', '.join(sorted(signers))} voided it, and {', '.join(withheld)}"
    if record.tally_attempts == 1:
        return f"{voided} sent no valid void: it withheld it; the run stops"
    return f"{voided} did not, after {record.tally_attempts} tallies (an earlier one may have begun an output); the run stops"


def _tally_attempts(
    participants: Participants,
    talliers: TallierKeys,
    config: VotingConfig,
    record: RoundRecord,
    ballots: dict[str, dict[str, bytes]],
    timeout_s: float,
    claims: dict[str, dict[str, bytes]],
) -> np.ndarray | None:
    """``collect_labels`` for the relayed boxes, relaying them again after an interrupted MPC once every silent
    tallier is back, up to ``MAX_TALLY_ATTEMPTS`` times."""
    while True:
        record.tally_attempts += 1
        talliers.relayed()
        for tallier in config.talliers:
            shares = Shares(round=record.round, boxes={voter: boxes[tallier] for voter, boxes in ballots.items()})
            participants.parties.send(tallier, shares)
        try:
            return collect_labels(participants, config, record, timeout_s, talliers.rejoined, claims)
        except TallyInterrupted as interrupted:
            if record.tally_attempts == MAX_TALLY_ATTEMPTS:
                raise ProtocolError(f"{interrupted}; tried {record.tally_attempts} times, the run stops") from None
            log.warning("%s; the same boxes go to the talliers again once every one is back", interrupted)
            talliers.await_back(set(interrupted.silent), record.round, claims)


def collect_labels(
    participants: Participants,
    config: VotingConfig,
    record: RoundRecord,
    timeout_s: float,
    rejoined: set[str] = frozenset(),
    claims: dict[str, dict[str, bytes]] | None = None,
) -> np.ndarray | None:
    """The labels every tallier reports alike; None if every tallier reports that it could not tally
    (too few agreed voters: the round is lost); ``TallyInterrupted`` if the MPC did not finish;
    ``ProtocolError`` for anything else, which stops the run. ``rejoined`` (filled while this waits)
    holds the talliers that said Hello again since they were sent the boxes: they will not answer.
    ``claims`` is given each tallier's signed disputes, whatever the outcome."""
    round_number = record.round
    answers = _answers(participants, config, round_number, timeout_s, rejoined)
    if claims is not None:
        claims.update({name: a.disputes for name, a in answers.items() if isinstance(a, TallyFailed)})
    failures = {name: a.reason for name, a in answers.items() if isinstance(a, TallyFailed)}
    missing = sorted(set(config.talliers) - set(answers))
    interrupted = {name for name, a in answers.items() if isinstance(a, TallyFailed) and a.interrupted}
    voided = {name for name, a in answers.items() if isinstance(a, TallyFailed) and a.void}
    if (interrupted or missing) and not set(failures) - interrupted - (voided if missing else set()):
        # with talliers missing, one that signed a void signs it again, with its disputes, when relayed the same boxes
        said = "; ".join(f"{name}: {failures[name]}" for name in sorted(interrupted))
        silent = f"{', '.join(missing)} sent nothing" + (
            "" if set(missing) <= set(rejoined) else f" within {timeout_s:g} s"
        )
        raise TallyInterrupted(
            f"round {round_number}: the talliers' MPC did not finish"
            + (f" ({said})" if said else "")
            + (f"; {silent}" if missing else ""),
            missing,
        )
    if failures and not missing and len(failures) == len(answers) and len(set(failures.values())) == 1:
        record.reason = f"no labels: {next(iter(failures.values()))}"
        if any(a.deviated for a in answers.values()):  # someone deviated: the consortium must find out who first
            raise ProtocolError(f"{record.reason}; the run stops")
        record.void = {name: a.void.hex() for name, a in answers.items() if a.void}  # as offered: tally verifies
        return None
    if failures or missing:
        said = "; ".join(f"{name} could not tally round {round_number}: {reason}" for name, reason in failures.items())
        silent = (
            f"{', '.join(missing)} sent no labels for round {round_number} within {timeout_s:g} s" if missing else ""
        )
        raise ProtocolError("; ".join(part for part in (said, silent) if part))
    if len({(a.voters, a.refused, a.refused_because, a.labels, a.totals) for a in answers.values()}) != 1:
        raise ProtocolError(f"the talliers disagree on the labels of round {round_number}")
    first = next(iter(answers.values()))
    record.voters = list(first.voters)
    record.refused = list(first.refused)
    record.refused_because = list(first.refused_because)
    record.mpc_seconds = max(a.mpc_microseconds for a in answers.values()) / 1e6
    record.mpc_bytes = {name: a.mpc_bytes for name, a in answers.items()}
    return np.array(first.labels, dtype=np.int64)


def _answers(
    participants: Participants, config: VotingConfig, round_number: int, timeout_s: float, rejoined: set[str]
) -> dict[str, Labels | TallyFailed]:
    """Each tallier's one answer for the round, labels of the right shape or a failure, until all answered (or
    said Hello again) or the time is up."""
    parties = participants.parties
    answers: dict[str, Labels | TallyFailed] = {}
    deadline = time.monotonic() + timeout_s
    most_label = config.classes if config.label_threshold else config.classes - 1  # C: withheld

    def waiting() -> bool:
        return not set(answers) | set(rejoined) >= set(config.talliers)

    while waiting() and (got := participants.next_message(deadline, waiting)) is not None:
        sender, message = got
        if not (
            isinstance(message, (Labels, TallyFailed)) and sender in config.talliers and message.round == round_number
        ):
            parties.reject(sender, message, f"expected the labels of round {round_number}")
        elif sender in answers:
            parties.reject(sender, message, f"second answer for round {round_number}")
        elif isinstance(message, Labels) and (
            len(message.labels) != config.queries_per_round or max(message.labels, default=0) > most_label
        ):
            parties.reject(sender, message, f"labels must be {config.queries_per_round} values up to {most_label}")
        else:
            answers[sender] = message
    return answers
