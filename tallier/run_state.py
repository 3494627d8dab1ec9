"""What a tallier keeps of its run on its own disk, sealed, so that a restarted tallier rejoins it.

- **The run's box key** (X25519) and its certificate. The hospitals seal their shares to it, so a
  tallier restarted mid-run must come back with the same key: it opens the boxes of the round that
  was under way, and the hospitals' copies of the key stay good.
- **The last round it tallied, a digest of the boxes it was given for it, the voters the talliers
  agreed on, what it kept of the round's output, and how often it tallied it.** It tallies a
  round again only with exactly those boxes, only to count the same voters (saved before anything
  else of the round is opened), at most ``MAX_TALLIES`` times, and never an earlier round. Once
  the round's output began it keeps ``KeptOutput`` (saved before any output is computed;
  ``tallier.mpc`` has the talliers check that their pins agree): a tally again counts exactly
  those totals, with no new input a deviating tallier could choose, and gives the same labels
  (the argmax is deterministic), so a repeat shows nothing new; a set
  that differs by one hospital's ballot would show that ballot's effect, which is why a server may
  not ask for it. The voters are pinned on every tallier, so that one tallier whose state was rolled
  back (an old copy of the file) cannot be given a smaller set: the others refuse to count it.
- **Whether it saw a deviation** (a failed MAC or tag check): it then tallies nothing more of the
  run, whatever a server relays (Review 5 of ``docs/explanation/authenticated-labels.md``).

The file is a sealed box (``crypto.sealed_box``) from the tallier to itself: sealed to its own
long-term box key and signed by its identity, both in its secret key file, with the run's
fingerprint in the context; it is written whole and readable by its owner only
(``training.privacy.durable.replace_file``), before the round it names is tallied (a disk that refuses it,
or a file that cannot be read, stops the tallier in one line). A file that does not open for this
run (another run's, or altered) is not used: the tallier starts the run afresh and says so.

While the run lasts the box key is therefore as safe as the identity key beside it. When the server
ends the run (``Finish``) the file is deleted, and from then on, as before, no later leak of the
tallier's long-term keys opens a share the server recorded. A tallier that stops otherwise (the
server gone for good, a refusal, an error) leaves it for a restart: the next run replaces it, or
its operator deletes it.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgpack
import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from consilium.crypto.identity import PrivateIdentity
from consilium.crypto.sealed_box import SealedBoxError, certify_key, open_box, seal
from consilium.protocol.run.checkpoint import CheckpointError, write_retrying
from consilium.training.privacy.durable import replace_file

__all__ = ["MAX_TALLIES", "RUN_STATE_FILE", "KeptOutput", "RunState", "RunStateFile", "boxes_digest"]

RUN_STATE_FILE = "tallier_run.sealed"
MAX_TALLIES = 5  # of one round: the first, and again after interrupted MPCs (a server's retries and resumes)
_CONTEXT = b"consilium tallier run state v1|"
_MAX_FILE_BYTES = 1 << 25  # the kept totals of the largest round a run may have (10^6 votes), 9 bytes each, and more

log = logging.getLogger("consilium.tallier")


def boxes_digest(boxes: dict[str, bytes]) -> bytes:
    """A digest of one round's boxes, by hospital: equal exactly when the same ballots are relayed."""
    digest = hashlib.sha256(b"consilium round boxes v1")
    for hospital in sorted(boxes):
        for part in (hospital.encode(), boxes[hospital]):
            digest.update(len(part).to_bytes(8, "little") + part)
    return digest.digest()


@dataclass(frozen=True)
class KeptOutput:
    """What a tallier keeps of a round once its output begins (``tallier.mpc``, step 5b): a tally again counts this."""

    placement: int  # the seed of the noise's signs and places, never 0
    voters: tuple[str, ...]  # the counted ones
    refused: dict[str, str] = field(default_factory=dict)  # voters whose ballots failed a check: why
    totals: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))  # own shares of the totals


