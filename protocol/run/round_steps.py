"""A round's steps at the server, from RoundStart to the members' confirmations: the sum opens only once
every member endorsed it, proved its dealing and released.

The sequence (``docs/explanation/secure-round.md``):

0. RoundStart, with the box keys of the round's members (``RoundSteps.start``); the uploads follow
   (``protocol.secure_round.collection.collect_updates``);
1. Aggregate: each member gets the sum, every upload's digest and the key shares the others dealt it;
2. Endorsement from every member, checked as it arrives, then all of them relayed (Endorsements);
3. Proof from every member, checked likewise; the ledger is charged, then the proofs relayed (Proofs),
   since from here on any ``tau`` releases open the sum (review 4, finding 12);
4. Release from every member, checked likewise; the server opens the sum and relays them (Releases);
5. Confirmed from each member still in the round: the digest of the mean it applied.

A member that refuses a step or falls silent aborts the round, which every member is told; a refusal's
evidence is then weighed (``protocol.run.blame``). A member that signed a wrong release is expelled at
once, and one that applied another mean than the sum's after the round (``Participants.expel``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.bfv_parameters import BfvParameters
from consilium.crypto.insecure_plaintext import InsecurePlaintextSum, InsecurePlaintextUploads
from consilium.protocol.run.blame import Blame, Evidence
from consilium.protocol.run.participants import Participants
from consilium.protocol.run.server_report import RoundRecord
from consilium.protocol.secure_round.box_keys import CertifiedBoxKeys
from consilium.protocol.secure_round.collection import collect_from_members
from consilium.protocol.secure_round.statement import Endorsed, Proved, RoundRefused, released_from
from consilium.protocol.secure_round.sum_round import SumRound
from consilium.protocol.wire.messages import (
    Aggregate,
    Confirmed,
    Endorsement,
    Endorsements,
    Proof,
    Proofs,
    Release,
    Releases,
    RoundStart,
    release_digest,
)

__all__ = ["RoundSteps", "confirm", "open_plaintext"]


class RoundSteps:
    """The server's side of steps 0 to 4 for every round of a run."""

    def __init__(
        self,
        participants: Participants,
        blame: Blame,
        *,
        round_s: float,
        abort: Callable[[RoundRecord, str], None],
        save_checkpoint: Callable[..., None],
    ) -> None:
        self._participants, self._blame, self._round_s = participants, blame, round_s
        self._abort, self._save_checkpoint = abort, save_checkpoint

    def start(self, record: RoundRecord, box_keys: CertifiedBoxKeys | None, quorum: int) -> dict[str, bytes] | None:
        """Step 0 to the active hospitals that hold a box key for the round (in the plaintext benchmark,
        ``box_keys`` None, to all), once the round's number is on disk: a resumed server never starts it
        again. None, and the round aborted before anyone is charged, where fewer than the quorum hold a
        key. Returns the box keys listed."""
        round_number, participants = record.round, self._participants
        self._save_checkpoint(required=True)
        if box_keys is not None:
            for name in [name for name in participants.active if not box_keys.holds(name, round_number)]:
                participants.drop(name, f"holds no box key for round {round_number}")
        if len(participants.active) < quorum:
            held = f"{len(participants.active)} hospitals hold a box key for this round"
            self._abort(record, f"{held}, fewer than the quorum of {quorum}")
            return None
        listed = {} if box_keys is None else box_keys.of(participants.active)
        participants.send_all(participants.active, RoundStart(round=round_number, box_keys=listed))
        participants.begin_round()
        return listed

    def open(
        self,
        record: RoundRecord,
        total: SumRound,
        updates: dict,
        box_keys: dict[str, bytes],
        identities: dict,
        *,
        public: PublicContext,
        previous_result: bytes,
        charge: Callable[[], None],
    ) -> np.ndarray | None:
        """The round's summed values, or None where the round was aborted. ``previous_result`` is the
        digest of the state every member starts the round from; ``charge`` charges the ledger."""
        self._send_aggregates(record, total, updates, box_keys, previous_result)
        try:
            evidence = Evidence(total, updates, box_keys, identities)
            releases = self._gather_releases(record, total, evidence, identities, public, charge)
            if releases is None:
                return None
        except RoundRefused as refusal:
            self._abort(record, _naming(str(refusal), refusal.named))
            return None
        try:
            slots = total.open(
                {n: released_from(public, r.share, r.masks, r.signature) for n, r in releases.items()}, identities
            )
        except RoundRefused as refusal:
            self._abort(record, _naming(str(refusal), refusal.named))
            self._blame.failed_opening(refusal)
            self._save_checkpoint()  # with whom the failure expels, as after a refusal is weighed
            return None
        self._blame.opened()
        self._participants.send_all(record.contributors, Releases.of(record.round, releases))
        return public.params.values_of(slots)

    def _send_aggregates(
        self, record: RoundRecord, total: SumRound, updates: dict, box_keys: dict[str, bytes], previous_result: bytes
    ) -> None:
        members, number = record.contributors, record.round
        chunks = total.total(members, box_keys, round_state=record.round_state, previous_result=previous_result)
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
        self,
        record: RoundRecord,
        total: SumRound,
        evidence: Evidence,
        identities: dict,
        public: PublicContext,
        charge: Callable[[], None],
    ) -> dict | None:
        """Steps 2 to 4's messages; None where a step failed."""
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
        self._participants.send_all(members, Endorsements.of(number, endorsements))
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
        charge()  # before the proofs go out: any tau releases after them open the sum
        self._participants.send_all(members, Proofs.of(number, proofs))
        return self._step(
            record, Release, "release", lambda n, r: self._release_refusal(total, public, n, r, identities), evidence
        )

    def _step(self, record: RoundRecord, kind, what: str, check, evidence: Evidence):
        """Every member's ``kind`` message of the round, each passing ``check`` as it arrives, or None
        where one refused or fell silent (the round aborted). After the abort, which every member is told,
        a refusal's evidence is weighed (``Blame.weigh``), and the checkpoint saved again with whom it drops."""
        answers, refusals = collect_from_members(
            self._participants, record.contributors, kind, record.round, self._round_s, check
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

    def _release_refusal(
        self, total: SumRound, public: PublicContext, name: str, message: Release, identities: dict
    ) -> str:
        """Why a release is rejected (""); a member that signed wrong values leaves the run at once."""
        try:
            released = released_from(public, message.share, message.masks, message.signature)
        except BfvError as error:
            return f"{name}'s release is malformed: {error}"
        try:
            return total.release_refusal(name, released, identities[name])
        except RoundRefused as refusal:
            self._participants.expel(name, str(refusal))
            return str(refusal)


def open_plaintext(
    participants: Participants, record: RoundRecord, total: InsecurePlaintextSum, params: BfvParameters
) -> np.ndarray:
    """The plaintext benchmark's steps 1 to 4: the sum goes back to the contributors as it is."""
    chunks, members = total.to_chunks(), record.contributors
    participants.send_all(
        members, Aggregate(round=record.round, contributors=tuple(members), chunks=tuple(chunks), digests={}, boxes={})
    )
    return InsecurePlaintextUploads(params).decrypt_sum(chunks, round_number=record.round, contributors=members)


def confirm(participants: Participants, record: RoundRecord, mean: np.ndarray, round_s: float) -> None:
    """Step 5: a member that applied another mean is expelled, and one that refused the opened sum leaves
    the run: its model has left the run's (review 4, finding 10). One that said Hello again takes the
    model as it is when it is welcomed."""
    expected = release_digest(record.round, mean.tobytes())
    confirmations, refusals = collect_from_members(participants, record.contributors, Confirmed, record.round, round_s)
    for name, confirmation in confirmations.items():
        if confirmation.digest != expected:
            participants.expel(name, f"round {record.round}: it applied another mean than the sum's")
    for name, refusal in refusals.items():
        participants.drop(
            name, f"round {record.round}: it refused the opened sum: {_naming(refusal.reason, refusal.named)}"
        )


def _naming(reason: str, named) -> str:
    return f"{reason} (named: {', '.join(named) or 'nobody'})"


def _endorsed(message: Endorsement) -> Endorsed:
    return Endorsed(message.hashes, message.commitment, message.signature)


def _proved(message: Proof) -> Proved:
    return Proved(message.seed, message.proof, message.signature)
