"""The talliers' MPC network, attacked by a tallier: code in a pickle, a borrowed certificate, a listener that is not its party.

Real tallier processes (``scripts.bench_tallier --party``) run a round of the MPC; the attacker is a real
MPyC party whose messages are replaced, or a TLS client or server in this process holding a
real tallier's key.
"""

from __future__ import annotations
from tally_inputs import layout_for

import ast
import inspect
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from consilium.crypto.mpc_field import MpcField, import_mpyc
from consilium.scripts.bench_tallier import party_command, share_ballots, write_input
from consilium.crypto.tls import certificate_pem, make_mpc_certificate
from consilium.tallier.mpc_values import harden_mpyc
from consilium.protocol.identity.party_keys import MPC_CERTIFICATE_FILE, MPC_KEY_FILE
from consilium.protocol.identity.roster import local_federation
from conftest import REPO, child_environment, free_port, wait_until_listening
from scripted import wait_for_text

HOSPITALS = ("hospital-1", "hospital-2")
_PRSS_KEY_BYTES = 16  # what each lower party sends tallier-3 after its number, with three talliers
_ROGUE = """
import atexit, os, pickle, runpy, sys
from consilium.crypto.mpc_field import MpcField, import_mpyc

kind, marker = sys.argv[1], sys.argv[2]
Runtime = import_mpyc().Runtime
original = Runtime._send_message
replaced = []


class RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))


def send(self, peer, data):
    if sys._getframe(1).f_code.co_name == kind:
        # Padded to a prime length (pickle ignores what follows its STOP): never a whole number of field
        # elements by chance of the marker path's length, which would make it data of the wrong count.
        data = pickle.dumps(RunsCode())
        data += bytes(_PRIME_LENGTH - len(data))
        replaced.append(peer)
    original(self, peer, data)


_PRIME_LENGTH = 251
Runtime._send_message = send
atexit.register(lambda: print(f"replaced {len(replaced)} {kind} messages", file=sys.stderr, flush=True))
sys.argv = ["bench_tallier", "--party", *sys.argv[3:]]
runpy.run_module("consilium.scripts.bench_tallier", run_name="__main__")
"""


def _federation(root: Path, hosts=("127.0.0.1", "127.0.0.1", "127.0.0.1")):
    addresses = tuple(f"{host}:{free_port()}" for host in hosts)
    return local_federation(root, hospitals=1, address=f"tcp://127.0.0.1:{free_port()}", mpc_addresses=addresses)


def _input(tmp_path: Path, timeout: float, queries: int = 20, classes: int = 4) -> None:
    layout = layout_for(queries, classes, 1)
    votes = np.eye(classes, dtype=np.int64)[np.random.default_rng().integers(0, classes, size=queries)]
    ballots = {name: (votes, np.zeros(queries * classes, dtype=np.int64)) for name in HOSPITALS}
    shares, field = share_ballots(ballots, 3, layout)
    write_input(
        tmp_path / "input.npz",
        shares,
        hospitals=HOSPITALS,
        layout=layout,
        quorum=2,
        field=field,
        reveal="labels",
        timeout=timeout,
        rounds=1,
        label_threshold=0,
    )


