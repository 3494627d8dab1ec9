"""Scripted peers: a hospital or a server whose side is played message by message.

The fuzzer (``tests/fuzz.py``) and the tests put these against real server and hospital processes:
each follows the protocol where told to, and can send anything else in between. They hold real keys
and run the real cryptography; nothing here is a mock of the component under test.
"""

from __future__ import annotations

import secrets
from typing import Iterable

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from crypto.bfv import CiphertextSum, PublicContext, SecretContext
from crypto.endorsement import aggregate_statement, endorse
from crypto.sealed_box import certify_key, open_box, seal, verify_certified_key
from protocol.config import RunConfig
from protocol.key_ceremony import run_key_context, sealed_key_context
from protocol.messages import (
    TO_HOSPITAL,
    TO_SERVER,
    Aggregate,
    Endorsement,
    Hello,
    KeyReady,
    KeyRequest,
    KeySetup,
    Message,
    RoundStart,
    RunKey,
    SealedKey,
    Update,
    Welcome,
    decode,
    encode,
)
from protocol.party_keys import SERVER, Credentials
from protocol.roster import Roster
from protocol.transport import ClientTransport, ServerTransport
from training.dopamine import DopamineSettings
from training.models import ModelSpec, build_model, get_flat_parameters

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
            expected_batch_size=10,
            learning_rate=0.05,
            momentum=0.9,
        ),
    )


class ScriptedHospital:
    def __init__(self, roster: Roster, credentials: Credentials) -> None:
        self.name = credentials.name
        self.roster = roster
        self.credentials = credentials
        self.transport = ClientTransport(
            roster.server_address, roster.server.curve_public, credentials.curve, _MAX_BYTES
        )
        self.secret: SecretContext | None = None
        self.config: RunConfig | None = None

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
        """Take the run's settings; told to, create the run's key and say so (KeyReady)."""
        welcome = self.expect(Welcome)
        self.config = RunConfig.from_dict(welcome.config)
        self.run = self.config.fingerprint(welcome.initial_parameters)
        if welcome.generate_key:
            self.secret = SecretContext.generate(self.config.bfv_parameters(), run_id=self.config.run_id)
            self.send(KeyReady())
        return self.config

    def key_setup(self) -> KeySetup:
        """As a hospital holding the key: answer the key request with the key sealed to the others."""
        run_keys = self.expect(KeyRequest).run_keys
        secret_bytes = self.secret.to_bytes()
        sealed = {
            name: seal(
                secret_bytes,
                recipient=verify_certified_key(
                    certified, signer=self.roster.party(name).identity.signing, context=run_key_context(self.run, name)
                ),
                sender=self.credentials.identity.signing,
                context=sealed_key_context(self.run, name),
            )
            for name, certified in run_keys.items()
        }
        return KeySetup(sealed_keys=sealed)

    def send_run_key(self) -> None:
        """As a recipient: announce a fresh box key for this run, certified by this hospital's identity."""
        self.run_key = X25519PrivateKey.generate()
        context = run_key_context(self.run, self.name)
        self.send(
            RunKey(
                certified_key=certify_key(
                    self.run_key.public_key(), signer=self.credentials.identity.signing, context=context
                )
            )
        )

    def receive_key(self) -> None:
        sealed = self.expect(SealedKey)
        secret_bytes = open_box(
            sealed.box,
            recipient=self.run_key,
            sender=self.roster.party(sealed.sealer).identity.signing,
            context=sealed_key_context(self.run, self.name),
        )
        self.secret = SecretContext.from_bytes(secret_bytes, self.config.bfv_parameters(), run_id=self.config.run_id)
        self.send(KeyReady())

    def statement(self, aggregate: Aggregate) -> bytes:
        return aggregate_statement(
            run=self.run,
            round_number=aggregate.round,
            contributors=aggregate.contributors,
            chunks=aggregate.chunks,
            round_state=self.config.training.round_state(),  # a scripted hospital's run keeps its first round's settings
        )

    def signature(self, aggregate: Aggregate) -> bytes:
        return endorse(self.statement(aggregate), self.credentials.identity.signing)

    def endorse(self, aggregate: Aggregate) -> None:
        self.send(Endorsement(round=aggregate.round, signature=self.signature(aggregate)))

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
        """The Welcome to the start of this run, or of one with ``config`` (the key holder creates the key)."""
        config = config or self.config
        return Welcome(
            config=config.to_dict(),
            initial_parameters=self.initial,
            parameters=self.initial,
            optimizer_state=bytes(len(self.initial)),
            generate_key=name == config.key_holder,
        )

    def set_up(self) -> None:
        """Join and key ceremony, as an honest server runs them."""
        self.join()
        holder, recipients = self.config.hospitals[0], self.config.hospitals[1:]
        replies = self.receive_from_each((KeyReady, RunKey), self.config.hospitals)
        if not isinstance(replies.pop(holder), KeyReady) or not all(isinstance(r, RunKey) for r in replies.values()):
            raise ScriptError(f"expected key ready from {holder} and run keys from the others, got {replies}")
        self.send(holder, KeyRequest(run_keys={name: message.certified_key for name, message in replies.items()}))
        setup = self.receive_from_each(KeySetup, [holder])[holder]
        for name, box in setup.sealed_keys.items():
            self.send(name, SealedKey(box=box, sealer=holder))
        self.receive_from_each(KeyReady, recipients)

    def start_round(self, round_number: int) -> dict[str, list[bytes]]:
        """Start a round and collect every hospital's upload."""
        for name in self.config.hospitals:
            self.send(name, RoundStart(round=round_number))
        updates = self.receive_from_each(Update, self.config.hospitals)
        return {name: list(update.chunks) for name, update in updates.items()}

    def add(self, *uploads: list[bytes]) -> list[bytes]:
        total = CiphertextSum(self.public)
        for chunks in uploads:
            total.add(chunks)
        return total.to_chunks()

    def close(self) -> None:
        self.transport.close()
