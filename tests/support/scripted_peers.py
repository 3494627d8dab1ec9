"""Scripted peers: a hospital or a server whose side is played message by message.

The fuzzer (``tests/support/fuzz.py``) and the tests put these against real server and hospital processes:
each follows the protocol where told to, and can send anything else in between. They hold real keys
and run the real cryptography; nothing here is a mock of the component under test.
"""

from __future__ import annotations

import secrets
from typing import Iterable

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from consilium.crypto.bfv import PublicContext
from consilium.crypto.key_shares import Release as KeyRelease
from consilium.crypto.one_time_keys import pack_ring, unpack_ring
from consilium.crypto.sealed_box import certify_key
from consilium.protocol.run.config import RunConfig
from consilium.protocol.wire.messages import (
    TO_HOSPITAL,
    TO_SERVER,
    Aggregate,
    BoxKey,
    Confirmed,
    Endorsement,
    Endorsements,
    Hello,
    Message,
    Proof,
    Proofs,
    Release,
    Releases,
    RoundStart,
    Update,
    Welcome,
    release_digest,
)
from consilium.protocol.wire.codec import decode, encode
from consilium.protocol.secure_round.hospital_round import HospitalRound
from consilium.protocol.secure_round.statement import (
    Endorsed,
    Proved,
    RoundSetting,
    box_key_context,
    release_message,
    released_from,
    state_digest,
)
from consilium.protocol.secure_round.sum_round import SumRound
from consilium.protocol.run.participants import Timeouts
from consilium.protocol.identity.party_keys import SERVER, Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.wire.transport import ClientTransport, ServerTransport
from consilium.training.methods.dopamine import DopamineSettings
from consilium.training.methods.registry import SharedState
from consilium.training.models.build import build_model, get_flat_parameters, set_flat_parameters
from consilium.training.models.spec import ModelSpec

__all__ = ["ScriptError", "ScriptedHospital", "ScriptedServer", "small_run_config"]

_MAX_BYTES = 1 << 24


class ScriptError(AssertionError):
    """The real peer did not answer as the script expects."""


def small_run_config(roster: Roster, *, quorum: int, rounds: int, run_id: str | None = None) -> RunConfig:
    """A run on the built-in breast cancer data with a tiny MLP: quick to set up, real in every part."""
    return RunConfig(
        run_id=run_id or secrets.token_hex(8),
        dataset="breast_cancer",
        hospitals=tuple(roster.hospitals),
        rounds=rounds,
        delta=1e-5,
        model=ModelSpec("mlp", (30,), 2, (4,)),
        training=DopamineSettings(
            sample_rate=0.2,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            quorum=quorum,
            expected_batch_size=10.0,  # a float, as every hospital reads it: the run fingerprints agree
            learning_rate=0.05,
            momentum=0.9,
        ),
    )


