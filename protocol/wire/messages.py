"""Wire messages: every message the parties exchange, its fields and their types, and which role
accepts which (``TO_SERVER`` and the others). How they travel, and how a received one is validated in
full before anything uses it, is ``protocol.wire.codec``.

The sender is never a field: the server learns it from the CurveZMQ key that authenticated the
connection (``protocol.wire.transport``).

Sequence of one run (H = each hospital; the round is ``docs/explanation/secure-round.md``'s)::

    H  -> S  Hello                          S  -> H  Welcome(config, initial and current model, next round)
    H  -> S  BoxKey(r, certified key)       (its box key for the next round it takes part in)
    per round r:
    S  -> H  RoundStart(r, box keys)        H  -> S  Update(r, ciphertexts, sealed shares, box key for r + 1)
                                                     | Withdraw(r, reason)
    S  -> H  Aggregate(r, contributors, sum, upload digests, its shares) | RoundAbort(r, reason)
    H  -> S  Endorsement(r, hashes, commitment, signature)
    S  -> H  Endorsements(r, every member's) H  -> S  Proof(r, seed, proof, signature)
    S  -> H  Proofs(r, every member's)       H  -> S  Release(r, share, masks, signature)
    S  -> H  Releases(r, every member's)     H  -> S  Confirmed(r, digest of the mean) | Refused(r, ...)
    S  -> H  Finish(reason)

A member that refuses a step sends Refused(r, reason, named, openings) instead of its next message.

A voting run (AE-DPFL, kNN-DPFL; T = each tallier)::

    H, T -> S  Hello                        S  -> T  VotingWelcome(config, feature map, no keys)
    T  -> S  RunKey(certified key)          (a fresh box key for this run, signed by the tallier)
    S  -> H  VotingWelcome(config, feature map, every tallier's certified key)
    per round r:
    S  -> H  VoteRequest(r, queries)        H  -> S  Ballot(r, a sealed share for each tallier) | Withdraw(r, reason)
    S  -> T  Shares(r, its sealed share from each voter)
    T  -> S  Labels(r, voters, refused and why, labels)
             | TallyFailed(r, reason, tampered, deviated, interrupted, void, disputes)
             (interrupted: once every tallier is back, S relays the same Shares(r) again)
    S  -> H  RoundVoid(r, every tallier's void)   (too few voters, nothing computed: the charge is cancelled)
    S  -> H  Dispute(r, tallier, box, signatures)    H  -> S  Reveal(r, tallier, the box's secret, signature)
    S  -> T  Verdict(the Dispute and the Reveal)     (a box 1 to t talliers marked BAD: protocol.voting.box_dispute)
    S  -> H, T  Finish(reason)

A coordinator's admin (A; docs/explanation/site-services.md), one question, one answer::

    A  -> S  Submit(run flags) | Status | StopRun(run) | RunLog(run)    S  -> A  AdminAnswer(ok, lines)

A tallier or voting hospital that restarted, or whose connection to a restarted server was made
again, says Hello again: a tallier gets VotingWelcome and answers RunKey with the key it had, a
hospital gets VotingWelcome with every tallier's key before the next round.

Joining later runs the same exchange between rounds: a hospital that restarted, or whose connection
to a restarted server was re-established, says Hello again, is welcomed to the model as it is now,
and answers with a box key for the next round. No key outlives its round, so nothing else is needed.
"""

from __future__ import annotations

import hashlib
import typing
from dataclasses import dataclass

from consilium.errors import ConsiliumError

# fmt: off
__all__ = [
    "PROTOCOL_VERSION", "TO_ADMIN", "TO_COORDINATOR", "TO_HOSPITAL", "TO_SERVER", "TO_TALLIER", "TO_VOTING_HOSPITAL",
    "TO_VOTING_SERVER", "AdminAnswer", "Aggregate", "Ballot", "BoxKey", "Confirmed", "Dispute", "Endorsement",
    "Endorsements", "Finish", "Hello", "Labels", "Message", "MessageError", "Proof", "Proofs", "ProtocolError",
    "Refused", "Release", "Releases", "Reveal", "RoundAbort", "RoundStart", "RoundVoid", "RunKey", "RunLog", "Shares",
    "Status", "StopRun", "Submit", "TallyFailed", "Update", "Verdict", "VoteRequest", "VotingWelcome", "Welcome",
    "Withdraw", "release_digest",
]
# fmt: on

