"""Real processes against a scripted peer: a server against scripted hospitals, hospitals against a scripted server."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np

from conftest import child_environment, free_port, launcher
from protocol.roster import SERVER, Credentials, Roster, provision
from scripts import _scripted
from training.accounting import LEDGER_FILE, PrivacyLedger


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


class ScriptedHospital(_scripted.ScriptedHospital):
    def __init__(self, server: ServerProcess, name: str) -> None:
        super().__init__(server.roster, Credentials.load(server.federation, name))

    def random_update(self, seed: int) -> np.ndarray:
        params = self.config.bfv_parameters()
        bound = params.sum_bound // params.max_contributors
        return np.random.default_rng(seed).integers(-bound, bound, params.vector_length, endpoint=True)


class ScriptedServer(_scripted.ScriptedServer):
    """A scripted server and a real hospital process for each hospital of a (new or existing) federation."""

    def __init__(self, tmp_path: Path, hospitals: int, *, quorum: int, rounds: int = 5, run_id: str | None = None) -> None:
        self.federation = tmp_path / "federation"
        if (self.federation / "roster.toml").exists():
            roster = Roster.load(self.federation)
        else:
            roster = provision(self.federation, hospitals=hospitals, address=f"tcp://127.0.0.1:{free_port()}")
        config = _scripted.small_run_config(roster, quorum=quorum, rounds=rounds, run_id=run_id)
        super().__init__(roster, Credentials.load(self.federation, SERVER), config)
        self.logs = {name: tmp_path / f"{name}-{config.run_id}.log" for name in config.hospitals}
        self.processes = {
            name: subprocess.Popen(
                launcher(
                    "hospital", "--federation", self.federation, "--name", name, "--timeout", "60", "--send-offset", "0",
                    "--epsilon-budget", "100", "--parts", len(config.hospitals), "--part", index,
                ),
                stdout=subprocess.DEVNULL, stderr=self.logs[name].open("w"), text=True, env=child_environment(),
            )  # fmt: skip
            for index, name in enumerate(config.hospitals, start=1)
        }

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
        super().close()