class ScriptedHospital:
    """A hospital played step by step with the real round (``protocol.secure_round``); every secret it
    holds is an attribute, so a test can hand them to an attacker."""

    def __init__(self, roster: Roster, credentials: Credentials) -> None:
        self.name = credentials.name
        self.roster = roster
        self.credentials = credentials
        self.transport = ClientTransport(
            roster.server_address, roster.server.curve_public, credentials.curve, _MAX_BYTES
        )
        self.config: RunConfig | None = None
        self.box_keys: dict[int, X25519PrivateKey] = {}  # round -> this hospital's box key for it
        self.rounds: dict[int, HospitalRound] = {}
        self.opened: dict[int, np.ndarray] = {}  # round -> the sum this hospital opened
        self.dealt: dict[int, tuple] = {}  # round -> the shares of its own key

    def send(self, message: Message) -> None:
        self.transport.send(encode(message))

    def send_raw(self, payload: bytes) -> None:
        self.transport.send(payload)

    def expect(self, kind: type, timeout: float = 60) -> Message:
        payload = self.transport.receive(timeout)
        if payload is None:
            raise ScriptError(f"{self.name}: nothing from the server within {timeout} s")
        message = decode(payload, accept=TO_HOSPITAL, max_bytes=_MAX_BYTES)
        if not isinstance(message, kind):
            raise ScriptError(f"{self.name}: expected {kind.TYPE}, got {message}")
        return message

    def welcome(self) -> RunConfig:
        """Take the run's settings, and answer with a box key for the round it may join."""
        welcome = self.expect(Welcome)
        self.config = RunConfig.from_dict(welcome.config)
        self.run = self.config.fingerprint(welcome.initial_parameters)
        self.public = PublicContext(self.config.bfv_parameters())
        # The model and update rule's state, moved by every sum it applies, as a real hospital's: the
        # statement of each round names their digest.
        self.model = build_model(self.config.model)
        set_flat_parameters(self.model, np.frombuffer(welcome.parameters, dtype="<f4").copy())
        self.shared = SharedState(self.config.training, self.model)
        self.shared.load_state(np.frombuffer(welcome.optimizer_state, dtype="<f4").copy())
        self.send(BoxKey(round=welcome.next_round, certified_key=self.box_key(welcome.next_round)))
        return self.config

    def box_key(self, round_number: int) -> bytes:
        key = self.box_keys[round_number] = X25519PrivateKey.generate()
        return certify_key(
            key.public_key(),
            signer=self.credentials.identity.signing,
            context=box_key_context(self.run, self.name, round_number),
        )

    def identities(self) -> dict:
        return {name: self.roster.party(name).identity.signing for name in self.config.hospitals}

    def upload(self, start: RoundStart, values: np.ndarray) -> Update:
        """This hospital's honest update for the round ``start`` began (not sent)."""
        params, number = self.public.params, start.round
        setting = self.config.round_setting(self.run, number, params)
        self.rounds[number] = HospitalRound(
            setting, self.public, name=self.name, signing=self.credentials.identity.signing, box=self.box_keys[number]
        )
        slots = params.slots_of(values)
        chunks, boxes = self.rounds[number].upload(slots, start.box_keys, self.identities())
        self.dealt[number] = self.rounds[number]._key.dealing.shares  # its own key's shares: a test's ground truth
        return Update(round=number, chunks=tuple(chunks), boxes=boxes, next_box_key=self.box_key(number + 1))

    def endorse(self, aggregate: Aggregate) -> Endorsement:
        endorsed = self.rounds[aggregate.round].endorse(
            aggregate.contributors,
            aggregate.digests,
            aggregate.chunks,
            aggregate.boxes,
            self.identities(),
            round_state=self.config.training.round_state(),  # a scripted hospital's run keeps its first round's settings
            previous_result=state_digest(get_flat_parameters(self.model).tobytes(), self.shared.state().tobytes()),
        )
        return Endorsement(
            round=aggregate.round, hashes=endorsed.hashes, commitment=endorsed.commitment, signature=endorsed.signature
        )

    def prove(self, endorsements: Endorsements) -> Proof:
        given = {
            name: Endorsed(endorsements.hashes[name], endorsements.commitments[name], signature)
            for name, signature in endorsements.signatures.items()
        }
        proved = self.rounds[endorsements.round].prove(given, self.identities())
        return Proof(round=endorsements.round, seed=proved.seed, proof=proved.proof, signature=proved.signature)

    def release(self, proofs: Proofs) -> Release:
        given = {name: Proved(proofs.seeds[name], proofs.proofs[name], sig) for name, sig in proofs.signatures.items()}
        released = self.rounds[proofs.round].release(given, self.identities())
        share = pack_ring(self.public, released.release.share[np.newaxis])[0]
        return Release(round=proofs.round, share=share, masks=released.release.masks, signature=released.signature)

    def wrong_release(self, proofs: Proofs) -> Release:
        """This hospital's release with one value off by one, signed as its own: what a dishonest member sends."""
        honest = self.release(proofs)
        share = unpack_ring(self.public, [honest.share], "our release")[0].copy()
        share[0] = (int(share[0]) + 1) % self.public.params.ciphertext_modulus
        opened = self.rounds[proofs.round]._opened
        wrong = KeyRelease(share, honest.masks)
        signature = self.credentials.identity.signing.sign(
            release_message(opened.statement, opened.seed, opened.proofs_digest, wrong)
        )
        return Release(
            round=proofs.round,
            share=pack_ring(self.public, share[np.newaxis])[0],
            masks=honest.masks,
            signature=signature,
        )

    def open(self, releases: Releases) -> np.ndarray:
        """The sum's values, opened from every member's release."""
        given = {
            name: released_from(self.public, releases.shares[name], releases.masks[name], releases.signatures[name])
            for name in releases.shares
        }
        slots = self.rounds[releases.round].open(given, self.identities())
        params = self.public.params
        return params.values_of(slots)

    def confirm(self, releases: Releases) -> Confirmed:
        """Open the sum (kept in ``opened``) and say which mean this hospital applies."""
        total = self.opened[releases.round] = self.open(releases)
        contributors = len(self.rounds[releases.round]._opened.contributors)
        mean = self.shared.settings.read_sum(total, contributors, self.config.parameter_count)
        self.shared.apply(mean, contributors)
        return Confirmed(round=releases.round, digest=release_digest(releases.round, mean.tobytes()))

    def close(self) -> None:
        self.transport.close()


