"""DP-FedAvg's secure-round share, its two privacy levels, and the server optimizers every party applies."""

import numpy as np
import pytest

from consilium.training.privacy.ledger import PrivacyLedger
from consilium.training.data.datasets import Split
from consilium.training.methods.adaptive_clipping import COUNT_SLOT_WEIGHT
from consilium.training.methods.dp_fedavg import DpFedAvgSettings, SubclientStep
from consilium.training.methods.fedavg import FedAvgError, clip_update, local_update
from consilium.training.methods.intermediaries import NORM_SLOT_WEIGHT, expected_noise_norm, next_subclient_count
from consilium.training.methods.registry import SharedState, ledger_release, settings_from_dict
from consilium.training.models.build import build_model, get_flat_parameters, set_flat_parameters
from consilium.training.models.spec import ModelSpec
from consilium.training.privacy.secure_random import secure_generator
from consilium.training.methods.update_rules import FedAdamUpdate

SETTINGS = dict(
    noise_multiplier=1.0,
    max_update_norm=0.5,
    quorum=3,
    subclients=2,
    local_epochs=1,
    local_batch_size=8,
    local_learning_rate=0.5,
    local_optimizer="sgd",
    server_optimizer="fedavg",
    server_learning_rate=1.0,
)


def _settings(**changes) -> DpFedAvgSettings:
    """The settings with ``changes``; v fixed unless the changes make it adaptive."""
    values = {**SETTINGS, "subclient_rule": "fixed", **changes}
    values.setdefault("max_subclients", values["subclients"])
    return DpFedAvgSettings(**values)


def _data(records: int = 40) -> Split:
    rng = np.random.default_rng(0)
    return Split(rng.normal(size=(records, 4)).astype(np.float32), rng.integers(0, 2, records))


def _model():
    return build_model(ModelSpec("mlp", (4,), 2, (6,)))


def _epsilon(release, rounds: int) -> float:
    ledger = PrivacyLedger()
    ledger.begin_run("0123abcd", "fingerprint")
    for number in range(1, rounds + 1):
        ledger.record(release, run_id="0123abcd", round_number=number)
    return ledger.epsilon(1e-5)


@pytest.mark.parametrize("dimension", [100, 100_000])
@pytest.mark.parametrize("z, v", [(4.0, 2), (3.0, 3)])
def test_hospital_level_epsilon_is_the_subclient_epsilon_at_z_over_v(dimension, z, v):
    """A hospital's v sub-clients move the sum by v times the sensitivity: for the Skellam as for the
    Gaussian, the privacy of noise multiplier z / v (to the Skellam's rounding terms)."""
    split = _settings(noise_multiplier=z, subclients=v)
    hospital = split.levels(split.mechanism(dimension), 3, 1)["hospital"]
    unsplit = _settings(noise_multiplier=z / v, subclients=1)
    subclient_at_z_over_v = unsplit.levels(unsplit.mechanism(dimension), 3, 1)["subclient"]
    for rounds in (1, 30):
        assert _epsilon(hospital, rounds) == pytest.approx(_epsilon(subclient_at_z_over_v, rounds), rel=1e-4)
    assert _epsilon(split.levels(split.mechanism(dimension), 3, 1)["subclient"], 30) < _epsilon(hospital, 30) / 2


@pytest.mark.parametrize("v, group", [(1, 2), (2, 2), (3, 3)])
def test_a_hospital_s_ledger_is_charged_for_its_sub_clients_and_for_any_one_record(v, group):
    """A hospital's v sub-clients move together; one record moves its sub-client's update from r to
    r', by up to twice the sensitivity: the ledger's charge covers both."""
    settings = _settings(subclients=v)
    mechanism = settings.mechanism(62)
    levels = settings.levels(mechanism, 3, 1)
    charged = ledger_release(settings, mechanism, 3, 1)
    assert charged == levels["hospital"]
    assert charged.l2_sensitivity == pytest.approx(group * mechanism.l2_sensitivity)
    assert charged.l1_sensitivity == pytest.approx(group * mechanism.l1_sensitivity)
    assert levels["record"].l2_sensitivity == pytest.approx(2 * mechanism.l2_sensitivity)
    assert levels["subclient"].l2_sensitivity == pytest.approx(mechanism.l2_sensitivity)


