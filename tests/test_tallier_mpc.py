"""The talliers' secure argmax, run by three real MPyC processes over mutual TLS."""

import subprocess
import sys

import numpy as np

from crypto.secret_sharing import share
from protocol.roster import MPC_CERTIFICATES, provision
from tallier.mpc import bit_length_for, field_modulus
from tests.conftest import REPO, child_environment, free_port

TALLIERS = 3


def _tallier_folders(root):
    """The talliers' folders of a freshly provisioned federation: each holds its MPC certificates."""
    addresses = tuple(f"127.0.0.1:{free_port()}" for _ in range(TALLIERS))
    roster = provision(root, hospitals=1, address=f"tcp://127.0.0.1:{free_port()}", mpc_addresses=addresses)
    return [root / name for name in roster.talliers]


def _run(tmp_path, totals, *, reveal="labels", folders=None, parties=range(TALLIERS), timeout=60.0):
    """Share ``totals`` (Q x C) among the talliers, run the parties in ``parties``; their results and exit codes."""
    queries, classes = totals.shape
    bit_length = bit_length_for(int(np.abs(totals).max()))
    shares = share(totals.reshape(-1), TALLIERS, field_modulus(bit_length))
    source = tmp_path / "input.npz"
    np.savez(source, local_sums=np.stack(shares), queries=queries, classes=classes, bit_length=bit_length, reveal=reveal, timeout=timeout)
    folders = folders or _tallier_folders(tmp_path / "federation")
    ports = [str(free_port()) for _ in range(TALLIERS)]
    processes = {
        index: subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "mpc_party.py"), str(source), str(tmp_path / f"out-{index}.npz"), str(index), str(folders[index]), *ports],
            env={**child_environment(), "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for index in parties
    }
    codes = {index: process.wait(timeout=timeout + 60) for index, process in processes.items()}
    errors = {index: process.stderr.read() for index, process in processes.items()}
    outputs = {index: dict(np.load(tmp_path / f"out-{index}.npz")) for index in parties if codes[index] == 0}
    return outputs, codes, errors


def test_the_mpc_argmax_is_the_plaintext_argmax_ties_included(tmp_path):
    generator = np.random.default_rng()
    totals = generator.integers(-400, 400, size=(300, 10))
    tied = totals[:100]
    tied[:, 2] = tied.max(axis=1) + 1  # a tie between classes 2 and 7 (and 0 in the second half) ...
    tied[:, 7] = tied[:, 2]
    tied[50:, 0] = tied[50:, 2]
    totals[100:110] = 0  # ... and all ten classes tied
    outputs, codes, errors = _run(tmp_path, totals)
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    for output in outputs.values():
        assert np.array_equal(output["labels"], totals.argmax(axis=1))
        assert "totals" not in output
    # The tie rule: the lowest class index among the largest totals.
    assert set(outputs[0]["labels"][:50]) == {2} and set(outputs[0]["labels"][50:110]) == {0}


def test_histogram_mode_opens_the_totals(tmp_path):
    totals = np.random.default_rng().integers(-50, 50, size=(20, 4))
    outputs, codes, errors = _run(tmp_path, totals, reveal="histogram")
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    assert np.array_equal(outputs[1]["totals"], totals)
    assert np.array_equal(outputs[1]["labels"], totals.argmax(axis=1))


def test_a_missing_tallier_ends_the_round_with_an_error_and_no_labels(tmp_path):
    totals = np.zeros((5, 3), dtype=np.int64)
    outputs, codes, errors = _run(tmp_path, totals, parties=(0, 1), timeout=5.0)
    assert outputs == {}
    assert codes == {0: 2, 1: 2}
    assert all("did not finish within 5 s" in error and "Traceback" not in error for error in errors.values())


def test_a_tallier_certified_by_another_authority_is_not_let_in(tmp_path):
    folders = _tallier_folders(tmp_path / "ours")
    (folders[2] / MPC_CERTIFICATES).rename(tmp_path / "unused")
    impostor = _tallier_folders(tmp_path / "theirs")[2]  # the same name, from another federation's authority
    (impostor / MPC_CERTIFICATES).rename(folders[2] / MPC_CERTIFICATES)
    outputs, codes, _ = _run(tmp_path, np.zeros((5, 3), dtype=np.int64), folders=folders, timeout=5.0)
    assert outputs == {} and set(codes.values()) == {2}
