"""The run configuration the server announces, and what every party derives from it.

Hospitals receive it in ``Welcome``, validate it, and derive the same mechanism and BFV parameters
the server does: the integer mechanism from the DP settings and the model's size
(``training.privacy.skellam``), and the plaintext modulus from the bound on a sum of all the run's
hospitals' shares. The privacy budget is not part of it: each hospital holds its own and enforces
it on its own ledger.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from consilium.crypto.bfv_parameters import BfvParameters, ParameterError, select_bfv_parameters
from consilium.crypto.linear_hash import challenge_count
from consilium.crypto.one_time_keys import key_share_bytes
from consilium.crypto.sealed_box import OVERHEAD_BYTES
from consilium.protocol.run.rules import MAX_HOSPITALS, MAX_MESSAGE_BYTES, ConfigError, check_run, run_fingerprint
from consilium.protocol.secure_round.statement import RoundSetting, check_threshold
from consilium.training.privacy.accounting import Release, tolerated_coalition
from consilium.training.methods.registry import METHODS, TrainingMethod, ledger_release, settings_from_dict
from consilium.training.models.spec import ModelSpec
from consilium.training.privacy.skellam import SkellamMechanism
from consilium.protocol.wire.messages import ProtocolError, Welcome

__all__ = [
    "INSECURE_PLAINTEXT",
    "MAX_SERVER_WAIT_S",
    "SECURE_AGGREGATION",
    "RunConfig",
    "accept_run",
    "announced_method",
    "check_aggregation",
    "check_choices",
]

SECURE_AGGREGATION = "bfv"
INSECURE_PLAINTEXT = "insecure-plaintext-benchmark"  # crypto.insecure_plaintext: no privacy holds
AGGREGATIONS = (SECURE_AGGREGATION, INSECURE_PLAINTEXT)

MAX_SERVER_WAIT_S = 24 * 3600  # the most a Welcome may say the server keeps a hospital waiting
_MESSAGE_SLACK_BYTES = 64 * 1024
# The one-time round's messages grow with n^2 (every member's proof of lambda x tau values to every member)
# and its dealing with n tau: beyond this many hospitals a run is refused (review 4, finding 5).
MAX_SECURE_HOSPITALS = 256
_WELCOME_VECTORS = 4  # float32 vectors of the model's size in a Welcome (message_limit)


def check_choices(method: str, aggregation: str) -> None:
    """``ConfigError`` unless a hospital's operator chose a method and an aggregation mode there are."""
    check_aggregation(aggregation)
    if method not in METHODS:
        raise ConfigError(f"a hospital of the secure round trains with one of {', '.join(METHODS)}, not {method!r}")


def check_aggregation(aggregation: str) -> None:
    """``ConfigError`` unless ``aggregation`` names a mode: secure, or the round benchmark's plaintext one."""
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")


