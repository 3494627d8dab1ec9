"""The talliers' MPC: agree on the voters, then a secure argmax over their summed shares.

Tallier ``j`` holds one share of each voting hospital's noisy vote vector, modulo the prime ``p``
of MPyC's ``SecInt(l)`` (``crypto.mpc_field``). A round, on one screen:

1. **Voters.** Each tallier inputs the round number and a 0/1 mark for each hospital of the run:
   whether it holds a valid share from it. All inputs are opened (who sent what is no secret: the
   server relayed it), every tallier checks that all name the same round, and the voters are the
   hospitals every tallier holds a share from. Fewer than the quorum: no label (``VoterError``).
2. **Inputs.** Each tallier sums its shares of exactly those voters, ``s_j``, and inputs it (MPyC
   Shamir-shares it among all talliers: nobody learns it).
3. **Totals.** The secret-shared noisy totals ``T = s_1 + ... + s_J`` are a sum of the inputs,
   free of communication.
4. **Labels.** ``np_argmax`` along the classes finds each query's label and top total with
   ``C - 1`` secure comparisons; ties go to the lowest class index, as in NumPy (``_np_argmax``
   keeps the first maximum). With a label threshold ``T > 0``, one more comparison per query
   withholds the label where the top total is below ``T``: the opened value is
   ``C + [top >= T] (label - C)``, the label or ``C`` for "withheld"; the comparison's bit is never
   opened on its own. Only these values are opened, to every tallier.

``reveal="histogram"`` opens ``T`` itself instead (a secure sum): cheaper, and it shows the noisy
totals to the talliers and the server; the talliers draw the labels from them by the same rule
(``_released_labels``). It is for users who accept that, never a fallback.

MPyC is honest-majority: ``t = floor((J - 1) / 2)`` corrupt talliers learn nothing, and every
tallier must stay online; a silent peer ends the round at its deadline (``MpcError``). With
``J = 2``, ``t = 0`` and MPyC's shares are the inputs themselves: each tallier would see the other's
sum, and so the histogram. Three talliers at least, then.

The talliers connect to each other with ``tallier.mpc_network``, not MPyC's own start-up: each
listens on its own address, presents its own certificate and lets in only the pinned certificate
of the party a peer claims to be; no peer's bytes are ever unpickled into objects, and a peer that
sends what no honest tallier sends aborts the round (``MpcError`` naming it).

After an ``MpcError`` MPyC's state in this process is unusable (its listening socket and pending
tasks stay behind), so every later round in the process refuses at once: restart the tallier.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from crypto.mpc_field import MpcField, mpyc_runtime
from crypto.secret_sharing import add
from protocol.party_keys import Credentials
from protocol.roster import Roster
from tallier.mpc_network import MpcNetwork, MpcParty, MpcPeerError, harden_mpyc
from training.vote_privacy import REVEAL_MODES

__all__ = ["MpcError", "MpcParty", "MpcResult", "VoterError", "mpc_party", "run_round"]

_failed: list[str] = []  # set once an MPC in this process failed
_MESSAGE_SLACK_BYTES = 1 << 16


class MpcError(RuntimeError):
    """The MPC could not finish: a tallier left, or did not answer before the deadline."""


class VoterError(RuntimeError):
    """The talliers do not agree on the round, or hold shares from fewer voters than the quorum."""


def mpc_party(roster: Roster, credentials: Credentials) -> MpcParty:
    """This tallier's place in the MPC, as the roster lists the talliers and pins their certificates."""
    names = tuple(roster.talliers)
    return MpcParty(
        index=names.index(credentials.name),
        names=names,
        addresses=tuple(roster.party(name).mpc_address for name in names),
        certificates=tuple(roster.party(name).mpc_certificate for name in names),
        certificate_file=credentials.mpc_certificate_file,
        key_file=credentials.mpc_key_file,
    )


@dataclass(frozen=True)
class MpcResult:
    voters: tuple[str, ...]  # whose votes the labels count, in the run's order
    labels: np.ndarray  # (Q,) int64: a class, or C where the label is withheld
    totals: np.ndarray | None  # (Q, C) int64, only when revealed
    bytes_sent: int  # by this tallier, to all others