def _tallier(tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """A real tallier's round, logging to a file."""
    log = tmp_path / f"{name}.log"
    with log.open("w") as handle:
        process = subprocess.Popen(
            party_command("input.npz", f"out-{name}", tmp_path / "federation", name),
            cwd=tmp_path,
            env={**child_environment(), "PYTHONPATH": str(REPO)},
            stdout=handle,
            stderr=handle,
            text=True,
        )
    return process, log


def _deserializers(package: Path) -> set[tuple[str, str]]:
    """(module, function) of every use of pickle's or marshal's loaders in a package's source."""
    found = set()
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        for function in (node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in {"load", "loads", "Unpickler"}
                    and isinstance(node.value, ast.Name)
                    and node.value.id in {"pickle", "marshal", "dill", "cloudpickle"}
                ):
                    found.add((path.stem, function.name))
    return found


def test_mpyc_unpickles_a_peer_s_bytes_only_where_consilium_refuses_globals():
    """The places ``tallier.mpc_values`` covers: if an MPyC upgrade moves them, this fails first."""
    runtime = import_mpyc()
    assert _deserializers(Path(runtime.__file__).parent) == {
        ("runtime", "transfer"),
        ("runtime", "_distribute"),
        ("runtime", "output"),
        ("runtime", "_reshare"),
    }
    for name in (
        "_distribute",
        "output",
        "_reshare",
    ):  # arrays through the module's `pickle`, single values through from_bytes
        source = inspect.getsource(getattr(runtime.Runtime, name))
        assert "unmarshal = pickle.loads" in source and "unmarshal = field.from_bytes" in source
    assert "outdata = list(map(pickle.loads, outdata))" in inspect.getsource(runtime.Runtime.transfer)
    harden_mpyc(MpcField.for_bound(40).modulus)  # what every round does first: `pickle` there is no longer pickle
    assert (
        type(runtime.pickle).__name__ == "_Codec"
        and runtime.finfields.FiniteFieldElement.from_bytes.__name__ == "_field_elements"
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["_distribute", "open_checked", "_reshare", "transfer"])
def test_a_crafted_pickle_in_any_mpc_message_runs_nothing_and_aborts_the_round(tmp_path, kind):
    """tallier-1 replaces every message of one kind (an input's shares, an opening's, a multiplication's
    reshares, the shutdown's barrier) by a pickle that would run a command; the others run none.

    Once the checked arithmetic began (the first resharing is in it, and the shutdown's barrier comes after it),
    such a message is a deviation: the run stops rather than tally the round again. (A message of the right length
    whose values all lie in the field would be taken as shares: data, never code. A wrong share of an input or an
    opening is caught by the checks of ``tallier.mpc`` and ``open_checked``, and one inside a multiplication by the
    MAC checks, ``tallier.authenticated``.)"""
    marker = tmp_path / "code-ran"
    codes, errors, rogue = _against_a_deviating_tallier(tmp_path, _ROGUE, kind, str(marker))
    assert f"replaced 0 {kind}" not in rogue
    assert not marker.exists()
    stops = (
        "error: round 1: once the checked arithmetic began, "
        if kind in ("transfer", "_reshare")
        else "error: the talliers' MPC was aborted: "
    )
    aborted = "error: the talliers' MPC was aborted: "  # the other's word, or its peer leaving, may come first
    for name in errors:  # each stops in one line; one that did not receive the pickle sees its peer leave
        assert codes[name] == 2 and (stops in errors[name] or aborted in errors[name]), errors[name]
        assert "Traceback" not in errors[name] and len(errors[name].splitlines()) == 1, errors[name]
    assert any(stops in error and "tallier-1 sent" in error for error in errors.values()), errors


_LIAR = """
import runpy, sys
import numpy as np
from consilium.crypto.mpc_field import import_mpyc

module = import_mpyc()
original = module.Runtime._send_message
how = sys.argv.pop(1)


def send(self, peer, data):
    if sys._getframe(1).f_code.co_name == "open_checked" and peer == 1:  # a wrong share, to tallier-2 only
        codec = module.pickle
        values = codec.loads(data)
        if how == "longer":
            values = np.concatenate([values, values[:1]])
        elif how != "another kind":
            values[0] = (int(values[0]) + 1) % codec.modulus
        data = codec.dumps(values)
        if how == "another kind":  # as long as a share, marked as an integer (one is, at a 9-byte share)
            data = b"I" + data[1:]
    original(self, peer, data)


module.Runtime._send_message = send
sys.argv = ["bench_tallier", "--party", *sys.argv[1:]]
runpy.run_module("consilium.scripts.bench_tallier", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, caught",
    [
        ("shifted", "do not lie on one polynomial: a tallier sent a wrong share"),
        ("longer", "tallier-1 sent a share of an opened value of the wrong length or kind"),
        ("another kind", "tallier-1 sent a share of an opened value of the wrong length or kind"),
    ],
)
def test_a_wrong_share_of_an_opened_value_is_caught_by_the_tallier_that_receives_it(tmp_path, how, caught):
    """tallier-1 sends tallier-2 a share of an opening that is off by one, one value longer, or marked as an
    integer; MPyC's own output would take the first (from ``t + 1`` shares): ``open_checked`` sees the three shares
    off one line, or the others' length or kind before it decodes them, and ends the round."""
    codes, errors, _ = _against_a_deviating_tallier(tmp_path, _LIAR, how)
    assert codes == {"tallier-2": 2, "tallier-3": 2}, errors
    assert caught in errors["tallier-2"], errors
    assert not list(tmp_path.glob("out-tallier-*")), "no tallier may finish the round"


def _against_a_deviating_tallier(tmp_path: Path, code: str, *arguments: str) -> tuple[dict, dict, str]:
    """A round in which tallier-1 runs ``code`` (which patches MPyC, then plays its party) and the others are
    honest: the honest talliers' exit codes and logs, and tallier-1's stderr."""
    roster = _federation(tmp_path / "federation")
    _input(tmp_path, timeout=60.0)
    deviating = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            *arguments,
            "input.npz",
            "out-deviating",
            str(tmp_path / "federation"),
            "tallier-1",
        ],
        cwd=tmp_path,
        env={**child_environment(), "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE,
        text=True,
    )
    honest = {name: _tallier(tmp_path, name) for name in roster.talliers[1:]}
    codes = {name: process.wait(timeout=120) for name, (process, _) in honest.items()}
    errors = {name: log.read_text() for name, (_, log) in honest.items()}
    deviating.kill()
    return codes, errors, deviating.communicate(timeout=30)[1]


