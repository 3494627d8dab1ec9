"""The noise on private votes, and what a round of votes costs at each level of privacy.

**Votes are integers**: a teacher's one-hot prediction (AE-DPFL) or the label counts of its ``k``
nearest neighbours (kNN-DPFL, counts rather than the paper's frequencies ``counts / k``, so that
they stay integers). Each hospital adds ``Sk(mu)`` to every count of every query, with
``2 mu = sigma^2 / N_min``: the sum of ``N_c >= N_min`` hospitals' votes then carries
``Sk(N_c mu)``, variance at least ``sigma^2`` per count. Skellam shares add up exactly, so the
guarantee needs no rounding argument (numpy's Poisson sampler is exact up to floating-point rounding) (``training.privacy.skellam`` has the mechanism, ``training.privacy.rdp``
its Renyi DP).

**Adjacency and sensitivity**, for one query (``C`` counts), in votes:

- *record level* (the voting paper's instance level): one record is added to or removed from a hospital's data. AE-DPFL: the
  teacher may then predict another class, ``e_a - e_b``: L2 ``sqrt(2)``, L1 2 (as in PATE); a
  teacher that abstains below a confidence changes a vote by at most as much.
  kNN-DPFL: under any fixed order of (distance, record), the ``k`` nearest neighbours gain one
  record and lose one, again ``e_a - e_b``: L2 ``sqrt(2)``, L1 2. In the paper's frequency units
  that is ``sqrt(2) / k``; its Theorem 4 charges ``sqrt(2 / k)``, ``sqrt(k)`` times more.
- *hospital level* (the paper's agent level): one hospital's data joins or leaves. Which hospitals vote is public (the server
  sees who connects), so a hospital without data is one whose votes are all zero, its noise share
  still added: its vote vector is the whole change. AE-DPFL: one one-hot or none, L2 1, L1 1 (the
  paper's Theorem 4). kNN-DPFL: counts summing to ``k``, L2 at most ``k`` (all on one class), L1 ``k``.

A round answers ``Q`` queries, and a record or hospital may change every one of them. The round is
then one vector query of ``Q C`` counts with ``Delta_2 = sqrt(Q) s_2`` and ``Delta_1 = Q s_1``;
the Skellam RDP bound is linear in ``Delta_2^2`` and ``Delta_1`` (in both arms of its ``min``), so
this is exactly the composition of ``Q`` single queries. No sampling: ``q = 1``.

**Views.** The server learns the argmax of the noisy sums, a post-processing of ``Sk(N_c mu)``
noise: that is what the ``server`` view charges. Hospitals see nothing of the sum; the
``peer_hospital`` view still subtracts one share, which over-charges. ``coalition`` (the server with
``floor(n / 2)`` hospitals) subtracts their shares; ``collusion`` (every other hospital, and every
tallier, together) leaves a hospital its own share ``Sk(mu)``.

**What is revealed.** By default the talliers open only each query's label, the argmax of the noisy
totals. ``REVEAL_MODES``' "histogram" opens the totals themselves: the epsilon is the same (the label
is a post-processing of the totals, and the accounting charges the totals), but the server and the
talliers then see how close every vote was. Off by default, and flagged in every report.

**Withheld labels.** With a label threshold ``T``, a query gets its label only where its largest
noisy total reaches ``T`` (confident PATE's idea, Papernot et al. 2018, on the same noisy totals
rather than a second, separately noised check): the pattern of withheld queries is a function of
the totals too, so it costs nothing more, and every query asked is charged whether or not its
label is released. What it buys is labels the hospitals agreed on: fewer, and more often right.

**A ballot's ranges.** A hospital sends its votes and its noise apart (``protocol.voting.ballots``),
and the talliers check each inside the MPC: every count of its votes in ``[0, s]`` (``s`` the
votes per query) with ``s`` per query in all; its noise is a pool of ``M`` times the round's
``N = Q C`` values of ``Sk(mu)`` (``NoisePool``, which says why and how ``M`` is chosen), every
value in ``[-R, R]`` (``noise_range``: Bernstein's inequality on each tail, a union bound over the
``M N`` values, so that an honest draw leaves it with probability below ``2^-40``) and ``sum n^2``
at most ``E_max`` (``energy_cap``: a Chernoff bound on the exact distribution, below ``2^-40``
too). The talliers then sign the noise and place the round's ``N`` values from a public random
permutation of the pool drawn after every ballot is in, so a hospital chooses only the sizes of
its noise, never where they land, their signs, or which of them land. A hospital redraws noise
that misses either bound: that conditions each round's output on an event of probability at
least ``1 - 2^-39``, moving it by a total variation below ``2^-39`` per hospital and round, so a
run's ``delta`` grows by at most ``(1 + e^epsilon) 2^-39 H R`` over ``R`` rounds of ``H``
hospitals, ``epsilon`` the run's. The accountant does not add that term: it is 2.4e-7 at
kNN-DPFL's defaults (epsilon 10, 3 hospitals, 2 rounds), passes 1e-5 once epsilon passes about
14 there, and says nothing at AE-DPFL's default epsilon in the hundreds (``docs/limitations.md``).
The conditioned pool is exchangeable and symmetric (its events depend on the values' sizes
alone), so its signed and placed values are ``Sk(mu)`` in every count again, up to that total
variation: the mechanism above is unchanged.
"""