def run_round(
    party: MpcParty,
    round_number: int,
    shares: dict[str, np.ndarray],
    *,
    hospitals: tuple[str, ...],
    quorum: int,
    queries: int,
    classes: int,
    field: MpcField,
    reveal: str,
    label_threshold: int,
    timeout_s: float,
) -> MpcResult:
    """One round of the protocol above for this tallier, holding ``shares`` (valid ones, by hospital).

    ``MpcError`` if it does not finish in time; ``VoterError`` if the talliers disagree on the
    round or share fewer voters than ``quorum``."""
    if reveal not in REVEAL_MODES:
        raise ValueError(f"unknown reveal mode {reveal!r}; choose from {', '.join(REVEAL_MODES)}")
    if not set(shares) <= set(hospitals):
        raise ValueError(f"shares from {sorted(set(shares) - set(hospitals))}, not hospitals of the run")
    if any(len(vector) != queries * classes for vector in shares.values()):
        raise ValueError(f"every share must hold {queries * classes} values")
    harden_mpyc(field.modulus)
    # No --ssl: MPyC reads it only in Runtime.start, which MpcNetwork.connect replaces with pinned TLS.
    runtime = mpyc_runtime([f"-P{host}:{port}" for host, port in party.addresses] + ["-I", str(party.index)])
    secint = runtime.SecInt(field.bit_length)
    if secint.field.modulus != field.modulus:  # the hospitals shared over another field: the sums would be noise
        raise ValueError(
            f"the hospitals shared modulo {field.modulus}, but {field.bit_length}-bit MPC computes modulo {secint.field.modulus}"
        )
    if _failed:
        raise MpcError(f"an earlier MPC in this process failed ({_failed[0]}); restart the tallier")

    def public_input(values: list[int]) -> list:
        return runtime.input(secint.array(secint.field.array(np.array(values, dtype=object))))

    network = MpcNetwork(
        runtime,
        party,
        max_message_bytes=_message_limit(queries, classes, len(hospitals), field, secint.field.byte_length),
    )

    async def protocol() -> MpcResult:
        await network.connect(timeout_s)
        marks = [round_number] + [int(name in shares) for name in hospitals]
        opened = [await runtime.output(vector) for vector in public_input(marks)]
        if {int(vector[0]) for vector in opened} != {round_number}:
            await runtime.shutdown()
            raise VoterError(f"the talliers are not all in round {round_number}: {sorted({int(v[0]) for v in opened})}")
        voters = tuple(name for i, name in enumerate(hospitals, start=1) if all(int(v[i]) for v in opened))
        if len(voters) < quorum:
            await runtime.shutdown()
            raise VoterError(
                f"the talliers share valid votes from {len(voters)} hospitals, fewer than the quorum of {quorum}"
            )
        local_sum = [0] * (queries * classes)
        for name in voters:
            local_sum = add(local_sum, shares[name], field.modulus)
        inputs = public_input(local_sum)
        totals = runtime.np_reshape(sum(inputs[1:], inputs[0]), (queries, classes))
        if reveal == "histogram":
            revealed = np.array(await runtime.output(totals), dtype=np.int64)
            labels = _released_labels(revealed, label_threshold)
        else:
            winners, tops = runtime.np_argmax(totals, axis=1, arg_only=False)
            if label_threshold:  # MPyC 0.11 returns the tops as a (Q, 1) array
                winners = classes + (runtime.np_reshape(tops, (queries,)) >= label_threshold) * (winners - classes)
            labels, revealed = np.array(await runtime.output(winners), dtype=np.int64), None
        sent = sum(peer.protocol.nbytes_sent for peer in runtime.parties if peer.pid != runtime.pid)
        await runtime.shutdown()
        return MpcResult(voters=voters, labels=labels, totals=revealed, bytes_sent=sent)

    try:
        return runtime.run(asyncio.wait_for(protocol(), timeout_s))
    except VoterError:
        raise
    except BaseException as error:
        failure = _failure(error, network.aborts, timeout_s)
        _failed.append(str(failure))
        if failure is error:
            raise
        raise failure from None


def _failure(error: BaseException, aborts: list[str], timeout_s: float) -> BaseException:
    """The ``MpcError`` that says why a round failed (the first abort a peer caused, if any), or ``error`` itself."""
    if aborts or isinstance(error, MpcPeerError):
        return MpcError(f"the talliers' MPC was aborted: {aborts[0] if aborts else error}")
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return MpcError(f"the talliers' MPC did not finish within {timeout_s:g} s (a tallier left or is unreachable)")
    if isinstance(error, (OSError, ConnectionError)):
        return MpcError(f"the talliers' MPC failed: {error}")
    return error


def _message_limit(queries: int, classes: int, hospitals: int, field: MpcField, element_bytes: int) -> int:
    """The most bytes a peer may send in one MPC message of this round, about twice an honest one's.

    The largest honest message (the comparisons' random bits) holds ``(l + 1) / 2`` field elements
    per query and class: measured at l = 10, 23 and 31 bits (``Q C`` = 200 to 25,000, J = 3 and 5)."""
    return max(queries * classes, hospitals + 1) * (field.bit_length + 2) * element_bytes + _MESSAGE_SLACK_BYTES


def _released_labels(totals: np.ndarray, label_threshold: int) -> np.ndarray:
    """What the MPC opens, computed in the clear from ``(Q, C)`` totals: each row's first largest
    class, or ``C`` where a positive ``label_threshold`` exceeds the row's largest total."""
    labels = totals.argmax(axis=1)
    if label_threshold:
        labels = np.where(totals.max(axis=1) >= label_threshold, labels, totals.shape[1])
    return labels
