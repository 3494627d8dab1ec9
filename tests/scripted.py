"""Real processes against a scripted peer: a server against scripted hospitals, hospitals against a scripted server."""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from pathlib import Path

import numpy as np

from conftest import child_environment, free_port, launcher
from crypto.bfv import CiphertextSum, PublicContext, SecretContext
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from crypto.endorsement import aggregate_statement, endorse
from crypto.sealed_box import certify_key, open_box, seal, verify_certified_key
from protocol.config import RunConfig
from protocol.hospital import run_key_context, sealed_key_context
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
from protocol.roster import SERVER, Credentials, Roster, provision
from protocol.transport import ClientTransport, ServerTransport
from training.accounting import LEDGER_FILE, PrivacyLedger
from training.dopamine import DopamineSettings
from training.models import ModelSpec, build_model, get_flat_parameters

MAX_BYTES = 1 << 24


class ServerProcess:
    def __init__(self, tmp_path: Path, hospitals: int, *args: str) -> None:
        self.federation = tmp_path / "federation"
        self.out = tmp_path / "server"
        self.roster = provision(self.federation, hospitals=hospitals, address=f"tcp://127.0.0.1:{free_port()}")
        self.log = tmp_path / "server.log"
        command = launcher(
            "server", "--federation", self.federation, "--out", self.out, "--expected-batch-size", "5",
            "--hidden", "4", "--join-timeout", "60", "--transcript", tmp_path / "transcript.msgpack", *args,
        )  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=self.log.open("w"), text=True, env=child_environment()
        )

    def wait_for_log(self, text: str, timeout: float = 60) -> None:
        """Wait until the server has logged ``text``: an observable event, not a guess at timing."""
        deadline = time.monotonic() + timeout
        while text not in self.log.read_text():
            assert self.process.poll() is None, f"the server exited before logging {text!r}"
            assert time.monotonic() < deadline, f"the server did not log {text!r} within {timeout} s"
            time.sleep(0.02)

    def finish(self, timeout: float = 60) -> dict:
        assert self.process.wait(timeout=timeout) == 0, self.log.read_text()
        return json.loads((self.out / "server_report.json").read_text())

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class ScriptedHospital:
    def __init__(self, server: ServerProcess, name: str) -> None:
        self.name = name
        self.roster: Roster = server.roster
        self.credentials = Credentials.load(server.federation, name)
        self.transport = ClientTransport(self.roster.server_address, self.roster.server.curve_public, self.credentials.curve, MAX_BYTES)
        self.secret: SecretContext | None = None
        self.config: RunConfig | None = None

    def send(self, message: Message) -> None:
        self.transport.send(encode(message))

    def send_raw(self, payload: bytes) -> None:
        self.transport.send(payload)

    def expect(self, kind: type, timeout: float = 60) -> Message:
        payload = self.transport.receive(timeout)
        assert payload is not None, f"{self.name}: nothing from the server within {timeout} s"
        message = decode(payload, accept=TO_HOSPITAL, max_bytes=MAX_BYTES)
        assert isinstance(message, kind), f"{self.name}: expected {kind.TYPE}, got {message}"
        return message

    def welcome(self) -> RunConfig:
        self.config = RunConfig.from_dict(self.expect(Welcome).config)
        return self.config

    def key_setup(self) -> KeySetup:
        """As the key holder: answer the key request with a fresh context sealed to the others."""
        run_keys = self.expect(KeyRequest).run_keys
        self.secret = SecretContext.generate(self.config.bfv_parameters(), run_id=self.config.run_id)
        secret_bytes = self.secret.to_bytes()
        sealed = {
            name: seal(
                secret_bytes,
                recipient=verify_certified_key(
                    certified, signer=self.roster.party(name).identity.signing, context=run_key_context(self.config.run_id, name)
                ),
                sender=self.credentials.identity.signing,
                context=sealed_key_context(self.config.run_id, name),
            )
            for name, certified in run_keys.items()
        }
        return KeySetup(sealed_keys=sealed)

    def send_run_key(self) -> None:
        """As a recipient: announce a fresh box key for this run, certified by this hospital's identity."""
        self.run_key = X25519PrivateKey.generate()
        context = run_key_context(self.config.run_id, self.name)
        self.send(RunKey(certified_key=certify_key(self.run_key.public_key(), signer=self.credentials.identity.signing, context=context)))

    def receive_key(self) -> None:
        box = self.expect(SealedKey).box
        holder = self.roster.party(self.config.key_holder)
        secret_bytes = open_box(
            box,
            recipient=self.run_key,
            sender=holder.identity.signing,
            context=sealed_key_context(self.config.run_id, self.name),
        )
        self.secret = SecretContext.from_bytes(secret_bytes, self.config.bfv_parameters(), run_id=self.config.run_id)
        self.send(KeyReady())

    def endorse(self, aggregate: Aggregate) -> None:
        statement = aggregate_statement(
            run_id=self.config.run_id, round_number=aggregate.round, contributors=aggregate.contributors, chunks=aggregate.chunks
        )
        self.send(Endorsement(round=aggregate.round, signature=endorse(statement, self.credentials.identity.signing)))

    def random_update(self, seed: int) -> np.ndarray:
        params = self.config.bfv_parameters()
        bound = params.sum_bound // params.max_contributors
        return np.random.default_rng(seed).integers(-bound, bound, params.vector_length, endpoint=True)

    def close(self) -> None:
        self.transport.close()


