"""Client-level privacy of DP-FedAvg over intermediaries, at both levels it protects.

A round releases the sum of the clipped updates of its sub-clients plus ``N(0, z^2 C^2 I)``:

- **sub-client level**: neighbouring federations differ by one sub-client, which moves the sum by
  at most ``C``: a Gaussian mechanism with noise multiplier ``z``, each sub-client taking part
  with probability ``q`` (Poisson sampling; ``q = 1`` when all take part);
- **hospital level**: a hospital's ``v`` sub-clients move together, by up to ``v C``: noise
  multiplier ``z / v``, where ``v`` is the largest split of any hospital that round. No
  amplification is claimed at this level (sample rate 1): how many of a hospital's sub-clients are
  sampled is not a single coin.

The paper's public code reports the first alone, whatever ``v``; a hospital is what a consortium
member actually is, so both are reported and a hospital's budget binds on the second.

Opacus's PRV accountant (Gopi et al. 2021) composes the rounds, each with its own ``v``; its RDP
accountant is the option for a looser but simpler bound. Each round's ``v`` must be fixed before
the run: where it adapts to released data, pass the most it may reach (``training.dp_fedavg``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from training.dp_sgd import gaussian_accountant

__all__ = ["LEVELS", "ClientRelease", "client_epsilons"]

LEVELS = ("subclient", "hospital")


@dataclass(frozen=True)
class ClientRelease:
    """One round's release: its noise multiplier relative to ``C``, its sub-clients' sample rate, the largest split."""

    noise_multiplier: float  # z
    sample_rate: float  # q
    subclients: int  # v: the most sub-clients any one hospital had this round

    def __post_init__(self) -> None:
        if not (self.noise_multiplier > 0 and 0 < self.sample_rate <= 1 and self.subclients >= 1):
            raise ValueError(f"a release needs z > 0, q in (0, 1] and v >= 1, got {self}")

    def at(self, level: str) -> tuple[float, float]:
        """``(noise multiplier, sample rate)`` of this release as ``level`` sees it."""
        if level == "subclient":
            return self.noise_multiplier, self.sample_rate
        if level == "hospital":
            return self.noise_multiplier / self.subclients, 1.0
        raise ValueError(f"unknown level {level!r}; choose one of {', '.join(LEVELS)}")


def client_epsilons(releases: Iterable[ClientRelease], delta: float, *, accountant: str = "prv") -> dict[str, float]:
    """Epsilon at ``delta`` after ``releases``, for one sub-client and for one hospital."""
    gaussian_accountant(accountant)  # an unknown name is refused even with nothing to compose
    releases = list(releases)
    if not releases:
        return {level: 0.0 for level in LEVELS}
    epsilons = {}
    for level in LEVELS:
        composed = gaussian_accountant(accountant)
        for release in releases:
            noise_multiplier, sample_rate = release.at(level)
            composed.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        epsilons[level] = float(composed.get_epsilon(delta))
    return epsilons
