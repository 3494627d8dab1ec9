"""The server's side of one secure round, phase by phase: updates, endorsements, release.

1. ``collect_updates``: each active hospital's encrypted update is added, in place, to the round's
   sum as it arrives (``crypto.bfv.CiphertextSum``); a hospital that sends none in time is dropped.
2. ``collect_endorsements``: every contributor signs the aggregate it was sent (``crypto.endorsement``);
   a signature is checked as it arrives. Until all of them have, nobody may decrypt the sum.
3. ``await_release``: the first contributor sends the mean gradient it decrypted, every other one
   its digest; all must agree. If the first left before sending it, the next that stated a digest
   is asked for it (``MeanRequest``).

Each phase waits until its deadline or until nobody it waits for is still active (a hospital that
says Hello again leaves the round), and rejects anything else without changing state.
"""

from __future__ import annotations

import time

import numpy as np

from crypto.bfv import BfvError, CiphertextSum
from crypto.endorsement import EndorsementError, aggregate_statement, check_endorsements
from crypto.insecure_plaintext import InsecurePlaintextSum
from protocol.messages import (
    Aggregate,
    Endorsement,
    MeanRequest,
    MessageError,
    ProtocolError,
    Released,
    Update,
    Withdraw,
    float32_values,
    release_digest,
)
from protocol.participants import Participants
from protocol.roster import Roster

__all__ = ["collect_endorsements", "collect_updates", "await_release"]


def collect_updates(
    participants: Participants,
    total: CiphertextSum | InsecurePlaintextSum,
    round_number: int,
    timeout_s: float,
) -> tuple[list[str], dict[str, int], float]:
    """Add each active hospital's update for ``round_number`` to ``total``; returns the contributors (in
    arrival order), the bytes of each update, and the seconds spent adding."""
    parties = participants.parties
    contributors: list[str] = []
    update_bytes: dict[str, int] = {}
    aggregate_seconds = 0.0
    deadline = time.monotonic() + timeout_s
    waiting = lambda: not set(participants.active) <= set(contributors)  # noqa: E731
    while waiting():
        got = participants.next_message(deadline, waiting)
        if got is None:
            break
        sender, message = got
        if isinstance(message, Withdraw) and sender in participants.active:
            participants.drop(sender, f"withdrew: {message.reason}", notify=False)
        elif not isinstance(message, Update) or sender not in participants.active:
            parties.reject(sender, message, f"expected an update for round {round_number}")
        elif message.round != round_number:
            parties.reject(sender, message, f"update for round {message.round} during round {round_number}")
        elif sender in contributors:
            parties.reject(sender, message, f"second update for round {round_number}")
        else:
            started = time.perf_counter()
            try:
                total.add(message.chunks)
            except BfvError as error:
                parties.reject(sender, message, str(error))
                continue
            aggregate_seconds += time.perf_counter() - started
            contributors.append(sender)
            update_bytes[sender] = sum(len(chunk) for chunk in message.chunks)
    for name in set(participants.active) - set(contributors):
        participants.drop(name, f"sent no update for round {round_number} within {timeout_s:g} s")
    return contributors, update_bytes, aggregate_seconds


