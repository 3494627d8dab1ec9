"""Box disputes: naming whoever left a hospital out of a voting round, the tallier or the hospital itself.

The design, the argument for each property and its reviews are in
``docs/explanation/authenticated-labels.md`` ("Naming a tallier that leaves a hospital out")::

    T <-> T  step 1 (tallier.voter_marks): a box that 1 to t talliers marked BAD voids the round,
             and every tallier signs, for each such mark, "X marked H's box of digest d in round r
             BAD" (sign_dispute), from the opened marks, which every tallier sees alike
    T -> S   TallyFailed(..., disputes)
    S        a statement t + 1 talliers of the run signed is attested (attested_disputes); a digest
             that is not the box the server verified and relayed to X names X at once: X lied about it
    S -> H   Dispute(r, X, box, signatures)
    H        reveal_for: t + 1 signatures of the box's digest, r its last ballot's round, the box the
             one it sealed to X, at most t boxes a round; else it reveals nothing
    H -> S   Reveal(r, X, e, signature)          within the server's round timeout
    S -> T   Verdict; the server and each tallier judge it alike (judge): the box opens to a share
             under the key X derives from e: X lied, the run stops, and every honest tallier keeps
             it (tallier.run_state); it does not: H is named and expelled; no Reveal: H is expelled
             as silent (it cannot show its box), and no tallier is named

Only ``t + 1`` talliers' word makes a hospital reveal, so an honest tallier attests every dispute,
and an honest tallier marks BAD only a box that does not open: an honest hospital reveals only a
box a corrupt tallier holds, whose share that tallier has. ``e`` opens that one box (``E`` and ``R``
are in its key), so nothing else of the ballot is disclosed. The hospital signs its ``Reveal``, so a
server cannot pin a wrong secret on it, and the talliers' signatures bind the box's digest, so a
server cannot swap the box.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from consilium.crypto.sealed_box import SealedBoxError, verify_certified_key
from consilium.protocol.identity.roster import Roster
from consilium.protocol.run.participants import Participants
from consilium.protocol.voting.ballots import (
    BAD,
    NONE,
    OK,
    BallotError,
    box_digest,
    revealed_share,
    tallier_key_context,
)
from consilium.protocol.voting.voting_config import VotingConfig
from consilium.protocol.wire.messages import Dispute, ProtocolError, Reveal, Verdict

__all__ = [
    "AttestedDispute",
    "BoxDisputes",
    "Finding",
    "SealedBallot",
    "attested_disputes",
    "dispute_key",
    "judge",
    "reveal_for",
    "sign_dispute",
    "unrelayed_marks",
]

log = logging.getLogger("consilium.voting_server")


@dataclass(frozen=True)
class AttestedDispute:
    hospital: str
    tallier: str  # who marked the hospital's box
    mark: int  # OK, NONE or BAD (protocol.voting.ballots)
    digest: bytes  # the box's SHA-256 as the talliers opened it, if marked BAD; else empty
    signatures: dict[str, bytes]  # by tallier, each verified: t + 1 or more


@dataclass(frozen=True)
class SealedBallot:
    """What a hospital keeps of its last ballot until the next: each box, and each box's ephemeral secret."""

    round: int
    boxes: dict[str, bytes]
    secrets: dict[str, bytes]
    revealed: set[str] = field(default_factory=set)  # the talliers whose boxes it revealed


@dataclass(frozen=True)
class Finding:
    named: str  # the party at fault: the disputed tallier, or the hospital
    reason: str


_SPELLINGS = {OK: "ok", NONE: "none"}  # a BAD mark is spelt with its box's digest


def dispute_key(hospital: str, tallier: str, mark: int, digest: bytes = b"") -> str:
    """How ``TallyFailed.disputes`` names one disputed mark: OK, NONE, or BAD with its box's digest."""
    return f"{hospital}|{tallier}|{digest.hex() if mark == BAD else _SPELLINGS[mark]}"