PROTOCOL_VERSION = 4  # 3: TallyFailed.deviated; 4: box disputes (Dispute, Reveal, Verdict)


class MessageError(ValueError):
    """A message that is malformed, oversized, of an unknown version or not for this role."""


class ProtocolError(ConsiliumError, RuntimeError):
    """A run that cannot go on: too few parties, a missed deadline, a disagreement."""


class Message:
    TYPE: typing.ClassVar[str]


@dataclass(frozen=True)
class Hello(Message):
    TYPE = "hello"


@dataclass(frozen=True)
class Welcome(Message):
    TYPE = "welcome"
    config: dict
    initial_parameters: bytes  # float32, little-endian; with the config, names the run (RunConfig.fingerprint)
    parameters: bytes  # the model now: float32, the initial parameters until a round is released
    optimizer_state: bytes  # the update rule's state now (training.methods.update_rules): float32
    next_round: int  # the first round the hospital can take part in: its box key is for that round
    server_wait_s: int  # the longest the server may keep a member waiting (protocol.run.participants.Timeouts)


@dataclass(frozen=True)
class RunKey(Message):
    TYPE = "run_key"
    certified_key: bytes  # crypto.sealed_box.certify_key: a tallier's X25519 key for this run, signed by it


@dataclass(frozen=True)
class BoxKey(Message):
    TYPE = "box_key"
    round: int
    certified_key: bytes  # a hospital's X25519 key for that round (protocol.secure_round.statement.box_key_context)


@dataclass(frozen=True)
class RoundStart(Message):
    TYPE = "round_start"
    round: int
    box_keys: dict[str, bytes]  # hospital -> its BoxKey.certified_key for this round


@dataclass(frozen=True)
class Update(Message):
    TYPE = "update"
    round: int
    chunks: tuple[bytes, ...]  # the upload's ciphertexts (their c0), or the plaintext benchmark's one chunk
    boxes: dict[str, bytes]  # recipient hospital -> its key share, sealed to its box key (empty in plaintext)
    next_box_key: bytes  # this hospital's certified box key for the next round (empty after the last)

    def upload_bytes(self) -> int:
        """The ciphertexts' and sealed shares' bytes: what the upload costs, as the report counts it."""
        return sum(map(len, self.chunks)) + sum(map(len, self.boxes.values()))


@dataclass(frozen=True)
class Withdraw(Message):
    TYPE = "withdraw"
    round: int
    reason: str


@dataclass(frozen=True)
class Aggregate(Message):
    TYPE = "aggregate"
    round: int
    contributors: tuple[str, ...]
    chunks: tuple[bytes, ...]  # the sum
    digests: dict[str, bytes]  # member -> the digest of its upload
    boxes: dict[str, bytes]  # member -> the share it sealed to this recipient


@dataclass(frozen=True)
class Endorsement(Message):
    TYPE = "endorsement"
    round: int
    hashes: tuple[int, ...]  # of its own upload, under the statement's challenges
    commitment: bytes  # to the release it will make
    signature: bytes


def _by_member(sent: dict[str, Message], **relayed: str) -> dict[str, dict[str, object]]:
    """A relay's fields from each member's message: ``field=attribute`` gives ``{field: {member: its attribute}}``."""
    return {
        field: {name: getattr(message, attribute) for name, message in sent.items()}
        for field, attribute in relayed.items()
    }


@dataclass(frozen=True)
class Endorsements(Message):
    TYPE = "endorsements"
    round: int
    hashes: dict[str, tuple[int, ...]]  # member -> its Endorsement's fields
    commitments: dict[str, bytes]
    signatures: dict[str, bytes]

    @classmethod
    def of(cls, round_number: int, sent: dict[str, Endorsement]) -> "Endorsements":
        """Every member's endorsement, as the server relays them."""
        return cls(round_number, **_by_member(sent, hashes="hashes", commitments="commitment", signatures="signature"))


