"""A small sample of the fuzzer (tests/support/fuzz.py) against a real server, a real hospital and the decryptor."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, child_environment

pytestmark = pytest.mark.slow


def test_a_fuzz_sample_finds_no_crash_traceback_or_state_change(tmp_path):
    result = subprocess.run(
        [sys.executable, "tests/support/fuzz.py", "--messages", "1500", "--seed", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=child_environment(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "fuzz.json").read_text())
    assert report["clean"] and report["messages_sent"] >= 1400
    for name, target in report["targets"].items():
        assert target["rejected"] + target["accepted_unchanged"] == target["sent"] > 0, name
        assert target["crashes"] == target["tracebacks"] == target["state_changes"] == 0, name
    families = {"random_bytes", "generated", "byte_mutation", "structural", "ciphertext", "forged_endorsement"}
    assert set(report["targets"]["server"]["by_family"]) == families  # every family reached the server