def sign_dispute(signing: Ed25519PrivateKey, *, run: str, round_number: int, key: str) -> bytes:
    """A tallier's signature that, in round ``round_number`` of ``run``, the dispute ``key`` names was opened."""
    return signing.sign(_dispute_statement(run, round_number, key))


def attested_disputes(
    claims: dict[str, dict[str, bytes]], *, roster: Roster, config: VotingConfig, run: str, round_number: int
) -> list[AttestedDispute]:
    """The disputes, of ``claims`` (each tallier's ``TallyFailed.disputes``), that ``t + 1`` talliers signed."""
    signed: dict[str, dict[str, bytes]] = {}
    most = len(config.hospitals) * len(config.talliers)  # a mark of each hospital's box by each tallier, at most
    for tallier, disputes in claims.items():
        if len(disputes) > most:
            log.warning(
                "round %d: %s claims %d disputes, more than there are marks: none counts",
                round_number,
                tallier,
                len(disputes),
            )
            continue
        for key, signature in disputes.items():
            signed.setdefault(key, {})[tallier] = signature
    attested = []
    for key, signatures in signed.items():
        try:
            attested.append(
                _attested(key, signatures, roster=roster, config=config, run=run, round_number=round_number)
            )
        except ProtocolError as error:
            log.warning("round %d: a dispute is not attested: %s", round_number, error)
    return attested


def reveal_for(
    dispute: Dispute,
    sealed: SealedBallot | None,
    *,
    signing: Ed25519PrivateKey,
    hospital: str,
    roster: Roster,
    config: VotingConfig,
    run: str,
) -> Reveal:
    """A hospital's answer to ``dispute``: the box's ephemeral secret, signed; ``ProtocolError`` (and nothing revealed)
    unless ``t + 1`` talliers attest the box it sealed to the disputed tallier in its last ballot, and it revealed
    fewer than ``t`` other boxes of that ballot."""
    if sealed is None or dispute.round != sealed.round:
        raise ProtocolError(f"a dispute over round {dispute.round}, not over this hospital's last ballot")
    if sealed.boxes.get(dispute.tallier) != dispute.box:
        raise ProtocolError(f"the disputed box is not the one this hospital sealed to {dispute.tallier!r}")
    if len(sealed.revealed | {dispute.tallier}) > config.corrupt_talliers:
        raise ProtocolError(f"a dispute over more than {config.corrupt_talliers} boxes of round {dispute.round}")
    key = dispute_key(hospital, dispute.tallier, BAD, box_digest(dispute.box))
    _attested(key, dispute.signatures, roster=roster, config=config, run=run, round_number=dispute.round)
    secret = sealed.secrets[dispute.tallier]
    sealed.revealed.add(dispute.tallier)
    signature = signing.sign(_reveal_statement(run, dispute.round, key, secret))
    return Reveal(round=dispute.round, tallier=dispute.tallier, ephemeral=secret, signature=signature)


