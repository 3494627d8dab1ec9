"""Helpers shared by the tests: running the launchers as real processes, free ports, small parameters."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from consilium.crypto.bfv_parameters import select_bfv_parameters
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import local_federation
from consilium.training.data.datasets import load_dataset
from consilium.training.data.partition import partition
from consilium.training.privacy.ledger import LEDGER_FILE, PrivacyLedger
from consilium.orchestration.local import free_port  # noqa: F401  (the tests' ports, as the launchers pick them)

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def launcher(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", f"consilium.scripts.{module}", *map(str, args)]


def run_launcher(
    module: str, *args: str, timeout: float = 240, environment: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        launcher(module, *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**child_environment(), **(environment or {})},
        cwd=REPO,
    )


def party_ledger(party_folder: Path, ledger_folder: Path | None = None, name: str = LEDGER_FILE) -> PrivacyLedger:
    """The privacy ledger in ``ledger_folder`` (default: the party's own folder), read under its party's MAC key."""
    return PrivacyLedger((ledger_folder or party_folder) / name, key=Credentials.load(party_folder).ledger_key)


def wait_until_listening(address: tuple[str, int], process: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until ``address`` accepts a TCP connection (an observable event), while ``process`` runs."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(address, timeout=1).close()
            return
        except OSError:
            assert process.poll() is None, f"{process.args[-1]!r} exited before it listened on {address}"
            assert time.monotonic() < deadline, f"nothing listened on {address} within {timeout} s"
            time.sleep(0.05)


def child_environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def small_params():
    """Parameters for 10 contributors of 300 integers whose sum stays within [-40000, 40000]."""
    return select_bfv_parameters(max_contributors=10, vector_length=300, sum_bound=40_000)


@pytest.fixture
def threaded_federation(tmp_path):
    """Three hospitals' keys and the roster, as a real federation makes them, and each hospital's share of the
    built-in breast cancer data: for roles run as threads over ``tests/support/memory_transport.py``."""
    roster = local_federation(tmp_path / "federation", hospitals=3, address="tcp://127.0.0.1:1")
    data = load_dataset("breast_cancer")
    parts = partition(data.train.y, 3, seed=0)
    shares = {name: data.train.subset(part) for name, part in zip(roster.hospitals, parts)}
    return roster, data, shares, tmp_path