@dataclass(frozen=True)
class RunConfig:
    run_id: str
    dataset: str
    hospitals: tuple[str, ...]  # in roster order: hospital i is the one-time keys' Shamir party i + 1
    rounds: int
    delta: float
    model: ModelSpec
    training: TrainingMethod  # the method and its settings (training.methods.registry)
    # Part of the fingerprint, so a hospital and a server in different modes never share a round:
    # each hospital refuses a run whose mode is not the one its own operator chose.
    aggregation: str = SECURE_AGGREGATION
    threshold: int = 0  # tau, the releases that rebuild a sum's key; 0: floor(n/2) + 1, the least allowed

    def __post_init__(self) -> None:
        check_run(self.run_id, self.hospitals, quorum=self.training.quorum, rounds=self.rounds, delta=self.delta)
        check_aggregation(self.aggregation)
        if self.aggregation == SECURE_AGGREGATION and len(self.hospitals) > MAX_SECURE_HOSPITALS:
            raise ConfigError(
                f"the secure round takes at most {MAX_SECURE_HOSPITALS} hospitals, not {len(self.hospitals)}"
            )
        if self.aggregation == SECURE_AGGREGATION:
            try:
                check_threshold(len(self.hospitals), self.key_threshold, self.training.quorum)
            except ValueError as error:
                raise ConfigError(str(error)) from None
        if _WELCOME_VECTORS * 4 * self.parameter_count > MAX_MESSAGE_BYTES:  # before anything of that size is allocated
            raise ConfigError(
                f"a model of {self.parameter_count:,} parameters does not fit the {MAX_MESSAGE_BYTES:,} bytes a party accepts in a message"
            )

    @property
    def key_threshold(self) -> int:
        return self.threshold or len(self.hospitals) // 2 + 1

    def coalition(self, consortium: int) -> int:
        """The hospitals beside the server in the ``coalition`` view, for a consortium of ``consortium``
        hospitals (``training.privacy.accounting.tolerated_coalition``)."""
        return tolerated_coalition(self.key_threshold, consortium)

    def quorum_release(self, consortium: int) -> Release:
        """What a hospital's ledger charges each round of this run before its update leaves: the least noise
        a released sum carries, a quorum's, in a consortium of ``consortium`` hospitals."""
        return ledger_release(self.training, self.mechanism(), self.training.quorum, self.coalition(consortium))

    @property
    def parameter_count(self) -> int:
        return self.model.parameter_count()

    def mechanism(self) -> SkellamMechanism:
        return self.training.mechanism(self.parameter_count)

    def bfv_parameters(self) -> BfvParameters:
        mechanism = self.mechanism()
        bound = mechanism.sum_bound(contributors=len(self.hospitals), expected_batch_size=self.training.rows_per_share)
        try:
            return select_bfv_parameters(
                max_contributors=len(self.hospitals),
                vector_length=mechanism.dimension,
                sum_bound=bound.levels,
                key_shares=len(self.hospitals) if self.aggregation == SECURE_AGGREGATION else 0,
            )
        except ParameterError as error:
            raise ConfigError(str(error)) from None

    def round_setting(self, run: str, round_number: int, params: BfvParameters) -> RoundSetting:
        """What every party of round ``round_number`` of ``run`` (``fingerprint``) agrees on."""
        return RoundSetting(
            run,
            round_number,
            self.hospitals,
            threshold=self.key_threshold,
            quorum=self.training.quorum,
            params=params,
        )

    def message_limit(self) -> int:
        """The largest message this run needs: an upload or a sum with their sealed key shares, or a Welcome.

        A Welcome carries the initial and the current parameters and the update rule's state (at
        most two vectors, FedAdam's): four float32 vectors. The released mean is one."""
        params = self.bfv_parameters()
        polynomial, n = key_share_bytes(params), len(self.hospitals)
        challenges = challenge_count(params.ciphertext_modulus)
        box = polynomial + 8 * challenges + OVERHEAD_BYTES
        with_shares = (params.chunk_count + 1) * polynomial + n * (box + 256)
        # Every member's proof (lambda x tau values of up to 9 bytes each in msgpack), or release, relayed to all.
        proofs = n * (9 * challenges * self.key_threshold + 256)
        releases = n * (polynomial + 9 * challenges + 256)
        welcome = _WELCOME_VECTORS * 4 * params.vector_length + len(
            json.dumps(self.to_dict())
        )  # msgpack is no longer than JSON here
        limit = max(with_shares, proofs, releases, welcome) + _MESSAGE_SLACK_BYTES
        if limit > MAX_MESSAGE_BYTES:
            raise ConfigError(
                f"this run's largest message would take {limit:,} bytes, over the {MAX_MESSAGE_BYTES:,} a party accepts"
            )
        return limit

    def fingerprint(self, initial_parameters: bytes) -> str:
        """What a hospital took part in: the run id and a digest of every setting and the initial model.

        Key contexts and endorsements are bound to it, so a server that gives hospitals different
        settings (say, less noise to some) gets no key through and no sum endorsed.
        """
        return run_fingerprint(b"consilium run v1", self.to_dict(), initial_parameters)

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "dataset": self.dataset,
            "hospitals": list(self.hospitals),
            "rounds": self.rounds,
            "delta": self.delta,
            "model": self.model.to_dict(),
            "training": self.training.to_dict(),
            "aggregation": self.aggregation,
            "threshold": self.threshold,
        }

    @classmethod
    def from_dict(cls, values: dict) -> "RunConfig":
        if (
            not isinstance(values, dict)
            or not isinstance(values.get("hospitals"), list)
            or len(values["hospitals"]) > MAX_HOSPITALS
        ):
            raise ConfigError(f"malformed run configuration: hospitals must be a list of at most {MAX_HOSPITALS} names")
        try:
            config = cls(
                run_id=str(values["run_id"]),
                dataset=str(values["dataset"]),
                hospitals=tuple(str(h) for h in values["hospitals"]),
                rounds=int(values["rounds"]),
                delta=float(values["delta"]),
                model=ModelSpec.from_dict(values["model"]),
                training=settings_from_dict(values["training"]),
                aggregation=str(values["aggregation"]),
                threshold=int(values["threshold"]),
            )
        except (KeyError, TypeError) as error:
            raise ConfigError(f"malformed run configuration: missing or wrong {error}") from None
        except (ValueError, OverflowError) as error:
            raise ConfigError(f"malformed run configuration: {error}") from None
        return config


def announced_method(welcome: Welcome) -> str | None:
    """The training method a Welcome names, read before any method's code reads its settings (None where it
    names none that can be shown in one line)."""
    training = welcome.config.get("training")
    method = training.get("method") if isinstance(training, dict) else None
    return method if isinstance(method, str) and len(method) <= 64 else None


def accept_run(welcome: Welcome, *, name: str, method: str, aggregation: str, roster_hospitals: list[str]) -> RunConfig:
    """The run a server's Welcome announces, as hospital ``name`` accepts it: of the method and aggregation
    mode its own operator chose (a server cannot switch it to plaintext uploads, or to another method,
    whose ledger entries would mean something else), naming ``name`` and only the roster's hospitals
    (not, say, the server as a hospital, to hold a key), with a wait for the server of at most
    ``MAX_SERVER_WAIT_S``. ``ProtocolError`` otherwise."""
    announced = welcome.config
    method_announced = announced_method(welcome)
    if method_announced != method:  # before any method's code reads the server's settings
        raise ProtocolError(f"the server's run trains with {method_announced!r}; {name} was started for {method!r}")
    try:
        config = RunConfig.from_dict(announced)
    except ConfigError as error:
        raise ProtocolError(f"the server's run configuration is unusable: {error}") from None
    if config.aggregation != aggregation:
        raise ProtocolError(
            f"the server's run uses {config.aggregation!r} aggregation; {name} was started for {aggregation!r}"
        )
    if name not in config.hospitals:
        raise ProtocolError(f"{name} is not among the run's hospitals")
    if strangers := set(config.hospitals) - set(roster_hospitals):
        raise ProtocolError(f"the run names {sorted(strangers)} as hospitals; the roster does not")
    if not 0 < welcome.server_wait_s <= MAX_SERVER_WAIT_S:
        raise ProtocolError(
            f"the server says it may keep a hospital waiting {welcome.server_wait_s} s; at most {MAX_SERVER_WAIT_S} s is accepted"
        )
    return config