def judge(verdict: Verdict, *, roster: Roster, config: VotingConfig, run: str) -> Finding:
    """Who is at fault for the box ``verdict`` shows, from what it carries alone: the tallier that marked it BAD if
    it opens to a share under the key that tallier derives from the revealed secret, else the hospital.
    ``ProtocolError`` if the verdict proves nothing (not attested, not the hospital's reveal or box)."""
    hospital, tallier, r = verdict.hospital, verdict.tallier, verdict.round
    if hospital not in config.hospitals or tallier not in config.talliers:
        raise ProtocolError(f"a verdict over {hospital!r} and {tallier!r}, not a hospital and a tallier of the run")
    key = dispute_key(hospital, tallier, BAD, box_digest(verdict.box))
    _attested(key, verdict.signatures, roster=roster, config=config, run=run, round_number=r)
    hospital_key = roster.party(hospital).identity.signing
    try:
        hospital_key.verify(verdict.reveal_signature, _reveal_statement(run, r, key, verdict.ephemeral))
        tallier_key = verify_certified_key(
            verdict.tallier_key,
            signer=roster.party(tallier).identity.signing,
            context=tallier_key_context(run, tallier),
        )
        why = revealed_share(
            verdict.box,
            ephemeral=verdict.ephemeral,
            tallier_key=tallier_key,
            hospital_key=hospital_key,
            field=config.field(),
            values=config.ballot_layout().values,
            run=run,
            round_number=r,
            hospital=hospital,
            tallier=tallier,
        )
    except InvalidSignature:
        raise ProtocolError(f"the verdict's reveal is not {hospital}'s") from None
    except (SealedBoxError, BallotError) as error:
        raise ProtocolError(f"the verdict proves nothing: {error}") from None
    if why:
        return Finding(hospital, f"round {r}: {hospital}'s box to {tallier} does not open to a share: {why}")
    return Finding(
        tallier,
        f"round {r}: {tallier} marked {hospital}'s box BAD, and it opens to a share with the secret {hospital} "
        f"revealed: {tallier} deviated",
    )


class BoxDisputes:
    """The server's side of a round's disputes: ask each hospital to reveal, forward the verdicts, name who is at
    fault."""

    def __init__(self, roster: Roster, config: VotingConfig, run: str, certified_keys: dict[str, bytes]) -> None:
        self._roster, self._config, self._run, self._keys = roster, config, run, certified_keys

    def settle(
        self,
        participants: Participants,
        round_number: int,
        ballots: dict[str, dict[str, bytes]],
        claims: dict[str, dict[str, bytes]],
        timeout_s: float,
    ) -> list[str]:
        """What became of each attested dispute of the round (its hospital named, or expelled as silent), once every
        tallier got its verdict; ``ProtocolError`` naming each tallier found to have lied, which stops the run."""
        settings = {"roster": self._roster, "config": self._config, "run": self._run}
        disputes = attested_disputes(claims, round_number=round_number, **settings)
        if liars := unrelayed_marks(disputes, ballots, round_number):
            raise ProtocolError("; ".join(liars) + "; the run stops")
        asked = {(d.hospital, d.tallier): d for d in disputes if d.mark == BAD and d.hospital in participants.active}
        for (hospital, tallier), dispute in asked.items():
            box = ballots[hospital][tallier]
            participants.parties.send(
                hospital, Dispute(round=round_number, tallier=tallier, box=box, signatures=dispute.signatures)
            )
        reveals = _reveals(participants, round_number, set(asked), timeout_s)
        outcomes, liars = [], []
        for (hospital, tallier), dispute in asked.items():
            reveal = reveals.get((hospital, tallier))
            if reveal is None:  # it cannot show its box: it is not readmitted, but no tallier is named
                outcome = f"round {round_number}: did not reveal its box to {tallier} within {timeout_s:g} s"
                participants.expel(hospital, outcome)
                outcomes.append(f"{hospital} {outcome}")
                continue
            verdict = Verdict(
                round=round_number,
                hospital=hospital,
                tallier=tallier,
                tallier_key=self._keys[tallier],
                box=ballots[hospital][tallier],
                signatures=dispute.signatures,
                ephemeral=reveal.ephemeral,
                reveal_signature=reveal.signature,
            )
            try:
                finding = judge(verdict, **settings)
            except ProtocolError as error:
                participants.expel(hospital, f"round {round_number}: its reveal of its box to {tallier}: {error}")
                outcomes.append(f"{hospital} sent a reveal that proves nothing: {error}")
                continue
            for name in self._config.talliers:
                participants.parties.send(name, verdict)
            outcomes.append(finding.reason)
            if finding.named == tallier:
                liars.append(finding.reason)
            else:
                participants.expel(hospital, finding.reason)
        if liars:
            raise ProtocolError("; ".join(liars) + "; the run stops")
        return outcomes


