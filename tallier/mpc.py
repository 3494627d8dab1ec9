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

After an ``MpcError`` MPyC's state in this process is unusable (its listening socket and pending
tasks stay behind), so every later round in the process refuses at once: restart the tallier.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from crypto.mpc_field import MIN_PARTIES, MpcField, mpyc_runtime
from crypto.secret_sharing import add
from training.vote_privacy import REVEAL_MODES

__all__ = ["MpcError", "MpcParty", "MpcResult", "VoterError", "run_round"]

_failed: list[str] = []  # set once an MPC in this process failed


class MpcError(RuntimeError):
    """The MPC could not finish: a tallier left, or did not answer before the deadline."""


class VoterError(RuntimeError):
    """The talliers do not agree on the round, or hold shares from fewer voters than the quorum."""


@dataclass(frozen=True)
class MpcParty:
    index: int  # 0-based, as MPyC numbers parties
    addresses: tuple[tuple[str, int], ...]  # (host, port) of every tallier, in order
    certificates: Path  # folder holding .config/party_<i>.crt, .key and mpyc_ca.crt

    def __post_init__(self) -> None:
        if len(self.addresses) < MIN_PARTIES:
            raise ValueError(f"the MPC needs at least {MIN_PARTIES} talliers for an honest majority, got {len(self.addresses)}")
        if not 0 <= self.index < len(self.addresses):
            raise ValueError(f"tallier index {self.index} is not one of the {len(self.addresses)} talliers")
        object.__setattr__(self, "certificates", Path(self.certificates).resolve())


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
    runtime = mpyc_runtime([f"-P{host}:{port}" for host, port in party.addresses] + ["-I", str(party.index), "--ssl"])
    secint = runtime.SecInt(field.bit_length)
    if secint.field.modulus != field.modulus:  # the hospitals shared over another field: the sums would be noise
        raise ValueError(f"the hospitals shared modulo {field.modulus}, but {field.bit_length}-bit MPC computes modulo {secint.field.modulus}")
    if _failed:
        raise MpcError(f"an earlier MPC in this process failed ({_failed[0]}); restart the tallier")

    def public_input(values: list[int]) -> list:
        return runtime.input(secint.array(secint.field.array(np.array(values, dtype=object))))

    async def protocol() -> MpcResult:
        await runtime.start()
        marks = [round_number] + [int(name in shares) for name in hospitals]
        opened = [await runtime.output(vector) for vector in public_input(marks)]
        if {int(vector[0]) for vector in opened} != {round_number}:
            await runtime.shutdown()
            raise VoterError(f"the talliers are not all in round {round_number}: {sorted({int(v[0]) for v in opened})}")
        voters = tuple(name for i, name in enumerate(hospitals, start=1) if all(int(v[i]) for v in opened))
        if len(voters) < quorum:
            await runtime.shutdown()
            raise VoterError(f"the talliers share valid votes from {len(voters)} hospitals, fewer than the quorum of {quorum}")
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

    working_directory = Path.cwd()
    os.chdir(party.certificates)  # MPyC reads its certificates from .config under the working directory
    try:
        return runtime.run(asyncio.wait_for(protocol(), timeout_s))
    except VoterError:
        raise
    except (asyncio.TimeoutError, TimeoutError):
        _failed.append("timed out")
        raise MpcError(f"the talliers' MPC did not finish within {timeout_s:g} s (a tallier left or is unreachable)") from None
    except (OSError, ConnectionError) as error:
        _failed.append(str(error))
        raise MpcError(f"the talliers' MPC failed: {error}") from None
    except BaseException as error:
        _failed.append(type(error).__name__)
        raise
    finally:
        os.chdir(working_directory)


def _released_labels(totals: np.ndarray, label_threshold: int) -> np.ndarray:
    """What the MPC opens, computed in the clear from ``(Q, C)`` totals: each row's first largest
    class, or ``C`` where a positive ``label_threshold`` exceeds the row's largest total."""
    labels = totals.argmax(axis=1)
    if label_threshold:
        labels = np.where(totals.max(axis=1) >= label_threshold, labels, totals.shape[1])
    return labels