from __future__ import annotations
from scipy import optimize, special

import math
import numpy as np
import functools
from dataclasses import asdict, dataclass, fields

from consilium.training.privacy.accounting import Release, release_of
from consilium.training.methods.flags import Flag, below_one, non_negative_int, positive_float, positive_int, rate
from consilium.training.privacy.skellam import SkellamMechanism, bernstein_deviation

# The widest row a kNN feature map may give (a run configuration's limit, checked before any map is used).
MAX_FEATURE_DIMENSIONS = 2**10

__all__ = [
    "ACCOUNTANT",
    "MAX_FEATURE_DIMENSIONS",
    "LEVELS",
    "REVEAL_MODES",
    "VOTING_DEFAULTS",
    "VOTING_FLAGS",
    "VOTING_METHODS",
    "NoisePool",
    "VotingSettings",
    "default_quorum",
]

ACCOUNTANT = (
    "RDP of the Skellam mechanism (Agarwal et al. 2021, Thm 3.5) on one round's Q x C noisy totals, no sampling, "
    "composed over the labelled rounds (training/privacy/rdp.py), at integer orders 2-256, converted with the RDP-to-DP bound of Balle et al. (2020), as Opacus's"
)

VOTING_METHODS = ("ae-dpfl", "knn-dpfl")
REVEAL_MODES = ("labels", "histogram")
LEVELS = ("record", "hospital")  # as every method names them (the paper: instance, agent)
# Both voting methods read the same flags; the launchers refuse them for any other method.
_FLAGS = (
    Flag("--queries-per-round", positive_int, 90, "public records the hospitals label per round"),
    Flag("--vote-noise", positive_float, None, "sigma, noise on each summed count in votes (AE-DPFL 1, kNN-DPFL 15)"),
    Flag("--neighbours", positive_int, None, "kNN-DPFL: k, the neighbours each hospital counts (default 30)"),
    Flag("--reveal", str, "labels", "what the talliers open, labels or (trading privacy of the margins) histogram"),
    Flag("--label-threshold", non_negative_int, 0, "label a query only where its noisy top total reaches this many votes (0: all)"),
    Flag("--teacher-epochs", positive_int, 30, "AE-DPFL: epochs of each hospital's teacher"),
    Flag("--teacher-confidence", below_one, 0.0, "AE-DPFL: a teacher abstains below this top softmax probability (0: always votes)"),
    Flag("--feature-dimensions", positive_int, 30, "kNN-DPFL: dimensions of the public PCA feature map"),
    Flag("--student-epochs", positive_int, 100, "epochs of the server's student on the labelled queries"),
    Flag("--public-fraction", rate, 0.5, "share of the held-out records that form the public pool (the rest test)"),
)  # fmt: skip
VOTING_FLAGS = {method: _FLAGS for method in VOTING_METHODS}
# Measured on the built-in digits with 3 hospitals: kNN-DPFL at sigma 15, k 30 labels about 88% of
# the public pool right, at epsilon 6.3 per record against the server (7.9 against a fellow
# hospital, which the budget binds on). AE-DPFL's data-independent guarantee needs many hospitals
# (the voting paper's 100): with 3, noise that leaves the labels useful (sigma 1: about 84% right)
# gives epsilon in the hundreds, so its default budget binds nothing, and the launchers say so.
VOTING_DEFAULTS = {
    "ae-dpfl": {"rounds": 2, "vote_noise": 1.0, "neighbours": 1, "epsilon_budget": 2000.0},
    "knn-dpfl": {"rounds": 2, "vote_noise": 15.0, "neighbours": 30, "epsilon_budget": 10.0},
}
# The fewest hospitals whose default quorum leaves one out: n / (n - 1) <= 1.1 from 11 on (``default_quorum``).
_FEWEST_TO_LEAVE_ONE_OUT = 11
_WRAP_LOG_PROBABILITY = -40 * math.log(2)
# A noise pool's factor M (``NoisePool``): a power of two up to 64, the pool at most 8 times the round's values or
# 2^16 values (a ballot's noise values, its cost), and 2^22 (the draw's memory); the attacker's extra energy at
# most 6.5% of the round's noise where one of them allows.
_POOL_FACTORS = (1, 2, 4, 8, 16, 32, 64)
_POOL_COST = 8
_SMALL_POOL_VALUES = 2**16
_MAX_POOL_VALUES = 2**22
_SPOIL_SHARE = 0.065
_MAX_NOISE_STD = 1e4  # far beyond any useful vote; the energy cap's pmf has some 10^6 values at most