class ScriptedServer:
    """The server's side, scripted message by message, against real hospital processes."""

    def __init__(self, tmp_path: Path, hospitals: int, *, quorum: int, rounds: int = 5, run_id: str | None = None) -> None:
        self.federation = tmp_path / "federation"
        if (self.federation / "roster.toml").exists():
            self.roster = Roster.load(self.federation)
        else:
            self.roster = provision(self.federation, hospitals=hospitals, address=f"tcp://127.0.0.1:{free_port()}")
        self.config = RunConfig(
            run_id=run_id or secrets.token_hex(8),
            dataset="breast_cancer",
            hospitals=tuple(self.roster.hospitals),
            rounds=rounds,
            delta=1e-5,
            model=ModelSpec("mlp", (30,), 2, (4,)),
            dopamine=DopamineSettings(
                sample_rate=0.2, noise_multiplier=1.0, max_grad_norm=1.0, quorum=quorum,
                expected_batch_size=10, learning_rate=0.05, momentum=0.9,
            ),
        )  # fmt: skip
        self.public = PublicContext(self.config.bfv_parameters())
        credentials = Credentials.load(self.federation, SERVER)
        enrolled = {self.roster.party(name).curve_public: name for name in self.config.hospitals}
        self.transport = ServerTransport(self.roster.server_address, credentials.curve, enrolled, self.config.message_limit())
        self.logs = {name: tmp_path / f"{name}-{self.config.run_id}.log" for name in self.config.hospitals}
        self.processes = {
            name: subprocess.Popen(
                launcher(
                    "hospital", "--federation", self.federation, "--name", name, "--timeout", "60", "--send-offset", "0", "--epsilon-budget", "100",
                    "--parts", len(self.config.hospitals), "--part", index,
                ),
                stdout=subprocess.DEVNULL, stderr=self.logs[name].open("w"), text=True, env=child_environment(),
            )  # fmt: skip
            for index, name in enumerate(self.config.hospitals, start=1)
        }

    def receive(self, timeout: float = 60) -> tuple[str, Message]:
        got = self.transport.receive(timeout)
        assert got is not None, f"no message from any hospital within {timeout} s"
        sender, payload = got
        return sender, decode(payload, accept=TO_SERVER, max_bytes=self.config.message_limit())

    def receive_from_each(self, kind: type, names) -> dict[str, Message]:
        messages = {}
        while set(messages) != set(names):
            sender, message = self.receive()
            assert isinstance(message, kind) and sender in names, f"expected {kind.TYPE} from {names}, got {message} from {sender}"
            messages[sender] = message
        return messages

    def send(self, name: str, message: Message) -> None:
        assert self.transport.send(name, encode(message))

    def join(self) -> None:
        self.receive_from_each(Hello, self.config.hospitals)
        initial = get_flat_parameters(build_model(self.config.model)).tobytes()
        for name in self.config.hospitals:
            self.send(name, Welcome(config=self.config.to_dict(), initial_parameters=initial))

    def set_up(self) -> None:
        """Join and key ceremony, as an honest server runs them."""
        self.join()
        hospitals = self.config.hospitals
        holder, recipients = hospitals[0], hospitals[1:]
        run_keys = self.receive_from_each(RunKey, recipients)
        self.send(holder, KeyRequest(run_keys={name: message.certified_key for name, message in run_keys.items()}))
        setup = self.receive_from_each(KeySetup, [holder])[holder]
        for name, box in setup.sealed_keys.items():
            self.send(name, SealedKey(box=box))
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

    def wait_for_exit(self, name: str, timeout: float = 60) -> str:
        """The hospital's exit status must be an error; returns what it wrote to stderr."""
        assert self.processes[name].wait(timeout=timeout) != 0, f"{name} finished normally"
        return self.logs[name].read_text()

    def ledger_epsilon(self, name: str) -> float:
        return PrivacyLedger(self.federation / name / LEDGER_FILE).epsilons(self.config.delta)["server"]

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        self.transport.close()