def collect_endorsements(
    participants: Participants,
    roster: Roster,
    aggregate: Aggregate,
    run: str,
    round_state: dict[str, float],
    timeout_s: float,
) -> dict[str, bytes]:
    """Each contributor's signature on the aggregate of run ``run`` (``crypto.endorsement``)."""
    parties, round_number = participants.parties, aggregate.round
    expected = set(aggregate.contributors)
    statement = aggregate_statement(
        run=run,
        round_number=round_number,
        contributors=aggregate.contributors,
        chunks=aggregate.chunks,
        round_state=round_state,
    )
    signatures: dict[str, bytes] = {}
    deadline = time.monotonic() + timeout_s
    complete = lambda: expected <= set(participants.active)  # noqa: E731 (one joining again will never endorse)
    while set(signatures) != expected:
        got = participants.next_message(deadline, complete)
        if not complete():
            return signatures  # nobody is late
        if got is None:
            break
        sender, message = got
        if not (isinstance(message, Endorsement) and message.round == round_number and sender in expected):
            parties.reject(sender, message, f"expected an endorsement of the aggregate of round {round_number}")
            continue
        if sender in signatures:
            parties.reject(sender, message, f"second endorsement of round {round_number}")
            continue
        try:
            check_endorsements(statement, {sender: message.signature}, {sender: roster.party(sender).identity.signing})
        except EndorsementError as error:
            # An honest contributor that signs another statement holds another aggregate or round state.
            shown = f" (the server's round state: {round_state})" if round_state else ""
            parties.reject(sender, message, f"{error}{shown}")
            continue
        signatures[sender] = message.signature
    for name in expected - set(signatures):
        participants.drop(name, f"did not endorse the aggregate of round {round_number} within {timeout_s:g} s")
    return signatures


def await_release(
    participants: Participants, round_number: int, contributors: list[str], dimension: int, timeout_s: float
) -> np.ndarray:
    """The mean gradient (``dimension`` float32) the contributors decrypted; all must state its digest."""
    parties = participants.parties
    releaser = contributors[0]
    digests: dict[str, bytes] = {}
    gradient: np.ndarray | None = None
    deadline = time.monotonic() + timeout_s
    waiting = lambda: not set(contributors) & set(participants.active) <= set(digests)  # noqa: E731
    while waiting():
        got = participants.next_message(deadline, waiting)
        if got is None:
            break
        sender, message = got
        if not (isinstance(message, Released) and message.round == round_number and sender in contributors):
            parties.reject(sender, message, f"expected the release of round {round_number}")
        elif sender in digests:
            parties.reject(sender, message, f"second release of round {round_number}")
        elif sender != releaser and message.mean_gradient:
            parties.reject(sender, message, f"only {releaser} sends the mean gradient")
        elif sender != releaser:
            digests[sender] = message.digest
        elif (gradient := _mean_gradient_in(participants, sender, message, dimension)) is not None:
            digests[sender] = message.digest
    for name in contributors:
        if gradient is not None:
            break
        if name in digests and name in participants.active:
            gradient = _requested_mean(participants, name, round_number, digests[name], dimension, deadline)
            releaser = name
    if gradient is None:
        raise ProtocolError(f"no contributor released the mean gradient of round {round_number}")
    expected = release_digest(round_number, gradient.tobytes())
    disagreeing = sorted(name for name, digest in digests.items() if digest != expected)
    if disagreeing:
        raise ProtocolError(
            f"round {round_number}: {', '.join(disagreeing)} decrypted a different sum than {releaser} (wrong key?)"
        )
    for name in set(contributors) - set(digests):
        participants.drop(name, f"did not confirm round {round_number}")
    return gradient


def _requested_mean(
    participants: Participants, name: str, round_number: int, digest: bytes, dimension: int, deadline: float
) -> np.ndarray | None:
    """The mean gradient ``name`` released, asked for because the first contributor left before sending it."""
    parties = participants.parties
    parties.send(name, MeanRequest(round=round_number))
    while (got := participants.next_message(deadline, lambda: name in participants.active)) is not None:
        sender, message = got
        if not (isinstance(message, Released) and sender == name and message.round == round_number):
            parties.reject(sender, message, f"expected {name}'s mean gradient of round {round_number}")
            continue
        gradient = _mean_gradient_in(participants, sender, message, dimension)
        if gradient is not None and message.digest == digest:
            return gradient
        if gradient is not None:
            parties.reject(sender, message, "a mean gradient other than the one it stated")
    return None


def _mean_gradient_in(participants: Participants, sender: str, message: Released, dimension: int) -> np.ndarray | None:
    """The mean gradient a release carries, or None (rejected) if it is not the model's size or not finite."""
    try:
        return float32_values(message.mean_gradient, dimension, "the mean gradient")
    except MessageError as error:
        participants.parties.reject(sender, message, str(error))
        return None