def _client(address: tuple[str, int], folder: Path) -> ssl.SSLSocket:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the attacker trusts anyone; it is the listener that must not
    context.load_cert_chain(folder / MPC_CERTIFICATE_FILE, folder / MPC_KEY_FILE)
    return context.wrap_socket(socket.create_connection(address, timeout=30))


def _claim(address: tuple[str, int], folder: Path, party: int) -> ssl.SSLSocket:
    connection = _client(address, folder)
    connection.sendall(party.to_bytes(2, "little") + bytes(_PRSS_KEY_BYTES))
    return connection


def _closed_by_peer(connection: ssl.SSLSocket) -> bool:
    try:
        return connection.recv(1) == b""
    except (ssl.SSLError, ConnectionError):
        return True


@pytest.mark.slow
def test_an_mpc_connection_is_bound_to_the_party_its_pinned_certificate_names(tmp_path):
    """Holding tallier-1's key, claim party 0 twice, then party 1, then tallier-3's own number;
    then present a certificate the roster does not pin. tallier-3 lets in the first claim only,
    and it listens on its declared address alone."""
    roster = _federation(tmp_path / "federation", hosts=("127.0.0.1", "127.0.0.1", "127.0.0.2"))
    _input(tmp_path, timeout=30.0)
    listener, log = _tallier(tmp_path, "tallier-3")
    host, port = roster.party("tallier-3").mpc_address
    wait_until_listening((host, port), listener)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()

    tallier_1 = tmp_path / "federation" / "tallier-1"
    first = _claim((host, port), tallier_1, 0)
    for claim, refusal in (
        (0, "claimed party 0 (tallier-1), which is connected already"),
        (1, "claimed party 1 (tallier-2) without its pinned certificate"),
        (2, "claimed party 2, which dials higher-numbered parties only"),
    ):
        connection = _claim((host, port), tallier_1, claim)
        wait_for_text(log, refusal, listener, timeout=30)
        assert _closed_by_peer(connection)
    assert not _closed_by_peer_within(first, 0.5)

    stranger = tmp_path / "stranger"  # a certificate of its own, as any tallier of another federation has
    stranger.mkdir()
    certificate = make_mpc_certificate("Consilium tallier-2 MPC")
    (stranger / MPC_CERTIFICATE_FILE).write_bytes(certificate_pem(certificate.certificate))
    (stranger / MPC_KEY_FILE).write_bytes(certificate.private_key)
    try:
        refused = _closed_by_peer(_claim((host, port), stranger, 1))
    except (ssl.SSLError, ConnectionError):
        refused = True
    assert refused
    listener.kill()
    listener.wait()


def _closed_by_peer_within(connection: ssl.SSLSocket, seconds: float) -> bool:
    connection.settimeout(seconds)
    try:
        return _closed_by_peer(connection)
    except TimeoutError:
        return False


@pytest.mark.slow
def test_a_dialing_tallier_refuses_a_listener_without_the_pinned_certificate(tmp_path):
    """tallier-3 answers at tallier-2's address with its own (pinned, but not tallier-2's) certificate."""
    roster = _federation(tmp_path / "federation")
    _input(tmp_path, timeout=30.0)
    folder = tmp_path / "federation" / "tallier-3"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / MPC_CERTIFICATE_FILE, folder / MPC_KEY_FILE)
    with socket.create_server(roster.party("tallier-2").mpc_address) as impostor:
        dialer, log = _tallier(tmp_path, "tallier-1")
        impostor.settimeout(30)
        connection, _ = impostor.accept()
        with pytest.raises((ssl.SSLError, ConnectionError)):
            context.wrap_socket(connection, server_side=True).recv(1)
        wait_for_text(log, "as tallier-2: it did not present tallier-2's pinned certificate", dialer, timeout=30)
        dialer.kill()
        dialer.wait()
