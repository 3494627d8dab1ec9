"""The talliers' MPC: a secure argmax over the summed vote shares, opening only the labels.

Tallier ``j`` holds ``s_j``, the sum modulo ``p`` of the shares the hospitals sent it: the noisy
vote totals ``T`` (``Q x C`` counts) satisfy ``T = s_1 + ... + s_J mod p``. With ``p`` the prime
of MPyC's ``SecInt(l)`` field, one screen does it:

1. each tallier inputs ``s_j`` (MPyC Shamir-shares it among all talliers: nobody learns it);
2. the secret-shared ``T`` is the sum of the inputs, free of communication;
3. ``np_argmax`` along the classes finds each query's label with ``C - 1`` secure comparisons;
   ties go to the lowest class index, as in NumPy (``_np_argmax`` keeps the first maximum);
4. only the labels are opened, to every tallier.

``reveal="histogram"`` opens ``T`` itself instead (a secure sum): cheaper, and it shows the noisy
totals to the talliers and the server. It is for users who accept that, never a fallback.

The comparisons are correct while every difference of two totals lies in ``[-2^(l-1), 2^(l-1))``,
so ``bit_length_for`` takes ``l`` from a bound on ``|T|`` (``training.vote_privacy.sum_bound``)
and MPyC picks a prime ``p > 2^(l + kappa + 1)`` with statistical security ``kappa = 30``.
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
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["MIN_TALLIERS", "REVEAL_MODES", "MpcError", "MpcParty", "MpcResult", "bit_length_for", "field_modulus", "run_round"]

REVEAL_MODES = ("labels", "histogram")
MIN_TALLIERS = 3
_MIN_BIT_LENGTH = 8
_MAX_BIT_LENGTH = 32  # MPyC's prime for SecInt(l) has l + 32 bits, and shares travel as 64-bit words
_failed: list[str] = []  # set once an MPC in this process failed


class MpcError(RuntimeError):
    """The MPC could not finish: a tallier left, or did not answer before the deadline."""


@dataclass(frozen=True)
class MpcParty:
    index: int  # 0-based, as MPyC numbers parties
    addresses: tuple[tuple[str, int], ...]  # (host, port) of every tallier, in order
    certificates: Path  # folder holding .config/party_<i>.crt, .key and mpyc_ca.crt

    def __post_init__(self) -> None:
        if len(self.addresses) < MIN_TALLIERS:
            raise ValueError(f"the MPC needs at least {MIN_TALLIERS} talliers for an honest majority, got {len(self.addresses)}")
        if not 0 <= self.index < len(self.addresses):
            raise ValueError(f"tallier index {self.index} is not one of the {len(self.addresses)} talliers")
        object.__setattr__(self, "certificates", Path(self.certificates).resolve())


@dataclass(frozen=True)
class MpcResult:
    labels: np.ndarray  # (Q,) int64
    totals: np.ndarray | None  # (Q, C) int64, only when revealed
    bytes_sent: int  # by this tallier, to all others


def bit_length_for(bound: int) -> int:
    """The smallest ``l`` whose comparisons are right for totals in ``[-bound, bound]``: ``2 bound < 2^(l-1)``."""
    length = max(_MIN_BIT_LENGTH, (2 * bound).bit_length() + 1)
    if length > _MAX_BIT_LENGTH:
        raise ValueError(f"totals up to {bound} need {length}-bit comparisons; at most {_MAX_BIT_LENGTH} are supported")
    return length


def field_modulus(bit_length: int) -> int:
    """The prime MPyC's ``SecInt(bit_length)`` computes modulo, which the hospitals share over."""
    return _mpyc_runtime(None).SecInt(bit_length).field.modulus


def run_round(
    party: MpcParty,
    local_sum: list[int],
    *,
    queries: int,
    classes: int,
    bit_length: int,
    modulus: int,
    reveal: str,
    timeout_s: float,
) -> MpcResult:
    """One round of the protocol above for this tallier; ``MpcError`` if it does not finish in time."""
    if reveal not in REVEAL_MODES:
        raise ValueError(f"unknown reveal mode {reveal!r}; choose from {', '.join(REVEAL_MODES)}")
    if len(local_sum) != queries * classes or not all(0 <= value < modulus for value in local_sum):
        raise ValueError(f"expected {queries * classes} summed shares in [0, p)")
    runtime = _mpyc_runtime(party)
    secint = runtime.SecInt(bit_length)
    if secint.field.modulus != modulus:  # the hospitals shared over another field: the sums would be noise
        raise ValueError(f"the hospitals shared modulo {modulus}, but {bit_length}-bit MPC computes modulo {secint.field.modulus}")
    if _failed:
        raise MpcError(f"an earlier MPC in this process failed ({_failed[0]}); restart the tallier")

    async def protocol() -> MpcResult:
        await runtime.start()
        inputs = runtime.input(secint.array(secint.field.array(np.array(local_sum, dtype=object))))
        totals = runtime.np_reshape(sum(inputs[1:], inputs[0]), (queries, classes))
        if reveal == "histogram":
            opened = np.array(await runtime.output(totals), dtype=np.int64)
            labels, revealed = opened.argmax(axis=1), opened
        else:
            labels, revealed = np.array(await runtime.output(runtime.np_argmax(totals, axis=1)), dtype=np.int64), None
        sent = sum(peer.protocol.nbytes_sent for peer in runtime.parties if peer.pid != runtime.pid)
        await runtime.shutdown()
        return MpcResult(labels=labels, totals=revealed, bytes_sent=sent)

    working_directory = Path.cwd()
    os.chdir(party.certificates)  # MPyC reads its certificates from .config under the working directory
    try:
        return runtime.run(asyncio.wait_for(protocol(), timeout_s))
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


def _mpyc_runtime(party: MpcParty | None):
    """A fresh MPyC runtime for ``party``, over mutual TLS (a single local party if None).

    MPyC reads its settings from ``sys.argv`` when it sets a runtime up (and when first imported),
    so the arguments are swapped in for that moment only.
    """
    arguments = [sys.argv[0], "--no-log"]
    if party is not None:
        arguments += [f"-P{host}:{port}" for host, port in party.addresses] + ["-I", str(party.index), "--ssl"]
    saved = sys.argv
    try:
        sys.argv = list(arguments)
        import mpyc.runtime  # the first import sets up a runtime too, and leaves sys.argv stripped

        sys.argv = list(arguments)
        return mpyc.runtime.setup()
    finally:
        sys.argv = saved