@dataclass(frozen=True)
class Proof(Message):
    TYPE = "proof"
    round: int
    seed: bytes
    proof: tuple[tuple[int, ...], ...]  # the masked proof of its dealing (crypto.key_shares)
    signature: bytes


@dataclass(frozen=True)
class Proofs(Message):
    TYPE = "proofs"
    round: int
    seeds: dict[str, bytes]  # member -> its Proof's fields
    proofs: dict[str, tuple[tuple[int, ...], ...]]
    signatures: dict[str, bytes]

    @classmethod
    def of(cls, round_number: int, sent: dict[str, Proof]) -> "Proofs":
        """Every member's proof, as the server relays them."""
        return cls(round_number, **_by_member(sent, seeds="seed", proofs="proof", signatures="signature"))


@dataclass(frozen=True)
class Release(Message):
    TYPE = "release"
    round: int
    share: bytes  # the sum of the shares it holds from the members, packed as a polynomial of R_q
    masks: tuple[int, ...]
    signature: bytes


@dataclass(frozen=True)
class Releases(Message):
    TYPE = "releases"
    round: int
    shares: dict[str, bytes]  # member -> its Release's fields
    masks: dict[str, tuple[int, ...]]
    signatures: dict[str, bytes]

    @classmethod
    def of(cls, round_number: int, sent: dict[str, Release]) -> "Releases":
        """Every member's release, as the server relays them."""
        return cls(round_number, **_by_member(sent, shares="share", masks="masks", signatures="signature"))


@dataclass(frozen=True)
class Confirmed(Message):
    TYPE = "confirmed"
    round: int
    digest: bytes  # release_digest(round, the mean gradient it applied)


@dataclass(frozen=True)
class Refused(Message):
    TYPE = "refused"
    round: int
    reason: str
    named: tuple[str, ...]  # whom its checks name ("server" for the relay)
    openings: dict[str, bytes]  # dealer -> the key of the box it sealed to this hospital: the evidence


@dataclass(frozen=True)
class RoundAbort(Message):
    TYPE = "round_abort"
    round: int
    reason: str


@dataclass(frozen=True)
class Finish(Message):
    TYPE = "finish"
    reason: str


# -- voting ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VotingWelcome(Message):
    TYPE = "voting_welcome"
    config: dict  # protocol.voting.voting_config.VotingConfig
    feature_map: bytes  # kNN-DPFL: the public feature map (training.voting.votes.PcaFeatures.to_bytes); AE-DPFL: empty
    tallier_keys: dict[str, bytes]  # tallier -> its RunKey.certified_key; empty when sent to the talliers


@dataclass(frozen=True)
class VoteRequest(Message):
    TYPE = "vote_request"
    round: int
    queries: bytes  # the round's public records: float32, little-endian, the config's input shape each


@dataclass(frozen=True)
class Ballot(Message):
    TYPE = "ballot"
    round: int
    boxes: dict[str, bytes]  # tallier -> its share of the noisy votes, sealed to it (protocol.voting.voting_hospital)


@dataclass(frozen=True)
class Shares(Message):
    TYPE = "shares"
    round: int
    boxes: dict[str, bytes]  # voter -> the box its Ballot sealed to this tallier


@dataclass(frozen=True)
class Labels(Message):
    TYPE = "labels"
    round: int
    voters: tuple[str, ...]  # the hospitals whose votes the labels count, as the talliers agreed
    refused: tuple[str, ...]  # hospitals whose ballots failed the talliers' checks, left out of the count
    refused_because: tuple[str, ...]  # for each refused hospital, the check its ballot failed
    labels: tuple[int, ...]  # one class per query, or C (the number of classes) where a label threshold withheld it
    totals: bytes  # reveal "histogram" only: the noisy totals, int64 little-endian, Q x C; else empty
    mpc_microseconds: int
    mpc_bytes: int  # sent by this tallier to the others