def test_a_noiseless_share_is_the_sum_of_the_clipped_sub_client_updates():
    model, data = _model(), _data()
    before = get_flat_parameters(model)
    # One sub-client, one full batch: its update is -lr times the gradient on all records, clipped.
    whole = _settings(noise_multiplier=0.0, subclients=1, local_batch_size=len(data))
    expected, _ = clip_update(
        local_update(model, data, whole.local_training, secure_generator()), whole.max_update_norm
    )
    step = SubclientStep(model, data, whole, secure_generator())
    share, rows = step()
    assert rows == 1
    assert np.abs(share / step.mechanism.scale - expected).max() <= 1 / step.mechanism.scale  # randomized rounding
    # Four sub-clients: four clipped updates, at most Delta_2 each once rounded.
    step = SubclientStep(model, data, _settings(noise_multiplier=0.0, subclients=4), secure_generator())
    share, rows = step()
    assert rows == 4 and np.linalg.norm(share) <= 4 * step.mechanism.l2_sensitivity
    np.testing.assert_array_equal(get_flat_parameters(model), before)  # the global model is left alone


def test_the_decrypted_sum_is_read_as_minus_the_mean_update():
    settings = _settings(subclients=2)
    mechanism = settings.mechanism(3)
    total = np.array([10.0, -4.0, 0.0]) * mechanism.scale * 2 * 3
    np.testing.assert_allclose(settings.read_sum(total, 3, 3), [-10.0, 4.0, 0.0], rtol=1e-6)


def test_fedavg_adds_the_scaled_mean_update():
    model = _model()
    start = get_flat_parameters(model)
    update = np.linspace(-1, 1, start.size).astype(np.float32)
    _settings(server_learning_rate=0.5).update_rule(model).apply(-update)
    np.testing.assert_allclose(get_flat_parameters(model), start + 0.5 * update, atol=1e-6)


