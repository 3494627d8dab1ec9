"""The server's side of one secure round, phase by phase (``docs/explanation/secure-round.md``).

1. ``collect_updates``: each active hospital's upload is added to the round's sum as it arrives
   (``protocol.secure_round.sum_round.SumRound``), with the shares it sealed to the others and its box key
   for the next round; a hospital that sends none in time is dropped. One that refuses the round
   (the box keys it was sent did not check) is left out of it without a wait; with no box key for
   the next round, it leaves the run then.
2. ``collect_from_members``: once per step after that, one message of a kind from every member of
   the round (an endorsement, a proof, a release, a confirmation), each checked as it arrives
   where a check is given. A member that refuses the step (``Refused``) or sends nothing in time
   ends the round.

Each phase waits until its deadline or until nobody it waits for is still active (a hospital that
says Hello again leaves the round), and rejects anything else without changing state.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from consilium.crypto.bfv import BfvError
from consilium.crypto.insecure_plaintext import InsecurePlaintextSum
from consilium.protocol.wire.messages import Message, Refused, Update
from consilium.protocol.secure_round.sum_round import SumRound
from consilium.protocol.run.participants import Participants

__all__ = ["collect_from_members", "collect_updates"]

log = logging.getLogger("consilium.server")


def collect_updates(
    participants: Participants,
    total: SumRound | InsecurePlaintextSum,
    round_number: int,
    timeout_s: float,
    *,
    box_keys: dict[str, bytes],
    identities: dict,
) -> tuple[dict[str, Update], float]:
    """Add each active hospital's update for ``round_number`` to ``total``; returns the updates taken
    (in arrival order) and the seconds spent adding. An update must carry a sealed share for each
    hospital whose box key the round started with (``box_keys``) and no other, each signed by its
    dealer (``SumRound.box_refusal``; the plaintext benchmark seals nothing)."""
    parties = participants.parties
    updates: dict[str, Update] = {}
    refused: set[str] = set()
    aggregate_seconds = 0.0
    deadline = time.monotonic() + timeout_s
    waiting = lambda: not set(participants.active) <= set(updates) | refused  # noqa: E731
    while waiting():
        got = participants.next_message(deadline, waiting)
        if got is None:
            break
        sender, message = got
        if (
            isinstance(message, Refused)
            and message.round == round_number
            and sender in participants.active
            and sender not in updates
            and sender not in refused
        ):
            refused.add(sender)
            log.warning("%s refuses round %d before its upload: %s", sender, round_number, message.reason)
        elif reason := _update_refusal(
            sender, message, round_number, participants.active, updates, refused
        ) or _boxes_refusal(total, sender, message, box_keys, identities):
            parties.reject(sender, message, reason)
        else:
            started = time.perf_counter()
            try:
                if isinstance(total, SumRound):
                    total.add(sender, message.chunks)
                else:
                    total.add(message.chunks)
            except BfvError as error:
                parties.reject(sender, message, str(error))
                continue
            aggregate_seconds += time.perf_counter() - started
            updates[sender] = message
    for name in set(participants.active) - set(updates) - refused:
        participants.drop(name, f"sent no update for round {round_number} within {timeout_s:g} s")
    return updates, aggregate_seconds


def _update_refusal(
    sender: str,
    message,
    round_number: int,
    active,
    updates: dict[str, Update],
    refused: set[str],
) -> str:
    """Why ``message`` is not ``sender``'s update for the round, or "" where it is."""
    if not isinstance(message, Update) or sender not in active:
        return f"expected an update for round {round_number}"
    if message.round != round_number:
        return f"update for round {message.round} during round {round_number}"
    if sender in updates:
        return f"second update for round {round_number}"
    if sender in refused:
        return f"an update after refusing round {round_number}"
    return ""


def _boxes_refusal(total, sender: str, message: Update, box_keys: dict[str, bytes], identities: dict) -> str:
    """Why ``sender``'s sealed shares are refused, or "": an update carries one for each hospital whose box key
    the round started with, and for no other, each signed by its dealer (the plaintext benchmark seals none)."""
    if set(message.boxes) != set(box_keys):
        return f"shares sealed to {sorted(message.boxes)}, not to {sorted(box_keys)}"
    if isinstance(total, SumRound):
        return total.box_refusal(sender, message.chunks, message.boxes, box_keys, identities)
    return ""


def collect_from_members(
    participants: Participants,
    members: list[str],
    kind: type[Message],
    round_number: int,
    timeout_s: float,
    check: Callable[[str, Message], str] = lambda sender, message: "",
) -> tuple[dict[str, Message], dict[str, Refused]]:
    """One ``kind`` message of round ``round_number`` from each member, each passing ``check`` (which
    returns why not, or ""); and the refusals of the step. The wait goes on for the members still
    active until each answered or refused, even after one left (withdrew, or said Hello again):
    the others' refusals may name it, and are weighed. A member that sends neither in time is
    dropped, also where another left (or two could take turns, one leaving, one silent); one that
    refuses is not (its refusal names whom it caught)."""
    parties = participants.parties
    answers: dict[str, Message] = {}
    refusals: dict[str, Refused] = {}
    deadline = time.monotonic() + timeout_s
    expected = set(members)

    def waiting() -> bool:
        return not (expected & set(participants.active)) <= set(answers) | set(refusals)

    while waiting():
        got = participants.next_message(deadline, waiting)
        if got is None:
            break
        sender, message = got
        if sender not in expected or sender in answers or sender in refusals:
            parties.reject(sender, message, f"expected nothing more from {sender} in round {round_number}")
        elif getattr(message, "round", None) != round_number:
            parties.reject(sender, message, f"expected its {kind.TYPE} for round {round_number}")
        elif isinstance(message, Refused):
            refusals[sender] = message
        elif not isinstance(message, kind):
            parties.reject(sender, message, f"expected its {kind.TYPE} for round {round_number}")
        elif reason := check(sender, message):
            parties.reject(sender, message, reason)
        else:
            answers[sender] = message
    for name in (expected & set(participants.active)) - set(answers) - set(refusals):
        participants.drop(name, f"sent no {kind.TYPE} for round {round_number} within {timeout_s:g} s")
    return answers, refusals