@dataclass(frozen=True)
class RunState:
    run: str  # the run's fingerprint
    box_key: X25519PrivateKey
    certified_key: bytes  # crypto.sealed_box.certify_key of box_key's public half, for this run
    last_round: int = 0
    last_boxes: bytes = b""  # boxes_digest of the last round's boxes
    voters: tuple[str, ...] = ()  # the voters the talliers agreed on in the last round, once they have
    tallies: int = 0  # how often the last round was tallied
    kept: KeptOutput | None = None  # what it kept of the last round once its output began
    voided: bool = False  # this tallier signed the last round's void: it never tallies it again
    disputes: dict[str, bytes] = field(default_factory=dict)  # its signed disputes of that void, sent with it again
    deviation: str = ""  # the deviation this tallier saw in the run, if any: it tallies nothing more

    @property
    def output_begun(self) -> bool:
        """The last round's output computation began: it is never void, and a tally again counts what was kept."""
        return self.kept is not None

    @classmethod
    def new(cls, run: str, *, identity: PrivateIdentity, context: bytes) -> "RunState":
        """A fresh box key for ``run``, certified with ``identity`` for ``context``."""
        key = X25519PrivateKey.generate()
        return cls(run, key, certify_key(key.public_key(), signer=identity.signing, context=context))

    def refusal(self, round_number: int, digest: bytes, rounds: int) -> str:
        """Why round ``round_number`` with boxes of ``digest`` may not be tallied now; "" if it may."""
        if self.deviation:
            return f"round {round_number}, after a deviation in this run ({self.deviation})"
        if round_number == self.last_round and digest != self.last_boxes:
            return f"round {round_number} again, with other ballots than the first time"
        if round_number == self.last_round and self.tallies >= MAX_TALLIES:
            return f"round {round_number} again, after {self.tallies} tallies of it"
        if round_number != self.last_round and not self.last_round < round_number <= rounds:
            return f"round {round_number} after round {self.last_round} of {rounds}"
        return ""

    def tallying(self, round_number: int, digest: bytes) -> "RunState":
        if round_number == self.last_round:
            return replace(self, tallies=self.tallies + 1)
        return replace(
            self,
            last_round=round_number,
            last_boxes=digest,
            voters=(),
            tallies=1,
            kept=None,
            voided=False,
            disputes={},
        )

    def agreed(self, voters: tuple[str, ...]) -> "RunState":
        """This round's voters, as the talliers agreed on them; ``ValueError`` if they differ from an
        earlier tally of the same round."""
        if self.voters and voters != self.voters:
            raise ValueError(
                f"round {self.last_round} again, counting {list(voters)} where it first counted {list(self.voters)}"
            )
        return replace(self, voters=voters)

    def keeping(self, output: KeptOutput) -> "RunState":
        """This round's output, as its computation begins; ``ValueError`` if one was kept already (the MPC counts a
        kept one again instead, so only a tallier out of step sees that)."""
        if self.kept is not None:
            raise ValueError(f"round {self.last_round} again, computing an output the first tally kept otherwise")
        return replace(self, kept=output)

    def deviated(self, what: str) -> "RunState":
        return replace(self, deviation=what)

    def void(self, disputes: dict[str, bytes]) -> "RunState":
        """The last round, voided: it released nothing (``protocol.voting.round_void``), with this tallier's signed
        disputes of it (``protocol.voting.box_dispute``). ``ValueError`` once its output computation began."""
        if self.output_begun:
            raise ValueError(f"round {self.last_round}'s output was being computed: it is not void")
        return replace(self, voided=True, disputes=disputes)


class RunStateFile:
    """A tallier's sealed run state in ``folder`` (``RUN_STATE_FILE``)."""

    def __init__(self, folder: Path, *, name: str, identity: PrivateIdentity) -> None:
        self.path = folder / RUN_STATE_FILE
        self._name = name
        self._identity = identity

    def load(self, run: str) -> RunState | None:
        """The state this tallier saved for ``run``; None where there is none, or none that opens for it."""
        try:
            box = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:  # never taken for "no state": a new key would replace the run's
            raise CheckpointError(f"cannot read the tallier's run state {self.path}: {error}") from None
        if len(box) > _MAX_FILE_BYTES:  # never taken for another run's: a new key would replace this run's
            raise CheckpointError(f"the tallier's run state {self.path} holds {len(box)} bytes, more than one holds")
        try:
            fields = msgpack.unpackb(
                open_box(
                    box,
                    recipient=self._identity.box,
                    sender=self._identity.signing.public_key(),
                    context=self._context(run),
                ),
                max_bin_len=_MAX_FILE_BYTES,
            )
            if isinstance(fields, dict) and "output_begun" in fields:  # opened for this run: ours, but older
                raise CheckpointError(
                    f"the tallier's run state {self.path} was written by an older Consilium: finish its run with that "
                    "version, or delete the file to leave the run"
                )
            state = RunState(
                run=run,
                box_key=X25519PrivateKey.from_private_bytes(fields["box_key"]),
                certified_key=bytes(fields["certified_key"]),
                last_round=int(fields["last_round"]),
                last_boxes=bytes(fields["last_boxes"]),
                voters=tuple(str(name) for name in fields["voters"]),
                tallies=int(fields["tallies"]),
                kept=_kept(fields["kept"]),
                voided=bool(fields["voided"]),
                disputes={str(key): bytes(signature) for key, signature in fields["disputes"].items()},
                deviation=str(fields["deviation"]),
            )
        except (SealedBoxError, ValueError, KeyError, TypeError, msgpack.UnpackException) as error:
            log.warning("%s does not open for run %s (%s); this run starts with a new box key", self.path, run, error)
            return None
        return state

    def save(self, state: RunState) -> None:
        raw = state.box_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        fields = {
            "box_key": raw,
            "certified_key": state.certified_key,
            "last_round": state.last_round,
            "last_boxes": state.last_boxes,
            "voters": list(state.voters),
            "tallies": state.tallies,
            "kept": None
            if state.kept is None
            else {
                "placement": state.kept.placement,
                "voters": list(state.kept.voters),
                "refused": state.kept.refused,
                "totals": np.asarray(state.kept.totals, dtype="<u8").tobytes(),
            },
            "voided": state.voided,
            "disputes": state.disputes,
            "deviation": state.deviation,
        }
        sealed = seal(
            msgpack.packb(fields),
            recipient=self._identity.box.public_key(),
            sender=self._identity.signing,
            context=self._context(state.run),
        )
        # No round is tallied before its state is on disk: ``CheckpointError`` stops the tallier in one line.
        write_retrying(lambda: replace_file(self.path, sealed), f"the tallier's run state {self.path}")

    def delete(self) -> None:
        try:
            self.path.unlink(missing_ok=True)
        except OSError as error:
            log.warning("cannot delete %s (%s): delete it, the run is over", self.path, error)

    def _context(self, run: str) -> bytes:
        return _CONTEXT + self._name.encode() + b"|" + run.encode()


def _kept(fields: dict | None) -> KeptOutput | None:
    if fields is None:
        return None
    return KeptOutput(
        placement=int(fields["placement"]),
        voters=tuple(str(name) for name in fields["voters"]),
        refused={str(name): str(why) for name, why in fields["refused"].items()},
        totals=np.frombuffer(bytes(fields["totals"]), dtype="<u8").astype(np.uint64),
    )