def test_fedadam_follows_reddi_et_al_and_carries_its_state_exactly():
    model, joined = _model(), _model()
    theta = get_flat_parameters(model).astype(np.float64)
    rule = FedAdamUpdate(model, learning_rate=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    rng = np.random.default_rng(1)
    u1, u2, u3 = (rng.normal(size=theta.size) for _ in range(3))
    m, s = np.zeros_like(theta), np.zeros_like(theta)
    for u in (u1, u2):
        m, s = 0.9 * m + 0.1 * u, 0.99 * s + 0.01 * u**2
        theta = theta + 0.1 * m / (np.sqrt(s) + 1e-3)
        rule.apply(-u)
    np.testing.assert_allclose(get_flat_parameters(model), theta, rtol=1e-4, atol=1e-5)
    # A party that joins now takes the model and the state, and moves exactly as the others do.
    set_flat_parameters(joined, get_flat_parameters(model))
    carried = FedAdamUpdate(joined, learning_rate=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    carried.load_state(rule.state())
    rule.apply(-u3)
    carried.apply(-u3)
    np.testing.assert_array_equal(get_flat_parameters(joined), get_flat_parameters(model))
    with pytest.raises(ValueError, match="FedAdam's moments"):
        carried.load_state(rule.state()[:-1])
    with pytest.raises(ValueError, match="second moment must be non-negative"):
        carried.load_state(-rule.state())


def test_settings_survive_the_run_configuration_and_nonsense_is_refused():
    settings = _settings(server_optimizer="fedadam")
    assert settings_from_dict(settings.to_dict()) == settings
    with pytest.raises(ValueError, match="unknown training method 'fedsgd'"):
        settings_from_dict({**settings.to_dict(), "method": "fedsgd"})
    with pytest.raises(ValueError, match="exactly"):
        settings_from_dict({k: v for k, v in settings.to_dict().items() if k != "subclients"})
    for name, value in (("subclients", True), ("quorum", 2.9), ("local_epochs", float("inf")), ("server_optimizer", 1)):
        with pytest.raises(ValueError, match=f"{name} must be"):
            settings_from_dict({**settings.to_dict(), name: value})
    with pytest.raises(FedAvgError, match="limited to 100 epochs"):
        _settings(local_epochs=10**12)
    with pytest.raises(FedAvgError, match="server learning rate must be in"):
        _settings(server_learning_rate=1e39)
    with pytest.raises(FedAvgError, match="unknown server optimizer 'fedprox'"):
        _settings(server_optimizer="fedprox")
    with pytest.raises(FedAvgError, match="unknown local optimizer 'lbfgs'"):
        _settings(local_optimizer="lbfgs")


def test_more_sub_clients_than_records_is_refused_before_training():
    with pytest.raises(FedAvgError, match="v = 41 sub-clients from 40 records: more sub-clients than records"):
        SubclientStep(_model(), _data(40), _settings(subclients=41))


def _adaptive(**changes) -> DpFedAvgSettings:
    return _settings(subclient_rule="adaptive", max_subclients=6, **changes)


def test_with_adaptive_v_each_row_carries_its_weighted_norm_within_the_calibrated_sensitivity():
    model, data = _model(), _data()
    bound = 0.01  # below every sub-client update's norm here: each is clipped, and the norms sum to 4 C
    settings = _adaptive(noise_multiplier=0.0, subclients=4, max_update_norm=bound)
    step = SubclientStep(model, data, settings, secure_generator())
    dimension = get_flat_parameters(model).size
    assert step.mechanism == _settings(
        noise_multiplier=0.0, max_update_norm=bound * np.hypot(1, NORM_SLOT_WEIGHT)
    ).mechanism(dimension + 1)
    share, rows = step()
    assert rows == 4
    released = settings.read_sum(share, 1, dimension)
    rounding = 4 / step.mechanism.scale  # at most one level per row and coordinate
    assert released[-1] == pytest.approx(4 * bound, abs=rounding / NORM_SLOT_WEIGHT)
    assert (
        np.linalg.norm(released[:-1]) <= bound + rounding * np.sqrt(dimension) / 4
    )  # the mean of four clipped updates


def test_adaptive_v_is_re_estimated_from_the_released_norm_sum_and_public_values_alone():
    settings = _adaptive(noise_multiplier=2.0, subclients=2)
    model = _model()
    shared = SharedState(settings, model)
    mechanism = shared.mechanism
    dimension = mechanism.dimension - 1
    sigma = np.sqrt(2 * 3 * mechanism.share_mu) / mechanism.scale / (2 * 3)  # on the mean of v K_c = 6 updates
    for norm_sum, expected in ((1e6, 1), (-1.0, 6)):
        shared = SharedState(settings, model)
        released = np.concatenate([np.zeros(dimension), [norm_sum]]).astype("<f4")
        shared.apply(released, 3)
        assert shared.settings.subclients == expected
    norm_sum = 1.5
    want = next_subclient_count(
        2, hospitals=3, noise_norm=expected_noise_norm(sigma, dimension), update_norm_sum=norm_sum, most=6
    )
    shared = SharedState(settings, model)
    shared.apply(np.concatenate([np.zeros(dimension), [norm_sum]]).astype("<f4"), 3)
    assert shared.settings == settings.after_release(np.array([norm_sum]), 3, dimension)
    assert shared.settings.subclients == want and 1 < want < 6  # a value the bounds do not decide
    # The round state travels with the update rule's (a Welcome, a checkpoint) ...
    joined = SharedState(settings, _model())
    joined.load_state(shared.state())
    assert joined.settings == shared.settings and shared.state()[-1] == want
    # ... and what cannot be v is refused, leaving the state as it was.
    for bad in (0.0, 7.0, 2.5, np.nan, np.inf):
        state = shared.state()
        state[-1] = bad
        with pytest.raises(ValueError, match="not a whole number of sub-clients"):
            joined.load_state(state)
        assert joined.settings == shared.settings
    with pytest.raises(ValueError):
        joined.load_state(shared.state()[:-1])


def test_fixed_v_never_changes_and_has_no_round_state():
    settings = _settings(subclients=3)
    shared = SharedState(settings, _model())
    shared.apply(np.zeros(shared.mechanism.dimension, dtype="<f4"), 3)
    assert shared.settings == settings and settings.round_state() == {} and settings.statistic_slots == 0


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(subclients=3, max_subclients=2), "more than the most v may reach, 2"),
        (dict(subclients=2, max_subclients=4), "with fixed v, max_subclients must be v = 2"),
        (dict(subclient_rule="random"), "unknown sub-client rule 'random'"),
    ],
)
def test_impossible_sub_client_rules_are_refused(changes, message):
    with pytest.raises(FedAvgError, match=message):
        _settings(**changes)


