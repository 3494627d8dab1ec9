"""The library under the launchers: a run specification, its command line, its defaults and its privacy plan."""

from dataclasses import replace

import pytest

from consilium.orchestration import spec as run_spec
from consilium.orchestration.planning import check_first_round, least_noise_multiplier, planned_epsilons, planned_run
from consilium.orchestration.spec import RunSpec, resolve
from consilium.protocol.run.rules import ConfigError
from consilium.scripts import federation, hospital


@pytest.mark.parametrize(
    "spec",
    [
        RunSpec(),
        RunSpec(
            method="dp-fedavg",
            hospitals=4,
            hidden=(16, 8),
            budget_view="peer_hospital",
            flags={"subclients": 2, "clip_quantile": 0.5},
        ),
        RunSpec(method="dopamine", hidden=(), insecure_plaintext_benchmark=True, send_offset=0.0, rounds=7),
        RunSpec(method="knn-dpfl", hospitals_per_process=3, talliers=4, flags={"reveal": "histogram"}),
    ],
)
def test_a_spec_s_command_line_parses_back_to_the_same_spec(spec):
    parsed = RunSpec.from_values(vars(federation.build_parser().parse_args(spec.argv())))
    assert parsed == spec


def test_a_flag_no_method_reads_or_another_method_s_flag_is_refused():
    with pytest.raises(ConfigError, match="no method reads the flag"):
        RunSpec(flags={"noise": 1.0})
    with pytest.raises(ConfigError, match="--subclients is for dp-fedavg runs, not dopamine"):
        resolve(RunSpec(flags={"subclients": 2}))


def test_resolving_fills_in_the_method_s_and_the_data_s_defaults_and_proposes_b():
    spec, data = resolve(RunSpec(hospitals=5))
    assert (spec.data, spec.rounds, spec.epsilon_budget, spec.model) == ("breast_cancer", 100, 3.0, "mlp")
    assert spec.flags["lr"] == 0.05 and spec.flags["noise_multiplier"] == 2.3
    assert spec.expected_batch_size == round(0.1 * len(data.train) / 5, 1)
    assert resolve(RunSpec(expected_batch_size=7.0))[0].expected_batch_size == 7.0  # a stated B is kept
    assert resolve(RunSpec(method="knn-dpfl"))[0].data == "digits"


def test_the_least_noise_multiplier_is_within_the_target_and_the_data_are_loaded_once(monkeypatch):
    loads = []
    load = run_spec.load_dataset
    monkeypatch.setattr(run_spec, "load_dataset", lambda *a, **k: loads.append(a) or load(*a, **k))
    spec = RunSpec(rounds=50, epsilon_budget=1e9)
    sigma = least_noise_multiplier(spec, 2.0, precision=1e-3)
    assert len(loads) == 1
    assert planned_epsilons(spec.with_flags(noise_multiplier=sigma))["server"] <= 2.0
    assert planned_epsilons(spec.with_flags(noise_multiplier=sigma / 1.002))["server"] > 2.0
    peer = least_noise_multiplier(spec, 2.0, view="peer_hospital")
    assert peer > sigma  # a fellow hospital sees one share of noise fewer


def test_planning_is_for_methods_with_a_ledger():
    with pytest.raises(ConfigError, match="knn-dpfl does not run over the secure round"):
        planned_epsilons(RunSpec(method="knn-dpfl"))


def test_the_budget_binds_on_the_coalition_by_default_and_on_the_view_an_operator_names():
    """Of 5 hospitals (tau = 3) two may work with the server: they remove two shares, one more than a peer."""
    spec = RunSpec(hospitals=5, rounds=1, epsilon_budget=1e9)
    first_round = planned_epsilons(spec)
    assert first_round["server"] < first_round["peer_hospital"] < first_round["coalition"] < first_round["collusion"]
    between = replace(spec, epsilon_budget=(first_round["peer_hospital"] + first_round["coalition"]) / 2)
    resolved, data = resolve(between)
    with pytest.raises(ConfigError, match="epsilon against the coalition"):
        check_first_round(resolved, data, [100] * 5)
    check_first_round(replace(resolved, budget_view="peer_hospital"), data, [100] * 5)
    assert hospital._BUDGET.view == RunSpec().budget_view == "coalition"


def test_a_target_epsilon_sets_the_noise_and_the_budget_and_is_refused_where_it_cannot_hold():
    spec, data = resolve(RunSpec(rounds=5, target_epsilon=2.0))
    assert spec.epsilon_budget == 2.0  # the budget, where none is given, is the target
    calibrated_spec, plan = planned_run(spec, data)
    sigma = calibrated_spec.flags["noise_multiplier"]
    spent = planned_epsilons(calibrated_spec)
    assert 0.98 * 2.0 <= spent["coalition"] <= 2.0 and "calibrated to epsilon 2 against the server" in plan
    assert planned_epsilons(calibrated_spec.with_flags(noise_multiplier=sigma / 1.002))["coalition"] > 2.0
    for wrong, error in (
        (RunSpec(method="knn-dpfl", target_epsilon=2.0), "not of knn-dpfl"),
        (RunSpec(method="central-dp", target_epsilon=2.0), "not of central-dp"),
        (RunSpec(target_epsilon=2.0).with_flags(noise_multiplier=1.0), "not both"),
        (RunSpec(target_epsilon=2.0, epsilon_budget=1.0), "is over --epsilon-budget 1"),
    ):
        with pytest.raises(ConfigError, match=error):
            resolve(wrong)
