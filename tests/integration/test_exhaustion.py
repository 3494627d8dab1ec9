"""What runs out: a stranger floods the server's port, or the disk refuses the server's files.

CURVE consults the roster only once a client sends its INITIATE, so a flood of connections that
never finish a handshake gets past nothing, but each holds an open file at the server. The server
is started, as a service often is, with a soft limit of 1,024 open files; it raises that to the
hard limit, and drops every connection that has not finished its handshake within seconds.
"""

import json
import resource
import socket
import subprocess
import threading
import time

import pytest

from conftest import child_environment, free_port, launcher, wait_until_listening
from consilium.protocol.identity.roster import local_federation
from scripted import confirmed, wait_for_text

pytestmark = pytest.mark.slow
IDLE = 2000
SLOW = 100
ROUNDS = 4
TRAINING = ("--sample-rate", "0.1", "--noise-multiplier", "1.0", "--hidden", "4", "--expected-batch-size", "15")
_SERVICE_SOFT_LIMIT = 1024
_ZMTP_GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00CURVE" + bytes(15) + b"\x00" + bytes(31)  # 64 bytes, sent slowly


class _Flood:
    """Keeps ``IDLE`` connections open that send nothing, opening new ones as the server drops old ones,
    and ``SLOW`` that trickle a greeting a byte a second; counts what the server dropped."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.dropped_idle = 0
        self.dropped_slow = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._idle, daemon=True),
            threading.Thread(target=self._slow, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _idle(self) -> None:
        connections = [socket.create_connection(self.address, timeout=10) for _ in range(IDLE)]
        try:
            self._keep_idle(connections)
        finally:
            for connection in connections:
                connection.close()

    def _keep_idle(self, connections: list[socket.socket]) -> None:
        for connection in connections:
            connection.setblocking(False)
        while not self._stop.is_set():
            for index, connection in enumerate(connections):
                if _closed(connection):
                    connection.close()
                    self.dropped_idle += 1
                    try:
                        connections[index] = socket.create_connection(self.address, timeout=10)
                    except OSError:  # the run is over and the server gone
                        return
                    connections[index].setblocking(False)
            self._stop.wait(0.2)

    def _slow(self) -> None:
        connections = [socket.create_connection(self.address, timeout=10) for _ in range(SLOW)]
        for connection in connections:
            connection.setblocking(False)
        sent = 0
        while not self._stop.is_set() and connections:
            for connection in list(connections):
                if _closed(connection):
                    connections.remove(connection)
                    connection.close()
                    self.dropped_slow += 1
                else:
                    try:
                        connection.send(_ZMTP_GREETING[sent % len(_ZMTP_GREETING) : sent % len(_ZMTP_GREETING) + 1])
                    except OSError:
                        pass
            sent += 1
            self._stop.wait(1.0)

    def wait_for_every_drop(self, timeout: float) -> None:
        """Until the server has dropped every idle connection once and every slow one (an observable count)."""
        deadline = time.monotonic() + timeout
        while self.dropped_idle < IDLE or self.dropped_slow < SLOW:
            assert time.monotonic() < deadline, (
                f"dropped {self.dropped_idle} idle, {self.dropped_slow} slow in {timeout} s"
            )
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)


def _closed(connection: socket.socket) -> bool:
    try:
        return connection.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _service_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (_SERVICE_SOFT_LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def test_thousands_of_idle_and_slow_connections_cost_the_run_nothing(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 2 * IDLE + 1000:
        pytest.skip(
            f"a flood of {IDLE} connections needs a finite hard limit of open files above {2 * IDLE + 1000}, not {hard}"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process holds the flood
    federation = tmp_path / "federation"
    roster = local_federation(federation, hospitals=3, address=f"tcp://127.0.0.1:{free_port()}")
    host, port = roster.server_address.removeprefix("tcp://").rsplit(":", 1)
    log = tmp_path / "server.log"
    with log.open("w") as handle:
        server = subprocess.Popen(
            launcher(
                "server",
                *confirmed(federation),
                "--out",
                tmp_path / "out",
                "--rounds",
                ROUNDS,
                "--round-timeout",
                "60",
                "--join-timeout",
                "120",
                *TRAINING,
            ),
            stdout=handle,
            stderr=handle,
            text=True,
            env=child_environment(),
            preexec_fn=_service_limit,
        )
    flood = None
    try:
        wait_until_listening((host, int(port)), server)
        flood = _Flood((host, int(port)))
        wait_for_text(log, "connections are open at once", server, timeout=120)
        flood.wait_for_every_drop(timeout=120)  # the run below goes on beside the connections opened again
        hospitals = [
            subprocess.Popen(
                launcher(
                    "hospital",
                    *confirmed(federation),
                    "--name",
                    name,
                    "--parts",
                    "3",
                    "--part",
                    index,
                    "--timeout",
                    "120",
                    "--epsilon-budget",
                    "100",
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=child_environment(),
                preexec_fn=_service_limit,
            )
            for index, name in enumerate(roster.hospitals, start=1)
        ]
        outputs = [hospital.communicate(timeout=300) for hospital in hospitals]
        assert server.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert all(hospital.returncode == 0 for hospital in hospitals), outputs
    finally:
        if flood is not None:
            flood.stop()
        server.kill()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    report = json.loads((tmp_path / "out" / "server_report.json").read_text())
    assert [r["status"] for r in report["rounds"]] == ["released"] * ROUNDS  # each sum checked exact by its hospitals
    limits = report["connection_limits"]
    assert limits["open_files"] == hard and limits["most_connections_open"] >= IDLE
    assert flood.dropped_idle >= IDLE and flood.dropped_slow == SLOW  # dropped for their handshake, then opened again


def test_a_checkpoint_the_disk_refuses_ends_the_run_with_its_report_before_any_round(tmp_path):
    """Every write of the checkpoint fails, as on a full disk: a round never starts before its number
    is on disk, so the run stops, in one line, and still writes its report."""
    federation = tmp_path / "federation"
    roster = local_federation(federation, hospitals=3, address=f"tcp://127.0.0.1:{free_port()}")
    out = tmp_path / "out"
    (out / "checkpoint.json.tmp").mkdir(parents=True)  # where the checkpoint is written first: nothing can be
    server = subprocess.Popen(
        launcher("server", *confirmed(federation), "--out", out, "--rounds", "2", "--round-timeout", "30", *TRAINING),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_environment(),
    )
    hospitals = [
        subprocess.Popen(
            launcher(
                "hospital", *confirmed(federation), "--name", name, "--parts", "3", "--part", index, "--timeout", "60"
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_environment(),
        )
        for index, name in enumerate(roster.hospitals, start=1)
    ]
    _, stderr = server.communicate(timeout=180)
    for hospital in hospitals:
        hospital.communicate(timeout=60)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert server.returncode == 2 and "Traceback" not in stderr
    assert (
        len(errors) == 1
        and "cannot write the checkpoint" in errors[0]
        and "no round starts before its number is on disk" in errors[0]
    )
    report = json.loads((out / "server_report.json").read_text())
    assert report["rounds"] == [] and report["finish_reason"].startswith("stopped: cannot write the checkpoint")
    assert any("cannot write the checkpoint" in failure for failure in report["write_failures"])