@dataclass(frozen=True)
class TallyFailed(Message):
    TYPE = "tally_failed"
    round: int
    reason: str
    tampered: tuple[str, ...]  # for the log: hospitals whose ballots failed the tag check
    deviated: bool  # a tallier deviated: a ballot's tag check or a MAC check failed; the run stops
    interrupted: bool  # the MPC did not finish (a tallier left or went silent): the round may be relayed again
    void: bytes  # its signature that the round released nothing (protocol.voting.round_void), or empty
    disputes: dict[str, bytes]  # "hospital|tallier|ok, none or the BAD box's SHA-256" -> its signature of that mark


@dataclass(frozen=True)
class Dispute(Message):  # protocol.voting.box_dispute, as are Reveal and Verdict
    TYPE = "dispute"
    round: int
    tallier: str  # who marked the hospital's box BAD
    box: bytes  # the box the hospital sealed to it, as the server verified and relayed it
    signatures: dict[str, bytes]  # by tallier: its statement that ``tallier`` marked this box BAD


@dataclass(frozen=True)
class Reveal(Message):
    TYPE = "reveal"
    round: int
    tallier: str
    ephemeral: bytes  # the box's ephemeral secret: it opens that box and no other
    signature: bytes  # the hospital's, over the run, the round, the box's digest and the secret


@dataclass(frozen=True)
class Verdict(Message):  # a Dispute and its Reveal, with the box key the tallier certified for the run
    TYPE = "verdict"
    round: int
    hospital: str
    tallier: str
    tallier_key: bytes
    box: bytes
    signatures: dict[str, bytes]
    ephemeral: bytes
    reveal_signature: bytes


@dataclass(frozen=True)
class RoundVoid(Message):
    TYPE = "round_void"
    round: int
    signatures: dict[str, bytes]  # by tallier: its void of the round (protocol.voting.round_void)


@dataclass(frozen=True)
class Submit(Message):  # from a coordinator's admin, as are Status, StopRun and RunLog
    TYPE = "submit"
    flags: tuple[str, ...]  # consilium-server's run flags, as its operator would type them


@dataclass(frozen=True)
class Status(Message):
    TYPE = "status"


@dataclass(frozen=True)
class StopRun(Message):
    TYPE = "stop_run"
    run: str  # the coordinator's name for it ("run-3"), as its Submit's answer said


@dataclass(frozen=True)
class RunLog(Message):
    TYPE = "run_log"
    run: str


@dataclass(frozen=True)
class AdminAnswer(Message):
    TYPE = "admin_answer"
    ok: bool  # False: refused, and the lines say why
    lines: tuple[str, ...]


# What each role accepts: a message of another type is refused by ``decode``.
TO_SERVER = frozenset({Hello, BoxKey, Update, Withdraw, Endorsement, Proof, Release, Confirmed, Refused})
TO_HOSPITAL = frozenset({Welcome, RoundStart, Aggregate, Endorsements, Proofs, Releases, RoundAbort, Finish})
TO_VOTING_SERVER = frozenset({Hello, RunKey, Ballot, Withdraw, Labels, TallyFailed, Reveal})
TO_VOTING_HOSPITAL = frozenset({VotingWelcome, VoteRequest, RoundVoid, Dispute, Finish})
TO_TALLIER = frozenset({VotingWelcome, Shares, Verdict, Finish})
TO_COORDINATOR = frozenset({Submit, Status, StopRun, RunLog})  # from an admin, between runs or during one
TO_ADMIN = frozenset({AdminAnswer})
MESSAGE_TYPES = {
    cls.TYPE: cls
    for cls in TO_SERVER | TO_HOSPITAL | TO_VOTING_SERVER | TO_VOTING_HOSPITAL | TO_TALLIER | TO_COORDINATOR | TO_ADMIN
}


def release_digest(round_number: int, mean_gradient: bytes) -> bytes:
    """What every contributor states it applied, so that the server can check they agree."""
    return hashlib.sha256(b"consilium release v1|%d|" % round_number + mean_gradient).digest()
