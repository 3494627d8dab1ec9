"""A federation across hosts: every party in a network namespace of its own, with its own address.

Each party makes its keys in its own folder (``consilium-keygen``), hands its public file to the
provisioner, gets back the roster, checks its own entry and reads the fingerprint
(``consilium-roster fingerprint``), and starts with it: the commands of docs/how-to/deploy-across-hosts.md
section, in its order. The server, three hospitals and (for private voting) three talliers then
run Dopamine and kNN-DPFL to the end across a virtual switch, and every epsilon equals that of the
same commands run on localhost. The sites also run as the guide's services: started once each, they
take a Dopamine run and a kNN-DPFL run, and one site's policy declines the second. Where this machine
cannot make network namespaces (not root, or no ``ip``), the tests say so and skip.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import child_environment, free_port, launcher
from scripted import wait_for_text

pytestmark = pytest.mark.slow
HOSPITALS = ("hospital-1", "hospital-2", "hospital-3")
TALLIERS = ("tallier-1", "tallier-2", "tallier-3")
SUBNET = "10.77.0"
DOPAMINE = ("--rounds", "3", "--sample-rate", "0.1", "--noise-multiplier", "2.3", "--hidden", "8")
KNN = (
    "--method",
    "knn-dpfl",
    "--rounds",
    "1",
    "--queries-per-round",
    "20",
    "--feature-dimensions",
    "10",
    "--student-epochs",
    "5",
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Hosts:
    """Where each party runs: its own network namespace and address, or all on localhost."""

    namespaces: dict[str, str]  # party -> namespace ('' on localhost)
    addresses: dict[str, str]  # party -> host

    def prefix(self, party: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[party]] if self.namespaces[party] else []


@pytest.fixture(scope="module")
def hosts():
    """A switch (a bridge in a namespace of its own) and a namespace per party, wired to it by veth."""
    tag = secrets.token_hex(3)
    switch = f"cs{tag}-switch"
    parties = ("server", *HOSPITALS, *TALLIERS, "admin")
    made = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        pytest.skip(f"this machine cannot make network namespaces ({detail.strip()})")
    try:
        _ip("-n", switch, "link", "add", "switch", "type", "bridge")
        _ip("-n", switch, "link", "set", "switch", "up")
        for number, party in enumerate(parties, start=1):
            namespace = f"cs{tag}-{party}"
            _ip("netns", "add", namespace)
            made.append(namespace)
            _ip(
                "link",
                "add",
                "eth0",
                "netns",
                namespace,
                "type",
                "veth",
                "peer",
                "name",
                f"port{number}",
                "netns",
                switch,
            )
            _ip("-n", namespace, "address", "add", f"{SUBNET}.{number}/24", "dev", "eth0")
            for link in ("lo", "eth0"):
                _ip("-n", namespace, "link", "set", link, "up")
            _ip("-n", switch, "link", "set", f"port{number}", "master", "switch", "up")
        yield Hosts({p: f"cs{tag}-{p}" for p in parties}, {p: f"{SUBNET}.{n}" for n, p in enumerate(parties, start=1)})
    finally:
        for namespace in reversed(made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


def _run(command: list, *, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, timeout=timeout, env=child_environment()
    )
    assert not check or done.returncode == 0, done.stderr
    return done


def _federate(
    root: Path, hosts: Hosts, talliers: tuple[str, ...], admins: tuple[str, ...] = ()
) -> tuple[str, dict[str, Path]]:
    """The deployment how-to's set-up, machine by machine: keys, public files to the provisioner, the roster back,
    each party's own check. Returns the fingerprint every party read and each party's federation folder."""
    port = free_port()
    folders = {}
    public_files = root / "provisioner" / "public"
    public_files.mkdir(parents=True)
    for party in ("server", *HOSPITALS, *talliers, *admins):
        role = "server" if party == "server" else party.rsplit("-", 1)[0]
        folders[party] = root / party / "fed"
        mpc = ["--mpc-address", f"{hosts.addresses[party]}:{free_port()}"] if role == "tallier" else []
        _run(
            [
                *hosts.prefix(party),
                *launcher("keygen", "--role", role, "--name", party, "--out", folders[party] / party, *mpc),
            ]
        )
        shutil.copy(folders[party] / party / f"{party}.public.toml", public_files)  # what it sends the provisioner
    provisioned = _run(
        launcher(
            "provision",
            "--out",
            root / "provisioner" / "fed",
            "--address",
            f"tcp://{hosts.addresses['server']}:{port}",
            *sorted(public_files.iterdir()),
        )
    )
    assert "secret" not in " ".join(path.name for path in (root / "provisioner").rglob("*"))
    fingerprints = set()
    for party, folder in folders.items():
        shutil.copy(root / "provisioner" / "fed" / "roster.toml", folder)  # what the provisioner sends back
        checked = _run(
            [*hosts.prefix(party), *launcher("roster", "fingerprint", "--federation", folder, "--name", party)]
        )
        fingerprints.add(re.search(r"fingerprint: ([\d ]+)", checked.stdout).group(1).strip())
    assert fingerprints == {
        re.search(r"fingerprint: ([\d ]+)", provisioned.stdout).group(1).strip()
    }  # read aloud: all the same
    return fingerprints.pop(), folders


def _launch(
    hosts: Hosts, party: str, module: str, folder: Path, fingerprint: str, *args, log: Path
) -> subprocess.Popen:
    with log.open("w") as handle:
        return subprocess.Popen(
            [
                *hosts.prefix(party),
                *map(str, launcher(module, "--federation", folder, "--roster-fingerprint", fingerprint, *args)),
            ],
            stdout=handle,
            stderr=handle,
            text=True,
            env=child_environment(),
        )


def _dopamine(root: Path, hosts: Hosts) -> dict:
    fingerprint, folders = _federate(root, hosts, ())
    server = _launch(
        hosts,
        "server",
        "server",
        folders["server"],
        fingerprint,
        "--out",
        root / "run",
        "--data",
        "breast_cancer",
        "--expected-batch-size",
        "15",
        "--round-timeout",
        "60",
        *DOPAMINE,
        log=root / "server.log",
    )
    hospitals = [
        _launch(
            hosts,
            name,
            "hospital",
            folders[name],
            fingerprint,
            "--name",
            name,
            "--data",
            "breast_cancer",
            "--parts",
            "3",
            "--part",
            index,
            "--epsilon-budget",
            "10",
            "--timeout",
            "120",
            log=root / f"{name}.log",
        )
        for index, name in enumerate(HOSPITALS, start=1)
    ]
    for process in (server, *hospitals):
        assert process.wait(timeout=300) == 0, (root / "server.log").read_text()[-2000:]
    return json.loads((root / "run" / "server_report.json").read_text())


def _knn(root: Path, hosts: Hosts) -> dict:
    fingerprint, folders = _federate(root, hosts, TALLIERS)
    server = _launch(
        hosts,
        "server",
        "server",
        folders["server"],
        fingerprint,
        "--out",
        root / "run",
        "--data",
        "digits",
        "--round-timeout",
        "120",
        *KNN,
        log=root / "server.log",
    )
    talliers = [
        _launch(
            hosts,
            name,
            "tallier",
            folders[name],
            fingerprint,
            "--name",
            name,
            "--timeout",
            "300",
            log=root / f"{name}.log",
        )
        for name in TALLIERS
    ]
    hospitals = [
        _launch(
            hosts,
            name,
            "hospital",
            folders[name],
            fingerprint,
            "--name",
            name,
            "--method",
            "knn-dpfl",
            "--data",
            "digits",
            "--parts",
            "3",
            "--part",
            index,
            "--epsilon-budget",
            "20",
            "--timeout",
            "300",
            log=root / f"{name}.log",
        )
        for index, name in enumerate(HOSPITALS, start=1)
    ]
    for process in (server, *talliers, *hospitals):
        assert process.wait(timeout=400) == 0, (root / "server.log").read_text()[-2000:]
    return json.loads((root / "run" / "server_report.json").read_text())


def _localhost() -> Hosts:
    parties = ("server", *HOSPITALS, *TALLIERS)
    return Hosts({p: "" for p in parties}, {p: "127.0.0.1" for p in parties})


def test_dopamine_runs_across_hosts_with_the_epsilons_of_localhost(tmp_path, hosts):
    across = _dopamine(tmp_path / "hosts", hosts)
    local = _dopamine(tmp_path / "localhost", _localhost())
    assert [r["status"] for r in across["rounds"]] == ["released"] * 3  # every sum checked exact by its hospitals
    assert across["final"]["epsilon"] == local["final"]["epsilon"] and across["final"]["epsilon"]["server"] > 0
    assert [r["contributors"] for r in across["rounds"]] == [list(HOSPITALS)] * 3


def test_knn_dpfl_runs_across_hosts_with_the_epsilons_of_localhost(tmp_path, hosts):
    across = _knn(tmp_path / "hosts", hosts)
    local = _knn(tmp_path / "localhost", _localhost())
    assert [r["status"] for r in across["rounds"]] == ["labelled"]
    assert across["rounds"][0]["voters"] == list(HOSPITALS) and across["final"]["queries_labelled"] == 20
    assert across["final"]["epsilon"] == local["final"]["epsilon"]


def test_sites_run_as_services_across_hosts_take_two_runs_an_admin_submits_and_one_site_s_policy_refuses_one(
    tmp_path, hosts
):
    """The guide's "Sites that run unattended" and "Runs submitted centrally": each site starts its service
    once, in its own namespace and folder, and the coordinator once; the admin, in a namespace of its own,
    submits Dopamine and kNN-DPFL, which run one after the other. hospital-2's host goes down during the first
    and its service is started again, and the run goes on with it; hospital-3, whose policy allows Dopamine
    only, declines the second, as its own log and the admin's status say."""
    root = tmp_path / "services"
    fingerprint, folders = _federate(root, hosts, TALLIERS, admins=("admin",))
    sites, site_args = {}, {}
    for index, name in enumerate(HOSPITALS, start=1):
        policy = folders[name].parent / "policy.toml"  # written by that site's operator, in that site's folder
        methods = '["dopamine"]' if name == "hospital-3" else '["dopamine", "knn-dpfl"]'
        policy.write_text(
            f'methods = {methods}\nmax_rounds = 10\nview = "coalition"\ndelta = 1e-5\n'
            "max_epsilon_per_run = 100.0\nmax_epsilon_lifetime = 200.0\n"
        )
        site_args[name] = ("--name", name, "--data", "digits", "--parts", "3", "--part", index, "--policy", policy)
        sites[name] = _launch(
            hosts, name, "hospital", folders[name], fingerprint, *site_args[name], log=root / f"{name}.log"
        )
    for name in TALLIERS:
        sites[name] = _launch(
            hosts, name, "tallier", folders[name], fingerprint, "--name", name, "--serve", log=root / f"{name}.log"
        )
    log = root / "coordinator.log"
    coordinator = _launch(
        hosts, "server", "server", folders["server"], fingerprint, "--out", root / "runs", "--coordinate", log=log
    )
    sites["coordinator"] = coordinator

    def admin(*args) -> subprocess.CompletedProcess:  # typed at the admin's desk
        identity = ("--federation", folders["admin"], "--roster-fingerprint", fingerprint, "--name", "admin")
        return _run([*hosts.prefix("admin"), *launcher("admin", *identity, *args)])

    try:
        wait_for_text(log, "coordinator on", coordinator, timeout=60)
        runs = (
            (
                "--data",
                "digits",
                "--expected-batch-size",
                "5",
                "--rounds",
                "4",
                "--hidden",
                "8",
                "--round-timeout",
                "10",
            ),
            ("--data", "digits", "--quorum", "2", *KNN),
        )
        for number, args in enumerate(runs, start=1):
            assert admin("submit", "--", *args).stdout.startswith(f"run-{number} queued")
        wait_for_text(log, "run-1: round    1/4", coordinator, timeout=300)
        sites["hospital-2"].kill()  # its host goes down mid-run
        sites["hospital-2"].wait()
        wait_for_text(log, "hospital-2 leaves the run", coordinator, timeout=60)
        sites["hospital-2"] = _launch(  # and comes back: its operator starts the service again, as before
            hosts,
            "hospital-2",
            "hospital",
            folders["hospital-2"],
            fingerprint,
            *site_args["hospital-2"],
            log=root / "hospital-2-again.log",
        )
        wait_for_text(log, "run-2: finished", coordinator, timeout=300)
        reports = [json.loads((root / "runs" / f"run-{n}" / "server_report.json").read_text()) for n in (1, 2)]
        assert reports[0]["finish_reason"] == reports[1]["finish_reason"] == "completed all rounds"
        assert [join["hospital"] for join in reports[0]["joins"]] == ["hospital-2"]
        assert reports[0]["rounds"][-1]["contributors"] == list(HOSPITALS)  # back for the last round
        assert reports[1]["departures"] == {"hospital-3": "withdrew: declined by its site's policy"}
        assert reports[1]["rounds"][0]["voters"] == ["hospital-1", "hospital-2"]
        assert "this site takes part in dopamine runs, not 'knn-dpfl'" in (root / "hospital-3.log").read_text()
        assert "hospital-3 withdrew: declined by its site's policy" in admin("status").stdout
        status = _run(
            [
                *hosts.prefix("hospital-1"),
                *launcher("hospital", "--federation", folders["hospital-1"], "--name", "hospital-1", "--status"),
            ]
        )
        assert status.stdout.startswith("hospital-1: ") and "lifetime epsilon at delta" in status.stdout
        assert all(process.poll() is None for process in sites.values())  # nothing typed at a site since it started
    finally:
        for process in sites.values():
            process.send_signal(signal.SIGTERM)
        for name, process in sites.items():
            assert process.wait(timeout=150) == 0, (root / f"{name}.log").read_text()[-2000:]