def default_quorum(hospitals: int) -> int:
    """The quorum of a voting run of ``hospitals`` unless its server is given one: every hospital but one where
    that costs a full round at most 10% more noise variance than it is charged (5% in standard deviation), every
    hospital otherwise. ``hospitals`` is the roster's count: a run that fewer join keeps this quorum.

    With a quorum of ``n - 1`` a round goes on without one hospital whose ballot is refused, that withdraws or
    that does not answer. The accounting allows any quorum: each hospital's share is the quorum's part of
    ``sigma^2`` (``VotingSettings.share_mu``), each ledger charges a round at the quorum's noise, the least a
    released round carries, and a round all ``n`` vote in carries ``n / (n - 1)`` times that, more noise than
    charged. That is 1.01 at the voting paper's 100 hospitals and 1.5 at 3, where the labels would pay for it:
    below 11 hospitals the quorum is every hospital, and ``--quorum`` sets ``n - 1`` by hand.
    """
    if hospitals < 1:
        raise ValueError(f"a voting run needs at least one hospital, got {hospitals}")
    return hospitals - 1 if hospitals >= _FEWEST_TO_LEAVE_ONE_OUT else hospitals


@dataclass(frozen=True)
class NoisePool:
    """One hospital's noise over a round of ``N = Q C`` totals: a pool of ``M N`` values of ``Sk(mu)``, redrawn
    until every value lies in ``[-R, R]`` and their energy ``sum n^2`` is at most ``E_max`` (each bound misses with
    probability below 2^-40), all of which the ballot carries, in the order drawn. The talliers place the round's
    ``N`` from a uniform permutation of the ``M N``, drawn after every ballot is in (``tallier.ballot_checks``), so
    each value sent lands with probability ``1 / M``.

    **Why a pool.** The checks bound a hospital's noise by its range and energy, and within them it may
    choose sizes that push labels: as much energy as ``E_max``, the 2^-40 tail, against an honest
    share's mean ``2 mu N``. Over ``M N`` values that tail is relatively nearer the mean, and only
    ``1 / M`` of what is sent lands: the energy that lands is on average ``E_max / M``, whatever
    the sizes chosen. The attacker's extra noise, as a share of the round's, is about
    ``(E_max / (2 mu M N) - 1) / quorum``.

    **Why every value is sent.** Which of the pool's slots land is public. Were the ballot to carry only
    the values that are not 0, the slots it left out would be known zeros, and every tallier would
    know which totals a hospital's noise left untouched (most of them, for AE-DPFL's sparse noise).

    **The rule for M**: the smallest power of two up to 64 that puts that share at most 0.065, within a
    budget of ``M N <= max(8 N, 2^16)`` (a ballot's noise part is ``M N`` values: its cost) and
    ``M N <= 2^22``; the largest within budget if none does. At 0.049 and 0.062 (AE-DPFL's and
    kNN-DPFL's defaults, ``M = 16`` and ``M = 4``) the worst attacks tried change up to 1.0 and 1.4
    percentage points of labels beyond the attacker's own votes, at 0.071 up to 1.7, at 0.09 up to 2.6
    (``tests/end_to_end/test_vote_pushing.py``, ``docs/explanation/checked-votes.md``). Small rounds
    need large pools (AE-DPFL's defaults at 10 queries: ``M = 64``), which the budget's ``2^16``
    leaves them.
    """

    factor: int  # M
    radius: int  # R
    energy_cap: int  # E_max

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class VotingSettings:
    method: str  # one of VOTING_METHODS
    noise_std: float  # sigma: standard deviation of the noise on each summed count, in votes, at the quorum
    quorum: int  # N_min: hospitals that must vote before the talliers compute a label
    neighbours: int = 1  # k, for kNN-DPFL; AE-DPFL votes once per query

    def __post_init__(self) -> None:
        if self.method not in VOTING_METHODS:
            raise ValueError(f"unknown voting method {self.method!r}; choose from {', '.join(VOTING_METHODS)}")
        if not 0 < self.noise_std <= _MAX_NOISE_STD:
            raise ValueError(f"the noise standard deviation must be in (0, {_MAX_NOISE_STD:g}], got {self.noise_std}")
        if self.quorum < 1:
            raise ValueError(f"the quorum must be at least 1, got {self.quorum}")
        if self.neighbours < 1 or (self.method == "ae-dpfl" and self.neighbours != 1):
            raise ValueError("kNN-DPFL needs neighbours >= 1; AE-DPFL votes once (neighbours = 1)")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "VotingSettings":
        kinds = {"method": str, "noise_std": float, "quorum": int, "neighbours": int}
        if set(values) != {f.name for f in fields(cls)}:
            raise ValueError(f"voting settings need exactly {sorted(kinds)}, got {sorted(values)}")
        if not all(isinstance(values[name], kind) and type(values[name]) is not bool for name, kind in kinds.items()):
            raise ValueError(
                "malformed voting settings: " + ", ".join(f"{n} must be {k.__name__}" for n, k in kinds.items())
            )
        return cls(**values)

    @property
    def votes_per_query(self) -> int:
        """What one hospital's counts for a query add up to."""
        return self.neighbours

    def sensitivity(self, level: str) -> tuple[float, float]:
        """(L2, L1) of one query's vote sum at ``level``, in votes."""
        if level == "record":
            return math.sqrt(2), 2.0
        if level == "hospital":
            return float(self.votes_per_query), float(self.votes_per_query)
        raise ValueError(f"unknown privacy level {level!r}; choose from {', '.join(LEVELS)}")

    def mechanism(self, *, queries: int, classes: int, level: str) -> SkellamMechanism:
        """The Skellam mechanism of one round of ``queries`` queries over ``classes`` classes, at ``level``."""
        if queries < 1 or classes < 2:
            raise ValueError(f"a round needs at least one query and two classes, got {queries} and {classes}")
        l2, l1 = self.sensitivity(level)
        return SkellamMechanism(
            dimension=queries * classes,
            scale=1.0,
            l2_sensitivity=math.sqrt(queries) * l2,
            l1_sensitivity=queries * l1,
            share_mu=self.share_mu,
        )

    def release(self, *, queries: int, classes: int, contributors: int, coalition: int, level: str) -> Release:
        """One round's votes from ``contributors`` hospitals, as each view of ``training.privacy.accounting`` sees it
        (``coalition``: the hospitals beside the server in its coalition view)."""
        if contributors < self.quorum:
            raise ValueError(f"{contributors} voters are fewer than the quorum {self.quorum}: no label is computed")
        mechanism = self.mechanism(queries=queries, classes=classes, level=level)
        return release_of(mechanism, sample_rate=1.0, contributors=contributors, coalition=coalition)

    def noise_range(self, *, values: int) -> int:
        """``R``: every one of ``values`` values of one hospital's ``Sk(mu)`` noise lies in ``[-R, R]``, but with
        probability below 2^-40.

        The share is a sum of unit jumps of variance ``2 mu``; Bernstein's inequality bounds each
        tail, and a union bound covers both tails of all ``values``.
        """
        log_inverse = -_WRAP_LOG_PROBABILITY + math.log(2 * values)
        return math.ceil(bernstein_deviation(2 * self.share_mu, log_inverse))

    def energy_cap(self, *, values: int) -> int:
        """``E_max``: ``sum n^2`` over ``values`` values of one hospital's ``Sk(mu)`` noise, redrawn into ``[-R, R]``,
        exceeds it with probability below 2^-40.

        Chernoff: ``P(sum n^2 >= E) <= exp(-lambda E) M(lambda)^N`` for every ``lambda > 0``, with
        ``M(lambda) = E[exp(lambda n^2) | |n| <= R]`` computed on the exact pmf of ``Sk(mu)``,
        ``e^-2mu I_|x|(2 mu)``, and ``N = values``. Any ``lambda`` gives a valid bound; the least one
        Brent's method finds is taken, rounded up to 10 significant bits: parties whose floating point
        differs in the last places then derive the same cap unless the bound lies within that
        difference of a step (about 10^-9 of configurations), and a cap that differed would refuse
        honest ballots, loudly, not pass a wrong one (the welcome carries the figures, and every party
        compares them with its own: ``protocol.voting.voting_config``).
        """
        return _energy_cap(self.share_mu, self.noise_range(values=values), values)

    def noise_pool(self, *, queries: int, classes: int) -> NoisePool:
        """The pool one hospital draws its noise of a round of ``queries`` over ``classes`` from
        (``training.voting.votes.noise_share``), and its bounds: see ``NoisePool`` for why, and for ``M``'s rule."""
        values, pool = queries * classes, None
        for factor in _POOL_FACTORS:
            pooled = factor * values
            if factor > 1 and (pooled > max(_POOL_COST * values, _SMALL_POOL_VALUES) or pooled > _MAX_POOL_VALUES):
                break
            pool = NoisePool(factor, self.noise_range(values=pooled), self.energy_cap(values=pooled))
            if (pool.energy_cap / (pooled * 2 * self.share_mu) - 1) / self.quorum <= _SPOIL_SHARE:
                break
        return pool

    @property
    def share_mu(self) -> float:
        """``mu`` of one hospital's share, so that the quorum's shares sum to variance ``sigma^2``."""
        return self.noise_std**2 / (2 * self.quorum)


@functools.lru_cache(maxsize=16)
def _energy_cap(share_mu: float, radius: int, count: int) -> int:
    values = np.arange(-radius, radius + 1, dtype=np.float64)
    log_pmf = np.log(special.ive(np.abs(values), 2 * share_mu))
    log_pmf -= special.logsumexp(log_pmf)  # the law of n given |n| <= R
    squares = values**2

    def proven(log_rate: float) -> float:
        """The least ``E`` Chernoff's bound at ``lambda = e^log_rate`` proves for the 2^-40 tail."""
        rate = math.exp(log_rate)
        return (count * special.logsumexp(log_pmf + rate * squares) - _WRAP_LOG_PROBABILITY) / rate

    span = (math.log(1e-6 / radius**2), math.log(1e4 / radius**2))
    bound = optimize.minimize_scalar(proven, bounds=span, method="bounded", options={"xatol": 1e-4}).fun
    cap = min(math.ceil(bound), count * radius**2)
    step = 1 << max(0, cap.bit_length() - 10)
    return -(-cap // step) * step
