"""The configuration of a voting run (AE-DPFL, kNN-DPFL), and what every party derives from it.

The server announces it in ``VotingWelcome``; hospitals and talliers validate it and derive the
same things from it: the noise each hospital adds and what a round costs
(``training.voting.vote_privacy``), the ranges every ballot is checked against
(``protocol.voting.ballots``), the bound on every total of checked ballots, and from that bound the
MPC's field, which the hospitals share over and the talliers compute in (``crypto.mpc_field``).
The privacy budget is not part of it: each hospital holds its own.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from consilium.crypto.mpc_field import MIN_PARTIES, MpcField
from consilium.protocol.run.rules import MAX_MESSAGE_BYTES, ConfigError, check_run, run_fingerprint
from consilium.protocol.voting.ballots import BallotLayout
from consilium.protocol.wire.messages import ProtocolError, VotingWelcome
from consilium.training.privacy.accounting import tolerated_coalition
from consilium.training.models.spec import ModelSpec
from consilium.training.voting.vote_privacy import MAX_FEATURE_DIMENSIONS, REVEAL_MODES, VotingSettings

__all__ = ["VotingConfig", "welcomed_run"]

_MESSAGE_SLACK_BYTES = 64 * 1024
_MAX_QUERIES_PER_ROUND = 10_000
_MAX_TEACHER_EPOCHS = 1_000
_MAX_VOTES_PER_ROUND = 1_000_000
_MAX_QUERY_VALUES_PER_ROUND = 2**26  # 256 MiB of float32 queries
_MAX_HIDDEN_LAYERS = 8
_MAX_HIDDEN_WIDTH = 4096
_BOX_OVERHEAD_BYTES = 256  # a sealed box's header, tag and signature, its key in the map


@dataclass(frozen=True)
class VotingConfig:
    run_id: str
    dataset: str
    hospitals: tuple[str, ...]  # in roster order
    talliers: tuple[str, ...]  # in roster order: tallier i is MPC party i - 1
    rounds: int
    queries_per_round: int
    delta: float
    voting: VotingSettings
    reveal: str  # one of REVEAL_MODES
    label_threshold: int  # a query is labelled only where its noisy top total reaches this many votes; 0 labels all
    model: ModelSpec  # the input shape and classes; AE-DPFL's teachers and the server's student
    teacher_epochs: int  # AE-DPFL
    teacher_confidence: float  # AE-DPFL: a teacher abstains below this top softmax probability; 0 always votes
    feature_dimensions: int  # kNN-DPFL: the public PCA's dimensions

    def __post_init__(self) -> None:
        check_run(self.run_id, self.hospitals, quorum=self.voting.quorum, rounds=self.rounds, delta=self.delta)
        if len(self.talliers) < MIN_PARTIES or len(set(self.talliers)) != len(self.talliers):
            raise ConfigError(f"a voting run needs at least {MIN_PARTIES} distinct talliers, got {list(self.talliers)}")
        if len(self.talliers) % 2 == 0:  # J = 2t + 1: the labels' MAC checks rely on it (tallier.authenticated)
            raise ConfigError(f"a voting run needs an odd number of talliers (3, 5, 7, ...), got {len(self.talliers)}")
        if self.reveal not in REVEAL_MODES:
            raise ConfigError(f"unknown reveal mode {self.reveal!r}; choose from {', '.join(REVEAL_MODES)}")
        # Above the quorum's votes, a round the quorum alone votes in could release labels by noise only.
        # (Not every hospital's: the server narrows the run to those that joined.) The MPC compares
        # top - T, within the field's range as long as T stays below the totals' bound.
        if not 0 <= self.label_threshold <= self.quorum_votes:
            raise ConfigError(
                f"the label threshold must be between 0 and {self.quorum_votes} votes (the quorum's), got {self.label_threshold}"
            )
        if not 0 <= self.teacher_confidence < 1:
            raise ConfigError(f"the teacher confidence must be in [0, 1), got {self.teacher_confidence}")
        for name, most in (
            ("queries_per_round", _MAX_QUERIES_PER_ROUND),
            ("teacher_epochs", _MAX_TEACHER_EPOCHS),
            ("feature_dimensions", MAX_FEATURE_DIMENSIONS),
        ):
            if not 1 <= getattr(self, name) <= most:  # a server's config must not make a hospital exhaust itself
                raise ConfigError(f"{name.replace('_', ' ')} must be between 1 and {most}, got {getattr(self, name)}")
        if (
            self.votes_per_round > _MAX_VOTES_PER_ROUND
            or self.queries_per_round * self.features > _MAX_QUERY_VALUES_PER_ROUND
        ):
            raise ConfigError(
                f"a round of {self.queries_per_round} queries of {self.features} values over {self.classes} classes is too large "
                f"(at most {_MAX_VOTES_PER_ROUND} votes and {_MAX_QUERY_VALUES_PER_ROUND} query values)"
            )
        if len(self.model.hidden) > _MAX_HIDDEN_LAYERS or max(self.model.hidden, default=1) > _MAX_HIDDEN_WIDTH:
            raise ConfigError(
                f"at most {_MAX_HIDDEN_LAYERS} hidden layers of at most {_MAX_HIDDEN_WIDTH} units, got {self.model.hidden}"
            )
        self.field()  # a run whose totals no field can hold fails here, before anything runs
        if self.message_limit() > MAX_MESSAGE_BYTES:
            raise ConfigError(
                f"a round's checked ballots need messages of {self.message_limit():,} bytes, over the limit of "
                f"{MAX_MESSAGE_BYTES:,}: ask fewer queries per round"
            )

    @property
    def classes(self) -> int:
        return self.model.num_classes

    @property
    def features(self) -> int:
        """Values per query record."""
        return math.prod(self.model.input_shape)

    @property
    def quorum_votes(self) -> int:
        """The largest count a query's class can get before noise when only the quorum votes."""
        return self.voting.quorum * self.voting.votes_per_query

    @property
    def corrupt_talliers(self) -> int:
        """``t``: the talliers that may deviate together, an honest majority of ``J = 2t + 1`` being the rest."""
        return (len(self.talliers) - 1) // 2

    @property
    def votes_per_round(self) -> int:
        return self.queries_per_round * self.classes

    def coalition(self, consortium: int) -> int:
        """The hospitals beside the server in the ``coalition`` view, for a consortium of ``consortium``
        hospitals: as many as a secure round's default threshold tolerates (``training.privacy.accounting.tolerated_coalition``)."""
        return tolerated_coalition(len(self.hospitals) // 2 + 1, consortium)

    def ballot_layout(self) -> BallotLayout:
        """A hospital's ballot: its votes, its noise from ``VotingSettings.noise_pool`` (``M``, ``R`` and ``E_max``,
        which ``to_dict`` carries and ``from_dict`` compares with its own), and the slack
        (``protocol.voting.ballots``)."""
        return BallotLayout.for_round(
            self.voting,
            queries=self.queries_per_round,
            classes=self.classes,
            abstains=self.voting.method == "ae-dpfl" and self.teacher_confidence > 0,
        )

    def totals_bound(self) -> int:
        """|every total| of a round: every hospital's votes and noise, each at most ``s + R`` from 0."""
        return self.ballot_layout().totals_bound(len(self.hospitals))

    def field(self) -> MpcField:
        try:
            field = _field_for(self.totals_bound())
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if self.ballot_layout().energy_bound >= field.modulus:  # the energy check would wrap: not exact
            raise ConfigError("the noise's energy check does not fit the MPC's field: ask fewer queries per round")
        return field

    def message_limit(self) -> int:
        """The largest message of the run: the queries, a ballot, the shares a tallier gets, or the welcome."""
        share = 8 * self.ballot_layout().values + _BOX_OVERHEAD_BYTES
        queries = 4 * self.queries_per_round * self.features
        feature_map = 8 * self.features * (1 + self.feature_dimensions)
        labels = 16 * self.votes_per_round  # in histogram mode, the totals beside the labels
        largest = max(queries, len(self.talliers) * share, len(self.hospitals) * share, feature_map, labels)
        return largest + _MESSAGE_SLACK_BYTES

    def fingerprint(self, feature_map: bytes) -> str:
        """What a party took part in: every setting and the feature map; ledgers and sealed shares are bound to it."""
        return run_fingerprint(b"consilium voting run v1", self.to_dict(), feature_map)

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "dataset": self.dataset,
            "hospitals": list(self.hospitals),
            "talliers": list(self.talliers),
            "rounds": self.rounds,
            "queries_per_round": self.queries_per_round,
            "delta": self.delta,
            "voting": self.voting.to_dict(),
            "reveal": self.reveal,
            "label_threshold": self.label_threshold,
            "model": self.model.to_dict(),
            "teacher_epochs": self.teacher_epochs,
            "teacher_confidence": self.teacher_confidence,
            "feature_dimensions": self.feature_dimensions,
            "ballot": self.ballot_layout().noise_pool.to_dict(),  # derived: announced so that every party compares
        }

    @classmethod
    def from_dict(cls, values: dict) -> "VotingConfig":
        integers = ("rounds", "queries_per_round", "label_threshold", "teacher_epochs", "feature_dimensions")
        if not isinstance(values, dict) or any(type(values.get(name)) is not int for name in integers):
            raise ConfigError(f"malformed voting configuration: {', '.join(integers)} must be integers")
        if type(values.get("teacher_confidence")) is not float:
            raise ConfigError("malformed voting configuration: teacher_confidence must be a float")
        if not all(
            isinstance(values.get(name), list) and all(type(n) is str for n in values[name])
            for name in ("hospitals", "talliers")
        ):
            raise ConfigError("malformed voting configuration: hospitals and talliers must be lists of names")
        try:
            config = cls(
                run_id=str(values["run_id"]),
                dataset=str(values["dataset"]),
                hospitals=tuple(str(h) for h in values["hospitals"]),
                talliers=tuple(str(t) for t in values["talliers"]),
                rounds=int(values["rounds"]),
                queries_per_round=int(values["queries_per_round"]),
                delta=float(values["delta"]),
                voting=VotingSettings.from_dict(values["voting"]),
                reveal=str(values["reveal"]),
                label_threshold=int(values["label_threshold"]),
                model=ModelSpec.from_dict(values["model"]),
                teacher_epochs=int(values["teacher_epochs"]),
                teacher_confidence=values["teacher_confidence"],
                feature_dimensions=int(values["feature_dimensions"]),
            )
        except (KeyError, TypeError, OverflowError, RecursionError) as error:
            raise ConfigError(
                f"malformed voting configuration: missing or wrong {type(error).__name__} {error}"
            ) from None
        except ConfigError:
            raise
        except ValueError as error:
            raise ConfigError(f"malformed voting configuration: {error}") from None
        derived = config.to_dict()
        if set(values) != set(derived):
            raise ConfigError(f"malformed voting configuration: unexpected fields {sorted(set(values) - set(derived))}")
        if values["ballot"] != derived["ballot"]:  # parties that derived other figures would refuse honest ballots
            raise ConfigError(
                f"the configuration's ballot figures {values['ballot']} are not the {derived['ballot']} this party "
                "derives from its settings: another version or platform, refusing the run"
            )
        return config


@functools.lru_cache(maxsize=8)
def _field_for(bound: int) -> MpcField:
    return MpcField.for_bound(bound)


def welcomed_run(welcome: VotingWelcome) -> tuple[VotingConfig, str]:
    """The run a ``VotingWelcome`` offers, and its fingerprint; ``ProtocolError`` if it is unusable."""
    try:
        config = VotingConfig.from_dict(welcome.config)
    except ConfigError as error:
        raise ProtocolError(f"the server's voting configuration is unusable: {error}") from None
    return config, config.fingerprint(welcome.feature_map)