def unrelayed_marks(
    disputes: list[AttestedDispute], ballots: dict[str, dict[str, bytes]], round_number: int
) -> list[str]:
    """The attested marks the server knows to be false, from what it verified and relayed (``ballots``): an OK or a BAD
    of a box it did not relay, a NONE of one it did, or a BAD whose digest is not the relayed box's."""
    false = []
    for dispute in disputes:
        hospital, tallier = dispute.hospital, dispute.tallier
        relayed = ballots.get(hospital, {}).get(tallier)
        if dispute.mark == NONE and relayed is not None:
            false.append(f"{tallier} said it holds no box from {hospital}, which the server verified and relayed to it")
        elif dispute.mark != NONE and relayed is None:
            false.append(f"{tallier} marked a box from {hospital} that the server did not relay to it")
        elif dispute.mark == BAD and box_digest(relayed) != dispute.digest:
            false.append(f"{tallier} marked BAD a box from {hospital} that is not the one the server relayed to it")
    return [f"round {round_number}: {what}: it deviated" for what in false]


def _reveals(
    participants: Participants, round_number: int, asked: set[tuple[str, str]], timeout_s: float
) -> dict[tuple[str, str], Reveal]:
    """Each asked hospital's signed secret for its disputed box, until every one still in the run answered or the time
    is up."""
    parties, reveals = participants.parties, {}
    deadline = time.monotonic() + timeout_s

    def waiting() -> bool:
        return any(pair not in reveals and pair[0] in participants.active for pair in asked)

    while waiting() and (got := participants.next_message(deadline, waiting)) is not None:
        sender, message = got
        pair = (sender, getattr(message, "tallier", ""))
        if not (isinstance(message, Reveal) and message.round == round_number and pair in asked):
            parties.reject(sender, message, f"expected a reveal for a dispute of round {round_number}")
        elif pair in reveals:
            parties.reject(sender, message, f"second reveal for a dispute of round {round_number}")
        else:
            reveals[pair] = message
    return reveals


def _attested(
    key: str, signatures: dict[str, bytes], *, roster: Roster, config: VotingConfig, run: str, round_number: int
) -> AttestedDispute:
    """The dispute ``key`` names, with the signatures of it that verify; ``ProtocolError`` unless ``t + 1`` talliers
    of the run signed it."""
    parts = key.split("|")
    if len(parts) != 3 or parts[1] not in config.talliers or parts[0] not in config.hospitals:
        raise ProtocolError(f"{key!r} names no box of a hospital to a tallier of the run")
    mark = {spelling: mark for mark, spelling in _SPELLINGS.items()}.get(parts[2], BAD)
    try:
        digest = bytes.fromhex(parts[2]) if mark == BAD else b""
    except ValueError:
        digest = b"?"
    if (mark == BAD and len(digest) != 32) or dispute_key(parts[0], parts[1], mark, digest) != key:
        raise ProtocolError(f"{key!r} names no mark of a box")  # one spelling of each dispute: signatures of it add up
    statement = _dispute_statement(run, round_number, key)
    valid = {}
    for tallier, signature in signatures.items():
        if tallier in config.talliers:
            try:
                roster.party(tallier).identity.signing.verify(signature, statement)
                valid[tallier] = signature
            except InvalidSignature:
                continue
    if len(valid) <= config.corrupt_talliers:
        raise ProtocolError(
            f"{len(valid)} talliers of the run signed the dispute over {parts[0]}'s box to {parts[1]} in round "
            f"{round_number}; it takes {config.corrupt_talliers + 1}"
        )
    return AttestedDispute(parts[0], parts[1], mark, digest, valid)


def _dispute_statement(run: str, round_number: int, key: str) -> bytes:
    return f"consilium/box-dispute/v1|{run}|{round_number}|{key}".encode()


def _reveal_statement(run: str, round_number: int, key: str, secret: bytes) -> bytes:
    return f"consilium/box-reveal/v1|{run}|{round_number}|{key}|{secret.hex()}".encode()
