"""When a hospital encrypts and sends its update: late enough for the largest batch it will draw.

A hospital starts encrypting its update a fixed offset after RoundStart, whatever its step took,
because the step's time grows with the round's Poisson batch size, which DP does not protect, and
the server sees when updates arrive (``protocol.run.hospital``). What follows the offset, the
encryption and the sending, depends on the model's size and the members, not on the batch, but
for well under a millisecond a round on the share's values: SEAL compresses each ciphertext it
saves, and how well depends on how many of its slots are zero. An offset shorter than a step gives the batch away: with the built-in ResNet-18 on a
CPU, every round overran a fixed 0.25 s by 28-38 s.

So the offset follows the step's time, measured where the measurement says nothing of any round's
draw: timed once before round 1 on a batch of a size fixed in advance, ``b_hi``, the ``1 - TAIL``
quantile of the batch size ``Binomial(n, q)`` (each of the hospital's ``n`` records is taken with
probability ``q``). ``b_hi`` depends on ``q``, a public setting, and on ``n``, the hospital's record
count, which the protocol does not protect either. The rehearsal runs the method's own step with
sample rate 1 on ``b_hi`` of the hospital's records drawn with replacement, on a copy of the model;
its output is thrown away.

The offset is ``max(floor, MARGIN x step)``, ``floor`` being the operator's ``--send-offset``; an
offset of 0 (send at once) stays 0. A round whose batch exceeds ``b_hi`` (probability ``TAIL`` a
round) or whose step is slowed by the machine can still overrun; the hospital counts and logs each
overrun. Methods without a sample rate (DP-FedAvg trains on all of its sub-clients' records every
round) draw no batch, and keep the floor.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
from scipy.stats import binom
from torch import nn

from consilium.training.data.splits import Split
from consilium.training.methods.registry import TrainingMethod

__all__ = ["DEFAULT_SEND_OFFSET_S", "MARGIN", "TAIL", "SendOffset", "largest_batch", "rehearse_step"]

log = logging.getLogger("consilium.hospital")  # the hospital's: its operator reads the offset there

# The floor. Measured: the default run's slowest train + encrypt step on a 2-core machine took 0.04 s (its
# first); the floor is six times that (docs/tutorials/first-federation.md).
DEFAULT_SEND_OFFSET_S = 0.25

TAIL = 1e-6  # the chance a round's batch exceeds the rehearsed one
_LONG_OFFSET_S = 10.0  # an offset the operators should hear of: a server's round waits 60 s by default
MARGIN = 1.5  # over the measured time: a step's time varies by 10-20% between runs on a shared machine


def largest_batch(records: int, sample_rate: float) -> int:
    """``b_hi``: the batch size that a round's Poisson draw exceeds with probability at most ``TAIL``."""
    return max(1, int(binom.ppf(1 - TAIL, records, sample_rate)))


def rehearse_step(training: TrainingMethod, model: nn.Module, data: Split) -> tuple[float, int] | None:
    """The method's step on ``largest_batch`` records: its seconds and the records it took (None for a method
    that draws no batch)."""
    if not (dataclasses.is_dataclass(training) and hasattr(training, "sample_rate")) or not len(data):
        return None  # no batch is drawn, or no record: the hospital's own step says why
    size = largest_batch(len(data), training.sample_rate)
    picks = np.arange(size) % len(data)  # which records is of no matter, only how many: no draw needed
    try:  # on a copy: a step hooks the model it trains, so ``model`` must be one no step has hooked yet
        step = dataclasses.replace(training, sample_rate=1.0).local_step(copy.deepcopy(model), data.subset(picks))
    except ValueError:  # the data cannot take the method: the hospital's own step says why
        return None
    started = time.perf_counter()
    try:
        _, records = step()
    except ValueError:  # a model whose gradients are not finite: the round's own step says so, in one line
        return None
    return time.perf_counter() - started, records


@dataclass
class SendOffset:
    """The offset after RoundStart at which a hospital starts encrypting its update."""

    floor_s: float  # the operator's --send-offset
    step_s: float = 0.0  # the rehearsed step's

    def seconds(self) -> float:
        if self.floor_s == 0:  # the operator's choice: send at once
            return 0.0
        return max(self.floor_s, MARGIN * self.step_s)

    def rehearse(self, training: TrainingMethod, model: nn.Module, data: Split, name: str) -> None:
        """Time the step (``rehearse_step``; ``model`` one no step has hooked yet) and say what the offset is."""
        if not self.floor_s:
            return
        rehearsed = rehearse_step(training, model, data)
        if rehearsed is None:
            if hasattr(training, "sample_rate"):  # a batch is drawn, and its step could not be timed
                log.warning(
                    "%s: the step could not be timed; each update is encrypted %g s after its round starts",
                    name,
                    self.floor_s,
                )
            return
        self.step_s, records = rehearsed
        log.log(
            logging.WARNING if self.seconds() > _LONG_OFFSET_S else logging.INFO,
            "%s: a step of %d records took %.3f s; each update is encrypted %.3f s after its round starts (the "
            "server's --round-timeout must be above that plus the encryption, and its --join-timeout above the step)",
            *(name, records, self.step_s, self.seconds()),
        )
