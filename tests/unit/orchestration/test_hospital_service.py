"""Hospital services (``orchestration.hospital_service``) driven in one process over transports in memory:
run after run with no restart, each checked against the site's policy before its ledger hears of it.
The roles, the rounds (real SEAL) and the policy are the real ones; only ZeroMQ is stood in for
(``tests/support/memory_transport.py``)."""

import dataclasses
import json
import logging
import threading
import time

import pytest

from consilium.orchestration.hospital_service import MAX_MISFITS, STATUS_FILE, HospitalService, site_status
from consilium.protocol.identity.party_keys import SERVER, Credentials
from consilium.protocol.run.participants import Timeouts
from consilium.protocol.run.server import Server
from consilium.protocol.run.site_policy import DECLINED, MISFIT, SitePolicy
from consilium.training.privacy.ledger import LEDGER_FILE, PrivacyLedger
from memory_transport import MemoryNetwork
from scripted_peers import small_run_config

POLICY = SitePolicy(
    methods=("dopamine",),
    max_rounds=10,
    view="coalition",
    delta=1e-5,
    max_epsilon_per_run=50.0,
    max_epsilon_lifetime=100.0,
)


def _server(roster, data, tmp_path, network, config, out):
    return Server(
        config=config,
        roster=roster,
        credentials=Credentials.load(tmp_path / "federation" / SERVER),
        validation=data.validation,
        out_dir=tmp_path / out,
        timeouts=Timeouts(join_s=30, key_s=30, round_s=30),
        transport=network.server(),
    )


def _services(roster, shares, tmp_path, network, policies, **settings):
    services = {
        name: HospitalService(
            roster=roster,
            credentials=Credentials.load(tmp_path / "federation" / name),
            data=shares[name],
            policy=policies.get(name, POLICY),
            state_dir=tmp_path / "federation" / name,
            idle_s=120.0,
            send_offset_s=0.01,  # small, and not 0: each hospital times its step
            connect=lambda n=name: network.client(n),
            **settings,
        )
        for name in roster.hospitals
    }
    threads = [threading.Thread(target=_serve, args=(service,), daemon=True) for service in services.values()]
    for thread in threads:
        thread.start()
    return services, threads


def _serve(service):
    try:
        service.serve()
    except Exception as error:  # kept for the test to read, as the launcher would print it
        service.ended_with = error


def _wait_for_state(path, state, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and json.loads(path.read_text())["state"] == state:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never said {state}")


def _ledger(tmp_path, name):
    folder = tmp_path / "federation" / name
    return PrivacyLedger(folder / LEDGER_FILE, key=Credentials.load(folder).ledger_key)


def test_services_take_run_after_run_and_a_run_outside_a_site_s_policy_is_declined_before_its_ledger_hears_of_it(
    threaded_federation, caplog
):
    roster, data, shares, tmp_path = threaded_federation
    network = MemoryNetwork()
    strict = dataclasses.replace(POLICY, max_rounds=1)  # hospital-3 takes no run of more than one round
    services, threads = _services(roster, shares, tmp_path, network, {"hospital-3": strict})
    try:
        first = small_run_config(roster, quorum=3, rounds=1)
        with caplog.at_level(logging.INFO, logger="consilium.hospital"):
            report = _server(roster, data, tmp_path, network, first, "run-1").run()
        assert report["finish_reason"] == "completed all rounds"
        assert "hospital-1: a step of " in caplog.text  # each hospital timed its step before round 1
        second = small_run_config(roster, quorum=3, rounds=2)
        with caplog.at_level(logging.WARNING, logger="consilium.service"):
            report = _server(roster, data, tmp_path, network, second, "run-2").run()
        assert report["finish_reason"] == "only 2 hospitals remain, fewer than the quorum of 3"
        assert report["departures"] == {"hospital-3": f"withdrew: {DECLINED}"}  # the policy's caps stay the site's
        assert "hospital-3 declines the run it was welcomed to: policy: 2 rounds, more than the 1" in caplog.text
        third = small_run_config(roster, quorum=3, rounds=1)  # and every service goes on to the next run
        assert _server(roster, data, tmp_path, network, third, "run-3").run()["finish_reason"] == "completed all rounds"
        for name in roster.hospitals:  # each is waiting for the next run, for up to its idle_s
            _wait_for_state(tmp_path / "federation" / name / STATUS_FILE, "waiting")
    finally:
        for service in services.values():
            service.stop.set()
        for thread in threads:
            thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads)  # stopped within a poll of the stop flag
    assert _ledger(tmp_path, "hospital-1").steps == _ledger(tmp_path, "hospital-3").steps == 2
    assert second.run_id not in _ledger(tmp_path, "hospital-3")._runs  # declined before its ledger heard of it
    status = site_status(tmp_path / "federation" / "hospital-3", services["hospital-3"].credentials, strict)
    assert status.splitlines()[0].startswith("hospital-3: stopped since")
    assert (
        "under its policy:" in status
        and f"{_ledger(tmp_path, 'hospital-3').epsilon(1e-5, view='coalition'):.3f}" in status
    )
    assert (tmp_path / "federation" / "hospital-3" / STATUS_FILE).exists()


def test_a_service_offered_runs_its_data_cannot_take_stops_after_a_few_and_the_server_hears_no_why(
    threaded_federation,
):
    """Which runs a hospital's data can take says something of the data (its records, labels, shapes): a server
    offering one misfit after another could search it out, so the service stops and its operator looks."""
    roster, data, shares, tmp_path = threaded_federation
    network = MemoryNetwork()
    services, threads = _services(roster, shares, tmp_path, network, {}, own_model="ours.py:build")  # runs train mlp
    try:
        for number in range(1, MAX_MISFITS + 1):
            config = small_run_config(roster, quorum=3, rounds=1)
            report = _server(roster, data, tmp_path, network, config, f"run-{number}").run()
            assert report["departures"] == dict.fromkeys(roster.hospitals, f"withdrew: {MISFIT}")
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads)
        for service in services.values():
            assert f"was offered {MAX_MISFITS} runs its data cannot take" in str(service.ended_with)
        assert not (tmp_path / "federation" / "hospital-1" / LEDGER_FILE).exists()  # no run left a trace
    finally:
        for service in services.values():
            service.stop.set()


def test_a_policy_file_is_read_whole_or_refused_in_one_line(tmp_path):
    path = tmp_path / "policy.toml"
    good = (
        'methods = ["dopamine", "knn-dpfl"]\nmax_rounds = 100\nview = "coalition"\ndelta = 1e-5\n'
        "max_epsilon_per_run = 4.0\nmax_epsilon_lifetime = 10.0\n"
    )
    path.write_text(good)
    assert SitePolicy.load(path, ("dopamine", "knn-dpfl")).methods == ("dopamine", "knn-dpfl")
    for text, reason in (
        (good + "max_epsilon = 3\n", "unknown key max_epsilon"),
        (good.replace("max_rounds = 100\n", ""), "missing max_rounds"),
        (good.replace('"knn-dpfl"', '"knn"'), "unknown method knn"),
        (good.replace("= 4.0", "= 40.0"), "max_epsilon_per_run is over max_epsilon_lifetime"),
        (good.replace('"coalition"', '"everyone"'), "view must be one of"),
        (good.replace("100", "0"), "max_rounds must be a positive whole number"),
        ("methods = [", "policy file"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=reason):
            SitePolicy.load(path, ("dopamine", "knn-dpfl"))