def test_with_adaptive_v_every_round_is_charged_at_the_most_sub_clients_v_may_reach():
    """v follows the released data; a charge that did too would need a privacy filter. The charge is fixed instead."""
    adaptive = _adaptive(subclients=2)
    mechanism = adaptive.mechanism(62)
    for v in (1, 2, 6):
        charged = ledger_release(adaptive.with_round_state({"subclients": v}), mechanism, 3, 1)
        assert charged.l2_sensitivity == pytest.approx(6 * mechanism.l2_sensitivity)


def test_an_empty_sub_client_sends_a_zero_update():
    """With as many sub-clients as records, some come out empty (independent draws): their rows are zero, never NaN."""
    data = _data(5)
    assert not np.any(
        local_update(_model(), data.subset(np.array([], dtype=int)), _settings().local_training, secure_generator())
    )
    step = SubclientStep(
        _model(), data, _settings(noise_multiplier=0.0, subclients=5, subclient_rule="adaptive"), secure_generator()
    )
    for _ in range(20):  # an empty sub-client in most of them: P(none) = 5!/5^5, under 4%
        share, rows = step()
        assert rows == 5 and np.all(np.isfinite(share))


def _adaptive_clip(**changes) -> DpFedAvgSettings:
    return _settings(**{"clip_rule": "adaptive", "target_quantile": 0.5, "clip_learning_rate": 0.2, **changes})


def test_with_adaptive_clipping_each_row_says_whether_its_update_was_within_c_and_the_count_is_released():
    model, data = _model(), _data()
    dimension = get_flat_parameters(model).size
    for bound, within in ((1e-3, 0), (1e3, 4)):  # below every update's norm, then above
        settings = _adaptive_clip(noise_multiplier=0.0, subclients=4, max_update_norm=bound)
        step = SubclientStep(model, data, settings, secure_generator())
        # calibrated to the rows' bound, C sqrt(1 + beta^2 / 4): only the scale follows C
        bound = settings.max_update_norm  # in float32, as round state travels
        assert step.mechanism == _settings(
            noise_multiplier=0.0, max_update_norm=bound * np.hypot(1, COUNT_SLOT_WEIGHT / 2)
        ).mechanism(dimension + 1)
        share, rows = step()
        released = settings.read_sum(share, 1, dimension)
        assert rows == 4 and released[-1] == pytest.approx(
            within, abs=4 * 4 / (step.mechanism.scale * COUNT_SLOT_WEIGHT * bound)
        )


def test_adaptive_clipping_takes_the_geometric_step_toward_the_target_quantile_from_the_release_alone():
    settings = _adaptive_clip(noise_multiplier=2.0, subclients=2, max_update_norm=0.5)
    model = _model()
    dimension = get_flat_parameters(model).size
    for within, expected in (
        (6.0, 0.5 * np.exp(-0.2 * 0.5)),
        (0.0, 0.5 * np.exp(0.2 * 0.5)),
        (3.0, 0.5),
    ):  # of v K_c = 6
        shared = SharedState(settings, model)
        shared.apply(np.concatenate([np.zeros(dimension), [within]]).astype("<f4"), 3)
        assert shared.settings.max_update_norm == np.float32(expected)
        assert shared.settings.round_state() == {"max_update_norm": float(np.float32(expected))}
        joined = SharedState(settings, _model())  # C travels exactly, as float32, in a Welcome or a checkpoint
        joined.load_state(shared.state())
        assert joined.settings == shared.settings
    for bad in (0.0, -1.0, np.nan, np.inf, 1e9):
        state = shared.state()
        state[-1] = bad
        with pytest.raises(ValueError, match="is not a clipping bound"):
            joined.load_state(state)
        assert joined.settings == shared.settings