class ScriptedServer:
    """Listens as the roster's server; the hospitals are whatever processes connect."""

    def __init__(self, roster: Roster, credentials: Credentials, config: RunConfig) -> None:
        if credentials.name != SERVER:
            raise ValueError(f"a scripted server needs the {SERVER!r} credentials, not {credentials.name!r}")
        self.roster = roster
        self.config = config
        self.initial = get_flat_parameters(build_model(config.model)).tobytes()
        self.run = config.fingerprint(self.initial)
        self.public = PublicContext(config.bfv_parameters())
        self.box_keys: dict[str, bytes] = {}  # hospital -> its certified box key for the next round
        enrolled = {roster.party(name).curve_public: name for name in config.hospitals}
        self.transport = ServerTransport(roster.server_address, credentials.curve, enrolled, config.message_limit())

    def receive(self, timeout: float = 60) -> tuple[str, Message]:
        got = self.transport.receive(timeout)
        if got is None:
            raise ScriptError(f"no message from any hospital within {timeout} s")
        sender, payload = got
        return sender, decode(payload, accept=TO_SERVER, max_bytes=self.config.message_limit())

    def receive_from_each(self, kind: type | tuple[type, ...], names: Iterable[str]) -> dict[str, Message]:
        names = set(names)
        messages = {}
        while set(messages) != names:
            sender, message = self.receive()
            if not (isinstance(message, kind) and sender in names):
                raise ScriptError(f"expected {kind} from {sorted(names)}, got {message} from {sender}")
            messages[sender] = message
        return messages

    def send(self, name: str, message: Message) -> None:
        self.send_raw(name, encode(message))

    def send_raw(self, name: str, payload: bytes) -> None:
        if not self.transport.send(name, payload):
            raise ScriptError(f"cannot send to {name}")

    def join(self) -> None:
        self.receive_from_each(Hello, self.config.hospitals)
        for name in self.config.hospitals:
            self.send(name, self.welcome(name))

    def welcome(self, name: str, config: RunConfig | None = None) -> Welcome:
        """The Welcome to the start of this run, or of one with ``config``."""
        config = config or self.config
        return Welcome(
            config=config.to_dict(),
            initial_parameters=self.initial,
            parameters=self.initial,
            optimizer_state=bytes(len(self.initial)),
            next_round=1,
            server_wait_s=Timeouts().server_silence_s(),
        )

    def set_up(self) -> None:
        """Join, as an honest server runs it: every hospital's box key for round 1."""
        self.join()
        replies = self.receive_from_each(BoxKey, self.config.hospitals)
        self.box_keys = {name: message.certified_key for name, message in replies.items()}

    def setting(self, round_number: int) -> RoundSetting:
        return self.config.round_setting(self.run, round_number, self.public.params)

    def start_round(self, round_number: int) -> dict[str, Update]:
        """Start a round and collect every hospital's update (keeping their box keys for the next)."""
        for name in self.config.hospitals:
            self.send(name, RoundStart(round=round_number, box_keys=dict(self.box_keys)))
        self.round_box_keys = dict(self.box_keys)
        updates = self.receive_from_each(Update, self.config.hospitals)
        self.box_keys = {name: update.next_box_key for name, update in updates.items()}
        return updates

    def aggregate(self, updates: dict[str, Update], round_number: int, members: tuple[str, ...], chunks=None):
        """The honest Aggregate of ``members``' uploads for each member (``chunks``: another sum instead)."""
        total = SumRound(self.setting(round_number), self.public)
        for name in members:
            total.add(name, updates[name].chunks)
        summed = total.total(
            members,
            self.round_box_keys,
            round_state=self.config.training.round_state(),
            previous_result=state_digest(self.initial, bytes(len(self.initial))),
        )
        return {
            name: Aggregate(
                round=round_number,
                contributors=members,
                chunks=tuple(chunks if chunks is not None else summed),
                digests={m: total.digests[m] for m in members},
                boxes={m: updates[m].boxes[name] for m in members},
            )
            for name in members
        }

    def relay(self, round_number: int, members: Iterable[str]) -> dict[str, Confirmed]:
        """After the Aggregates: relay every member's endorsement, proof and release as an honest server
        does; returns what each confirmed."""
        members = list(members)
        for kind, relayed in ((Endorsement, Endorsements), (Proof, Proofs), (Release, Releases)):
            message = relayed.of(round_number, self.receive_from_each(kind, members))
            for name in members:
                self.send(name, message)
        return self.receive_from_each(Confirmed, members)

    def add(self, *uploads: Update) -> list[bytes]:
        """The coefficient-wise sum of uploads, whatever their senders: what a dishonest server can send."""
        from consilium.crypto.one_time_keys import sum_uploads, unpack_ring

        rows = [unpack_ring(self.public, list(update.chunks), "upload") for update in uploads]
        return pack_ring(self.public, sum_uploads(self.public, rows))

    def close(self) -> None:
        self.transport.close()
