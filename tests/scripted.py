"""A real server process, and hospitals whose side the test scripts message by message."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np

from conftest import child_environment, free_port, launcher
from crypto.bfv import SecretContext
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from crypto.sealed_box import certify_key, open_box, seal, verify_certified_key
from protocol.config import RunConfig
from protocol.hospital import run_key_context, sealed_key_context
from protocol.messages import TO_HOSPITAL, KeyReady, KeyRequest, KeySetup, Message, RunKey, SealedKey, Welcome, decode, encode
from protocol.roster import Credentials, Roster, provision
from protocol.transport import ClientTransport

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

    def random_update(self, seed: int) -> np.ndarray:
        params = self.config.bfv_parameters()
        bound = params.sum_bound // params.max_contributors
        return np.random.default_rng(seed).integers(-bound, bound, params.vector_length, endpoint=True)

    def close(self) -> None:
        self.transport.close()
