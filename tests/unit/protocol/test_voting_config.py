"""The voting run's configuration: what every party derives from it, and what it refuses."""

import dataclasses

import pytest
from consilium.protocol.run.rules import ConfigError
from consilium.protocol.voting.voting_config import VotingConfig
from consilium.training.models.spec import ModelSpec
from consilium.training.voting.vote_privacy import VotingSettings


def _config(**changes):
    settings = dict(
        run_id="0123abcd",
        dataset="digits",
        hospitals=("hospital-1", "hospital-2", "hospital-3"),
        talliers=("tallier-1", "tallier-2", "tallier-3"),
        rounds=2,
        queries_per_round=20,
        delta=1e-5,
        voting=VotingSettings("knn-dpfl", noise_std=15.0, quorum=3, neighbours=30),
        reveal="labels",
        label_threshold=0,
        model=ModelSpec("mlp", (64,), 10),
        teacher_epochs=1,
        teacher_confidence=0.0,
        feature_dimensions=10,
    )
    settings.update(changes)
    return VotingConfig(**settings)


def test_the_configuration_survives_the_wire_and_names_its_feature_map():
    config = _config(label_threshold=50)
    assert VotingConfig.from_dict(config.to_dict()) == config
    assert config.fingerprint(b"a") != config.fingerprint(b"b") != _config(rounds=3).fingerprint(b"b")


@pytest.mark.parametrize("figure", ["factor", "radius", "energy_cap"])
def test_a_party_refuses_a_configuration_whose_ballot_figures_are_not_those_it_derives(figure):
    """The welcome carries the noise pool's figures (``NoisePool``); a party whose own derivation differs (another
    version, another platform's floating point) refuses the run, rather than refuse honest ballots in it."""
    values = _config().to_dict()
    assert values["ballot"] == dataclasses.asdict(_config().ballot_layout().noise_pool)
    values["ballot"] = {**values["ballot"], figure: values["ballot"][figure] + 1}
    with pytest.raises(ConfigError, match="ballot figures .* are not the .* this party derives"):
        VotingConfig.from_dict(values)
    del values["ballot"]
    with pytest.raises(ConfigError, match="malformed"):
        VotingConfig.from_dict(values)


def test_a_label_threshold_the_quorum_can_reach_survives_narrowing_the_run_to_the_hospitals_that_joined():
    config = _config(voting=VotingSettings("knn-dpfl", noise_std=15.0, quorum=2, neighbours=30), label_threshold=60)
    assert dataclasses.replace(config, hospitals=config.hospitals[:2]).label_threshold == 60
    with pytest.raises(ConfigError, match="between 0 and 60 votes"):
        _config(voting=config.voting, label_threshold=61)


def test_the_field_holds_every_total_checked_ballots_can_make():
    config = _config()
    layout = config.ballot_layout()
    assert layout.votes_per_query == 30 and layout.noise_range > 0  # k = 30 votes on one class, and the noise
    assert config.totals_bound() == 3 * (30 + layout.noise_range)
    assert config.field().holds(config.totals_bound()) and layout.energy_bound < config.field().modulus


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"talliers": ("tallier-1", "tallier-2")}, "at least 3 distinct talliers"),
        ({"talliers": ("tallier-1", "tallier-2", "tallier-3", "tallier-4")}, "an odd number of talliers"),
        ({"reveal": "everything"}, "unknown reveal mode"),
        ({"label_threshold": 91}, "label threshold must be between 0 and 90 votes"),  # a quorum of 3 x 30 neighbours
        ({"label_threshold": -1}, "label threshold must be between 0 and 90 votes"),
        ({"voting": VotingSettings("knn-dpfl", noise_std=15.0, quorum=4, neighbours=30)}, "exceeds the 3 hospitals"),
        ({"rounds": 2_000_000}, "between 1 and 1000000"),
        ({"queries_per_round": 10**6}, "queries per round must be between 1 and 10000"),
        ({"teacher_epochs": 10**6}, "teacher epochs must be between 1 and 1000"),
        ({"feature_dimensions": 0}, "feature dimensions must be between 1 and 1024"),
        ({"model": ModelSpec("mlp", (64,), 60_000)}, "over 60000 classes is too large"),
        ({"model": ModelSpec("mlp", (64,), 10, hidden=(5000,))}, "at most 8 hidden layers of at most 4096 units"),
        (
            {"voting": VotingSettings("knn-dpfl", noise_std=15.0, quorum=3, neighbours=10**9)},
            "at most 32 are supported",
        ),
    ],
)
def test_a_run_that_cannot_be_run_is_refused_before_anything_runs(changes, reason):
    with pytest.raises(ConfigError, match=reason):
        _config(**changes)


@pytest.mark.parametrize(
    "change",
    [
        {"voting": {"method": "knn-dpfl"}},
        {"rounds": "two"},
        {"rounds": 2.9},
        {"label_threshold": True},
        {"hospitals": "hospital-1"},
        {"extra": 1},
        {"voting": {"method": "knn-dpfl", "noise_std": True, "quorum": 3, "neighbours": 1}},
        {"voting": {"method": "knn-dpfl", "noise_std": 1e160, "quorum": 3, "neighbours": 1}},
        {"delta": float("inf")},
    ],
)
def test_a_malformed_configuration_is_a_config_error(change):
    values = {**_config().to_dict(), **change}
    with pytest.raises(ConfigError, match="malformed|delta must be"):
        VotingConfig.from_dict(values)