def test_adaptive_clipping_changes_neither_the_charge_nor_the_noise_in_levels():
    """Rows are calibrated to C_t: a round's C changes the scale gamma only, so every round is charged alike."""
    settings = _adaptive_clip(subclients=2, subclient_rule="adaptive", max_subclients=4)
    first = settings.mechanism(62)
    for bound in (1e-3, 0.5, 40.0):
        moved = settings.with_round_state({"subclients": 2, "max_update_norm": bound})
        mechanism = moved.mechanism(62)
        assert mechanism.scale * moved.max_update_norm == pytest.approx(first.scale * settings.max_update_norm)
        assert (mechanism.l2_sensitivity, mechanism.l1_sensitivity, mechanism.share_mu) == (
            first.l2_sensitivity,
            first.l1_sensitivity,
            first.share_mu,
        )
        assert ledger_release(moved, mechanism, 3, 1) == ledger_release(settings, first, 3, 1)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(clip_rule="median"), "unknown clipping rule 'median'"),
        (dict(clip_rule="adaptive", target_quantile=1.0), "target quantile in \\(0, 1\\)"),
        (dict(clip_rule="adaptive", clip_learning_rate=0.0), "learning rate in \\(0, 10\\]"),
    ],
)
def test_impossible_clipping_rules_are_refused(changes, message):
    with pytest.raises(FedAvgError, match=message):
        _settings(**changes)


def test_at_v_1_one_record_moves_a_hospital_s_share_by_up_to_twice_a_sub_client_s_sensitivity():
    """The record level's group of 2: a record added to a hospital of one sub-client leaves that
    sub-client in the sum but can turn its clipped update around, from r to about -r, so the share
    moves by nearly 2 Delta_2 (more than one sub-client's Delta_2, never more than twice it)."""
    x = np.full((1, 4), 3.0, dtype=np.float32)
    without = Split(x, np.array([0]))
    with_record = Split(np.concatenate([x, 4 * x]), np.array([0, 1]))  # its gradient outweighs and opposes the first's
    settings = _settings(noise_multiplier=0.0, subclients=1, max_update_norm=0.01, local_batch_size=2)
    moves = []
    for _ in range(5):
        shares = []
        for data in (without, with_record):
            model = build_model(ModelSpec("mlp", (4,), 2, ()))  # linear, from zero: the same start for both
            set_flat_parameters(model, np.zeros(get_flat_parameters(model).size, dtype=np.float32))
            step = SubclientStep(model, data, settings, secure_generator())
            shares.append(step()[0])
        moves.append(np.linalg.norm(shares[0] - shares[1]) / step.mechanism.l2_sensitivity)
    assert all(1.5 < move <= 2.0 for move in moves), moves


def test_adaptive_c_stays_a_bound_its_own_loader_accepts_whatever_the_count():
    """At either clamp, and with a count that noise or a hostile contributor's slot made absurd, the next C
    is a finite float32 bound that a Welcome or checkpoint carries back; each step stays the honest worst case."""
    model = _model()
    dimension = get_flat_parameters(model).size
    for start, count in ((2.0**-20, 6.0), (2.0**20, 0.0), (0.5, 1e30), (0.5, -1e30), (0.5, np.nan)):
        settings = _adaptive_clip(noise_multiplier=2.0, subclients=2, max_update_norm=start, clip_learning_rate=10.0)
        shared = SharedState(settings, model)
        shared.apply(np.concatenate([np.zeros(dimension), [count]]).astype("<f4"), 3)
        bound = shared.settings.max_update_norm
        assert 2.0**-20 <= bound <= 2.0**20 and 0.999 * np.exp(-5.0) <= bound / start <= 1.001 * np.exp(5.0), (
            start,
            count,
            bound,
        )
        joined = SharedState(settings, _model())
        joined.load_state(shared.state())
        assert joined.settings == shared.settings
    for start in (2e6, 4e-7, 1e39, 1e-50):  # a first C outside what travels is refused where the run is configured
        with pytest.raises(FedAvgError, match="is not a clipping bound"):
            _adaptive_clip(max_update_norm=start)
