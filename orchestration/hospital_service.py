"""A hospital as a long-lived service: run after run, each within its own operator's policy.

The design, its message sequence and the argument for each property are in
docs/explanation/site-services.md. In short, ``HospitalService.serve`` loops:

1. connect to the server and say Hello; wait up to ``idle_s`` for a Welcome of either kind (a
   reconnection says Hello again; a Finish before any Welcome means no run for this hospital now);
2. the Welcome's kind and method pick the role: ``protocol.run.hospital.Hospital`` for a training run,
   ``protocol.voting.voting_hospital.VotingHospital`` for a vote. A method outside the policy is
   declined at once; the role checks the rest of the policy before its ledger hears of the run
   (``protocol.run.site_policy``), and withdraws with the policy's reason where it declines;
3. after a run it took part in, connect again at once; after anything else, after a pause
   (``orchestration.site_service.serve_runs``).

``stop`` (set by the launcher's SIGTERM or SIGINT handler) ends every wait within a second; a run in
flight is withdrawn from (``protocol.wire.channel.ServerChannel.take_part``). The service's state is
in ``service_status.json`` in its state folder, written whole at each change; ``site_status`` reads
it with the ledger, and writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from consilium.errors import ConsiliumError
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.run.config import SECURE_AGGREGATION, announced_method
from consilium.protocol.run.hospital import Hospital
from consilium.training.methods.step_timing import DEFAULT_SEND_OFFSET_S
from consilium.protocol.run.rules import is_run_id
from consilium.protocol.run.site_policy import DECLINED, POLICY_REFUSAL, Declined, Misfit, Offer, SitePolicy
from consilium.protocol.voting.voting_config import welcomed_run
from consilium.protocol.voting.voting_hospital import VotingHospital
from consilium.protocol.wire.channel import STOPPED, ServerChannel, Stopped
from consilium.protocol.wire.messages import (
    TO_HOSPITAL,
    TO_VOTING_HOSPITAL,
    Finish,
    Hello,
    ProtocolError,
    VotingWelcome,
    Welcome,
    Withdraw,
)
from consilium.orchestration.site_service import serve_runs
from consilium.protocol.wire.transport import ClientTransport, Reconnected, TransportError
from consilium.training.data.datasets import Split
from consilium.training.privacy.durable import replace_file
from consilium.training.privacy.ledger import LEDGER_FILE, LedgerError, PrivacyLedger

__all__ = ["MAX_MISFITS", "STATUS_FILE", "HospitalService", "site_status"]

log = logging.getLogger("consilium.service")

STATUS_FILE = "service_status.json"
_SHOWN_CHARACTERS = 300  # of a status value, in --status
_LEDGER_READS = 5  # tries at reading a ledger the service may be writing
MAX_MISFITS = 3  # runs the data cannot take before the service stops and its operator must look
_DECLINED_KEPT = 10_000  # run ids remembered as declined: a bound on what a server can make the service keep


@dataclass
class HospitalService:
    """One hospital's service: its identity, data and policy, kept across runs."""

    roster: Roster
    credentials: Credentials
    data: Split
    policy: SitePolicy
    state_dir: Path
    stop: threading.Event = field(default_factory=threading.Event)
    idle_s: float = 600.0  # how long one connection waits for a Welcome before it is made again
    send_offset_s: float = DEFAULT_SEND_OFFSET_S
    own_model: str | None = None
    min_quorum: int = 2
    allow_histogram: bool = False
    connect: Callable[[], ClientTransport] | None = None  # a test's transport; the roster's server otherwise
    _declined: set[str] = field(default_factory=set, init=False)  # run ids this service declined
    _misfits: int = field(default=0, init=False)  # runs this hospital's data could not take

    def serve(self) -> None:
        """Take run after run until ``stop`` is set."""
        name = self.credentials.name
        log.warning("%s serves: %s", name, self._policy_line())
        serve_runs(self._one_run, self.stop, lambda pause: self._status("paused", pause_s=pause))
        self._status("stopped")
        log.warning("%s: %s", name, STOPPED)

    def _one_run(self) -> bool:
        """Wait for one run, and take part in it if the policy allows; True where it took part to its end."""
        transport = self.connect() if self.connect else None
        channel = ServerChannel.connect(
            self.roster,
            self.credentials,
            accept=TO_HOSPITAL | TO_VOTING_HOSPITAL,
            timeout_s=self.idle_s,
            log=log,
            transport=transport,
            stop=self.stop,
        )
        self._status("waiting")
        try:
            welcome = self._await_welcome(channel)
            if welcome is None:
                return False
            role = self._role(channel, welcome)
            if role is None:
                return False
        except BaseException:
            channel.close()
            raise
        return self._take_part(role, welcome)

    def _await_welcome(self, channel: ServerChannel) -> Welcome | VotingWelcome | None:
        channel.send(Hello())
        while True:
            try:
                message = channel.expect(Welcome, VotingWelcome, Finish)
            except Reconnected:  # a server started again (the next run's, say): it has not heard this Hello
                channel.send(Hello())
                continue
            except (Stopped, ProtocolError, TransportError) as error:
                log.info("%s: no run now: %s", self.credentials.name, error)
                channel.close()
                return None
            if isinstance(message, Finish):
                log.info("%s: the server has no run for it now: %s", self.credentials.name, message.reason)
                channel.close()
                return None
            return message

    def _role(self, channel: ServerChannel, welcome: Welcome | VotingWelcome) -> Hospital | VotingHospital | None:
        """The role that takes the run ``welcome`` offers, or None where it declines at once: a method outside the
        policy, or a run it declined before (so that offering it again costs the site nothing)."""
        run_id = welcome.config.get("run_id") if is_run_id(welcome.config.get("run_id")) else None
        try:
            method = (
                announced_method(welcome) if isinstance(welcome, Welcome) else welcomed_run(welcome)[0].voting.method
            )
        except ProtocolError as error:
            method, refusal = None, str(error)
        else:
            refusal = self.policy.method_refusal(str(method))
        if not refusal and run_id is None:
            refusal = "the Welcome names no run id"
        if not refusal and run_id in self._declined:
            refusal = f"{POLICY_REFUSAL}run {run_id} was declined before"
        if refusal:
            self._decline(channel, run_id, refusal)
            return None
        common = dict(
            roster=self.roster,
            credentials=self.credentials,
            data=self.data,
            budget=self.policy.budget,
            state_dir=self.state_dir,
            timeout_s=self.idle_s,
            own_model=self.own_model,
            transport=channel.transport,
            offer=Offer(welcome=welcome, policy=self.policy, stop=self.stop),
        )
        if isinstance(welcome, Welcome):
            return Hospital(**common, send_offset_s=self.send_offset_s, method=method, aggregation=SECURE_AGGREGATION)
        return VotingHospital(**common, min_quorum=self.min_quorum, allow_histogram=self.allow_histogram)

    def _decline(self, channel: ServerChannel, run_id: object, refusal: str) -> None:
        self._declined_run(run_id, refusal)
        with contextlib.suppress(TransportError):  # declining is what matters, not whether the server hears it
            channel.send(Withdraw(round=0, reason=DECLINED))
        channel.close()

    def _declined_run(self, run_id: str | None, refusal: str) -> None:
        """Say why in the site's log (the server hears only ``DECLINED``), and decline that run at once from now on."""
        log.warning("%s declines the run it was welcomed to: %s", self.credentials.name, refusal)
        if run_id is not None and len(self._declined) < _DECLINED_KEPT:
            self._declined.add(run_id)

    def _take_part(self, role: Hospital | VotingHospital, welcome: Welcome | VotingWelcome) -> bool:
        name, kind = self.credentials.name, "training" if isinstance(welcome, Welcome) else "voting"
        self._status("in a run", kind=kind)
        try:
            result = role.run()
        except LedgerError:  # its only record of what it spent: the operator must look, not the service go on
            raise
        except Declined as error:  # the role withdrew
            self._declined_run(str(welcome.config["run_id"]), str(error))  # (checked in _role)
            return False
        except Misfit as error:  # its data cannot take the run: a server offering such runs over and over probes it
            self._misfits += 1
            log.warning("%s cannot take the run: %s", name, error)
            if self._misfits >= MAX_MISFITS:
                raise ProtocolError(
                    f"{name} was offered {self._misfits} runs its data cannot take; the service stops, since a server "
                    "can learn of the data from which runs it takes: its operator should look"
                ) from None
            return False
        except ConsiliumError as error:  # the run, not the service, ends: one line, then the next run
            log.warning("%s: the run ended: %s", name, error)
            self._status("waiting", last_run={"kind": kind, "finish_reason": str(error), "rounds": 0})
            return False
        rounds = len(result["rounds"])
        log.warning("%s: a %s run ended after %d rounds: %s", name, kind, rounds, result["finish_reason"])
        self._status("waiting", last_run={"kind": kind, "finish_reason": result["finish_reason"], "rounds": rounds})
        return result["finish_reason"] != STOPPED

    def _status(self, state: str, **details) -> None:
        path = self.state_dir / STATUS_FILE
        previous = _read_status(path)
        status = {"state": state, "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **details}
        if "last_run" not in status and "last_run" in previous:
            status["last_run"] = previous["last_run"]
        replace_file(path, json.dumps(status).encode())

    def _policy_line(self) -> str:
        policy = self.policy
        return (
            f"{', '.join(policy.methods)}; at most {policy.max_rounds} rounds and epsilon {policy.max_epsilon_per_run:g} "
            f"a run, {policy.max_epsilon_lifetime:g} in all, against the {policy.view.replace('_', ' ')} at delta "
            f"{policy.delta:g}"
        )


def site_status(state_dir: Path, credentials: Credentials, policy: SitePolicy | None) -> str:
    """What a hospital's operator sees of its site: the service's state, the ledger's lifetime epsilon by
    view, and what remains under the policy. Reads local files only, and writes nothing."""
    status = _read_status(state_dir / STATUS_FILE)
    lines = [f"{credentials.name}: " + (_state_line(status) if status else "no service has run here")]
    if isinstance(last := status.get("last_run"), dict):
        lines.append(
            f"last run: {_shown(last.get('kind'))}, {_shown(last.get('rounds'))} rounds, ended: "
            f"{_shown(last.get('finish_reason'))}"
        )
    ledger = _read_ledger(state_dir / LEDGER_FILE, credentials)
    lines.append(f"lifetime {ledger.spent(policy.delta if policy else 1e-5)}")
    if policy is not None:
        worst, view = ledger.worst_epsilon(policy.delta, up_to=policy.view)
        lines.append(
            f"under its policy: {worst:.3f} of {policy.max_epsilon_lifetime:g} spent against the "
            f"{view.replace('_', ' ')}, {max(0.0, policy.max_epsilon_lifetime - worst):.3f} left; at most "
            f"{policy.max_epsilon_per_run:g} a run"
        )
    return "\n".join(lines)


def _read_ledger(path: Path, credentials: Credentials) -> PrivacyLedger:
    """The ledger as the service last wrote it whole: a read between its line and its head file (a service
    writing as it is read) is tried again, a few times, before it counts as damage."""
    for _ in range(_LEDGER_READS - 1):
        try:
            return PrivacyLedger(path, key=credentials.ledger_key)
        except LedgerError:
            time.sleep(0.1)
    return PrivacyLedger(path, key=credentials.ledger_key)


def _state_line(status: dict) -> str:
    state, since = status.get("state"), _shown(status.get("since"))
    if state == "in a run":
        return f"in a {_shown(status.get('kind'))} run since {since}"
    if state == "paused":
        return f"paused {_shown(status.get('pause_s'))} s before connecting again, since {since}"
    return f"{_shown(state)} since {since}"


def _shown(value: object) -> str:
    """A value of the status file, as one printable line: a run's end may be in the server's words."""
    text = "".join(character if character.isprintable() else "?" for character in str(value))
    return text if len(text) <= _SHOWN_CHARACTERS else text[: _SHOWN_CHARACTERS - 3] + "..."


def _read_status(path: Path) -> dict:
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}
