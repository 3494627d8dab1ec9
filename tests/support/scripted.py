"""Real processes against a scripted peer: a server against scripted hospitals, hospitals against a scripted server."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np

from conftest import child_environment, free_port, launcher, party_ledger
from consilium.protocol.identity.party_keys import SERVER, Credentials
from consilium.protocol.identity.roster import Roster, local_federation
import scripted_peers
from consilium.training.privacy.ledger import PrivacyLedger


class ServerProcess:
    """A real server; what it prints and logs goes to one file, which the tests wait on."""

    def __init__(self, tmp_path: Path, hospitals: int, *args: str, address: str | None = None) -> None:
        self.federation = tmp_path / "federation"
        self.out = tmp_path / "server"
        address = address or f"tcp://127.0.0.1:{free_port()}"  # the roster's, where the hospitals connect
        self.roster = local_federation(self.federation, hospitals=hospitals, address=address)
        self.log = tmp_path / "server.log"
        self._command = launcher(
            "server",
            *confirmed(self.federation),
            "--out",
            self.out,
            "--expected-batch-size",
            "5",
            "--hidden",
            "4",
            "--join-timeout",
            "60",
            "--transcript",
            tmp_path / "transcript.msgpack",
            *args,
        )
        self.process = self._start()
        self.peers: list[ScriptedHospital] = []  # closed with the server, so that a failed test leaves no socket open

    def _start(self, *args: str) -> subprocess.Popen:
        with self.log.open("a") as log:
            return subprocess.Popen(
                [*self._command, *args],
                stdout=log,
                stderr=log,
                text=True,
                env=child_environment(),
                preexec_fn=_interruptible,
            )

    def restart(self) -> None:
        """Kill the server the hard way (SIGKILL), then start it again on the same output with --resume."""
        self.kill()
        self.process = self._start("--resume")

    def wait_for_log(self, text: str, timeout: float = 60) -> None:
        """Wait until the server has logged ``text``: an observable event, not a guess at timing."""
        wait_for_text(self.log, text, self.process, timeout)

    def finish(self, timeout: float = 60) -> dict:
        assert self.process.wait(timeout=timeout) == 0, self.log.read_text()
        return json.loads((self.out / "server_report.json").read_text())

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def close(self) -> None:
        """Kill the server and close every scripted hospital, also after a failed test."""
        self.kill()
        for peer in self.peers:
            peer.close()


class HospitalProcess:
    """A real hospital with its part of the built-in data, logging to a file."""

    def __init__(self, federation: Path, name: str, part: int, parts: int, log: Path, *args: str) -> None:
        self.name = name
        self.log = log
        self.state = federation / name
        self._command = launcher(
            "hospital",
            *confirmed(federation),
            "--name",
            name,
            "--timeout",
            "60",
            "--parts",
            parts,
            "--part",
            part,
            *args,
        )
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        with self.log.open("a") as log:
            return subprocess.Popen(self._command, stdout=log, stderr=log, text=True, env=child_environment())

    def start_again(self) -> None:
        """Start the hospital again with the same state, once it has been killed."""
        assert self.process.poll() is not None
        self.process = self._start()

    def wait_for_log(self, text: str, timeout: float = 60) -> None:
        wait_for_text(self.log, text, self.process, timeout)

    def ledger(self) -> PrivacyLedger:
        return party_ledger(self.state)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _interruptible() -> None:
    """Ctrl-C stops the process, as in a terminal, even if the tests run where SIGINT is ignored (a
    background job): Python turns SIGINT into KeyboardInterrupt only if it is not ignored at start."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def confirmed(federation: Path) -> list:
    """A launcher's arguments for the federation in ``federation``, its roster confirmed by its fingerprint."""
    return ["--federation", federation, "--roster-fingerprint", Roster.load(federation).fingerprint]


def wait_for_text(path: Path, text: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert process.poll() is None, f"{path.stem} exited before logging {text!r}"
        assert time.monotonic() < deadline, f"{path.stem} did not log {text!r} within {timeout} s"
        time.sleep(0.02)


class ScriptedHospital(scripted_peers.ScriptedHospital):
    def __init__(self, server: ServerProcess, name: str) -> None:
        super().__init__(server.roster, Credentials.load(server.federation / name))
        server.peers.append(self)

    def close(self) -> None:
        if not self.transport._socket.closed:
            super().close()

    def random_update(self, seed: int) -> np.ndarray:
        params = self.config.bfv_parameters()
        bound = params.sum_bound // params.max_contributors
        return np.random.default_rng(seed).integers(-bound, bound, params.vector_length, endpoint=True)


class ScriptedServer(scripted_peers.ScriptedServer):
    """A scripted server and a real hospital process for each hospital of a (new or existing) federation."""

    def __init__(
        self, tmp_path: Path, hospitals: int, *, quorum: int, rounds: int = 5, run_id: str | None = None
    ) -> None:
        self.federation = tmp_path / "federation"
        if (self.federation / "roster.toml").exists():
            roster = Roster.load(self.federation)
        else:
            roster = local_federation(self.federation, hospitals=hospitals, address=f"tcp://127.0.0.1:{free_port()}")
        config = scripted_peers.small_run_config(roster, quorum=quorum, rounds=rounds, run_id=run_id)
        super().__init__(roster, Credentials.load(self.federation / SERVER), config)
        self.logs = {name: tmp_path / f"{name}-{config.run_id}.log" for name in config.hospitals}
        self.hospitals = {
            name: HospitalProcess(
                self.federation,
                name,
                index,
                len(config.hospitals),
                self.logs[name],
                "--send-offset",
                "0",
                "--epsilon-budget",
                "100",
            )
            for index, name in enumerate(config.hospitals, start=1)
        }

    def wait_for_exit(self, name: str, timeout: float = 60) -> str:
        """The hospital's exit status must be an error; returns what it wrote to stderr."""
        assert self.hospitals[name].process.wait(timeout=timeout) != 0, f"{name} finished normally"
        return self.logs[name].read_text()

    def wait_for_log(self, name: str, text: str, timeout: float = 60) -> None:
        """Wait until hospital ``name`` has logged ``text``: an observable event, not a guess at timing."""
        self.hospitals[name].wait_for_log(text, timeout)

    def ledger_epsilon(self, name: str) -> float:
        return self.hospitals[name].ledger().epsilons(self.config.delta)["server"]

    def close(self) -> None:
        for hospital in self.hospitals.values():
            hospital.kill()
        super().close()
