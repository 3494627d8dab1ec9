import copy
import math

import numpy as np
import pytest
import torch
from opacus import PrivacyEngine
from randomgen import ChaCha
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from scipy.stats import skellam

from consilium.training.data.datasets import load_dataset
from consilium.training.methods.dopamine import DopamineSettings, NoisyGradientStep, mean_gradient
from consilium.training.methods.update_rules import MomentumUpdate
from consilium.training.models.build import build_model, get_flat_parameters, input_statistics, set_flat_parameters
from consilium.training.models.spec import ModelSpec
from consilium.training.privacy.secure_random import secure_generator, uniform
from consilium.training.privacy.skellam import SkellamMechanism

SETTINGS = dict(max_grad_norm=1.5, quorum=3, expected_batch_size=12.0, learning_rate=0.1, momentum=0.9)


def _model(hidden=(8,), inputs=30):
    return build_model(ModelSpec("mlp", (inputs,), 2, hidden))


def _data(n=200, seed=0, inputs=30):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, inputs)).astype(np.float32) * 5, rng.integers(0, 2, n)


def test_the_sum_of_zero_updates_has_the_law_the_accountant_assumes():
    """Empty batches: each share is Sk(mu) noise, and K shares sum to integers distributed as Sk(K mu)."""
    settings = DopamineSettings(sample_rate=1e-12, noise_multiplier=0.05, **SETTINGS)
    steps = [NoisyGradientStep(_model(hidden=(), inputs=2), *_data(inputs=2, seed=k), settings) for k in range(3)]
    mechanism = steps[0].mechanism
    sums = np.concatenate([sum(step()[0] for step in steps) for _ in range(3000)])
    assert sums.dtype.kind == "i" and sums.size == 3000 * mechanism.dimension
    mu = mechanism.mu(contributors=3)
    assert 5 < mu < 50  # small enough that the pmf is checkable point by point
    assert np.var(sums) == pytest.approx(2 * mu, rel=0.05)
    values, counts = np.unique(sums, return_counts=True)
    support = np.arange(values.min(), values.max() + 1)
    empirical = np.zeros(support.size)
    empirical[values - support[0]] = counts / sums.size
    total_variation = 0.5 * (
        np.abs(empirical - skellam.pmf(support, mu, mu)).sum()
        + skellam.sf(support[-1], mu, mu)
        + skellam.cdf(support[0] - 1, mu, mu)
    )
    assert total_variation < 0.03


def test_rounding_is_unbiased_and_every_example_stays_within_the_sensitivity():
    mechanism = SkellamMechanism.calibrate(dimension=50, max_grad_norm=1.0, noise_multiplier=1.0, quorum=1)
    rng = np.random.default_rng(3)
    example = rng.normal(size=50)
    example /= np.linalg.norm(example)  # on the clipping sphere: the largest allowed
    generator = secure_generator()
    rounded = np.array([mechanism.round_examples(example[None], generator) for _ in range(4000)])
    norms = np.linalg.norm(rounded, axis=1)
    assert norms.max() <= mechanism.l2_sensitivity
    assert np.abs(rounded).sum(axis=1).max() <= mechanism.l1_sensitivity
    assert np.allclose(rounded.mean(axis=0), mechanism.scale * example, atol=0.05)
    assert mechanism.l2_sensitivity <= 1.01 * mechanism.scale


def test_without_noise_the_share_is_the_rounded_clipped_sum():
    settings = DopamineSettings(sample_rate=1.0, noise_multiplier=0.0, **SETTINGS)
    x, y = _data(n=20)
    model = _model()
    reference = _model()
    set_flat_parameters(reference, get_flat_parameters(model))
    step = NoisyGradientStep(model, x, y, settings)
    share, batch = step()
    assert batch == 20 and share.dtype.kind == "i"
    expected = torch.zeros(sum(p.numel() for p in reference.parameters()), dtype=torch.float64)
    for xi, yi in zip(torch.as_tensor(x), torch.as_tensor(y)):
        reference.zero_grad()
        torch.nn.functional.cross_entropy(reference(xi[None]), yi[None], reduction="sum").backward()
        g = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).double()
        expected += g * min(1.0, 1.5 / float(g.norm()))
    assert np.max(np.abs(share - step.mechanism.scale * expected.numpy())) < 20  # < 1 level per example
    gradient = mean_gradient(share, 1, mechanism=step.mechanism, settings=settings)
    assert np.allclose(gradient, expected.numpy() / 12.0, atol=20 / (step.mechanism.scale * 12.0))


def test_momentum_is_applied_to_the_mean_as_in_algorithm_1():
    settings = DopamineSettings(sample_rate=0.5, noise_multiplier=1.0, **SETTINGS)
    model = _model()
    w0 = get_flat_parameters(model)
    update = MomentumUpdate(model, learning_rate=settings.learning_rate, momentum=settings.momentum)
    g1, g2 = np.random.default_rng(0).normal(size=(2, w0.size)).astype(np.float32)
    update.apply(g1)
    update.apply(g2)
    expected = w0 - 0.1 * g1 - 0.1 * (0.9 * g1 + g2)
    assert np.allclose(get_flat_parameters(model), expected, atol=1e-6)
    with pytest.raises(ValueError, match="expected a gradient of"):
        update.apply(g1[:-1])


def test_momentum_carried_over_continues_the_same_trajectory():
    """What a restarted server hands a rejoining hospital: its model and m, from which it steps alike."""
    settings = DopamineSettings(sample_rate=0.5, noise_multiplier=1.0, **SETTINGS)
    g1, g2 = np.random.default_rng(0).normal(size=(2, get_flat_parameters(_model()).size)).astype(np.float32)
    model = _model()
    update = MomentumUpdate(model, learning_rate=settings.learning_rate, momentum=settings.momentum)
    assert not update.state().any()
    update.apply(g1)
    joined = _model()
    set_flat_parameters(joined, get_flat_parameters(model))
    carried = MomentumUpdate(joined, learning_rate=settings.learning_rate, momentum=settings.momentum)
    carried.load_state(update.state())
    update.apply(g2)
    carried.apply(g2)
    assert np.array_equal(get_flat_parameters(joined), get_flat_parameters(model))
    assert np.allclose(update.state(), 0.9 * g1 + g2)
    with pytest.raises(ValueError, match="expected a momentum of"):
        carried.load_state(g1[:-1])


@pytest.mark.parametrize(
    "generator",
    [
        torch.Generator(),
        np.random.default_rng(),
        np.random.Generator(np.random.PCG64(2**127)),
        np.random.Generator(ChaCha(rounds=8)),
    ],
    ids=["torch", "pcg64-default", "pcg64", "chacha8"],
)
def test_the_private_path_refuses_a_statistical_generator(generator):
    settings = DopamineSettings(sample_rate=0.1, noise_multiplier=1.0, **SETTINGS)
    with pytest.raises(TypeError, match="cryptographic generator"):
        NoisyGradientStep(_model(), *_data(), settings, generator=generator)


def test_the_private_path_draws_from_chacha20_with_a_256_bit_key():
    step = NoisyGradientStep(_model(), *_data(), DopamineSettings(sample_rate=0.1, noise_multiplier=1.0, **SETTINGS))
    state = step._generator.bit_generator.state["state"]
    assert isinstance(step._generator.bit_generator, ChaCha) and state["rounds"] == 20
    assert state["keysetup"].dtype == np.uint32 and state["keysetup"].size == 8  # 256 bits of key
    other = NoisyGradientStep(_model(), *_data(), DopamineSettings(sample_rate=0.1, noise_multiplier=1.0, **SETTINGS))
    assert not np.array_equal(state["keysetup"], other._generator.bit_generator.state["state"]["keysetup"])


def test_the_rounding_uniforms_are_chacha20_keyed_afresh_by_the_private_generator():
    generator = secure_generator()
    twin = copy.deepcopy(generator)
    drawn = uniform(generator, 1000)
    key = twin.bit_generator.random_raw(4).astype("<u8").tobytes()
    keystream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(8000))
    assert np.array_equal(drawn, (np.frombuffer(keystream, dtype="<u8") >> np.uint64(11)) * 2.0**-53)
    assert not np.array_equal(uniform(generator, 1000), drawn)  # a new key, hence a new stream, every call
    assert 0 <= drawn.min() and drawn.max() < 1
    with pytest.raises(TypeError, match="cryptographic generator"):
        uniform(np.random.default_rng(), 3)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="sample_rate"):
        DopamineSettings(sample_rate=0.0, noise_multiplier=1.0, **SETTINGS)
    with pytest.raises(ValueError, match="exactly"):
        DopamineSettings.from_dict({"sample_rate": 0.1})
    with pytest.raises(ValueError, match="per-example"):
        NoisyGradientStep(
            torch.nn.Sequential(torch.nn.BatchNorm1d(30), torch.nn.Linear(30, 2)),
            *_data(),
            DopamineSettings(sample_rate=0.1, noise_multiplier=1.0, **SETTINGS),
        )


# -- Dopamine learns what central DP-SGD learns ----------------------------------------------------

STEPS, SAMPLE_RATE, SIGMA, CLIP, LR, MOMENTUM = 80, 0.1, 1.0, 1.0, 0.1, 0.9


def _validation_loss(model, data) -> float:
    with torch.no_grad():
        x, y = torch.as_tensor(data.validation.x), torch.as_tensor(data.validation.y)
        return float(torch.nn.functional.cross_entropy(model(x), y))


def _opacus_central(data, initial) -> float:
    model = build_model(initial[0])
    set_flat_parameters(model, initial[1])
    dataset = torch.utils.data.TensorDataset(torch.as_tensor(data.train.x), torch.as_tensor(data.train.y))
    # Opacus samples at 1 / len(loader) and divides by that rate times the dataset size: choose the
    # batch size so that both are Dopamine's q and B (a batch of int(q N) would sample at 1/11 here).
    loader = torch.utils.data.DataLoader(dataset, batch_size=math.ceil(SAMPLE_RATE * len(dataset)))
    assert len(loader) == round(1 / SAMPLE_RATE)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        poisson_sampling=True,
    )
    steps = 0
    while steps < STEPS:
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps += 1
            if steps == STEPS:
                break
    return _validation_loss(model._module, data)


def _dopamine(data, initial, hospitals: int) -> float:
    """Each hospital keeps its own copy of the model and applies the same decrypted mean, as in a run."""
    models = [build_model(initial[0]) for _ in range(hospitals)]
    for model in models:
        set_flat_parameters(model, initial[1])
    parts = np.array_split(np.random.default_rng(0).permutation(len(data.train)), hospitals)
    settings = DopamineSettings(
        sample_rate=SAMPLE_RATE,
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        quorum=hospitals,
        expected_batch_size=SAMPLE_RATE * len(data.train) / hospitals,
        learning_rate=LR,
        momentum=MOMENTUM,
    )
    steps = [NoisyGradientStep(m, data.train.x[p], data.train.y[p], settings) for m, p in zip(models, parts)]
    updates = [
        MomentumUpdate(model, learning_rate=settings.learning_rate, momentum=settings.momentum) for model in models
    ]
    for _ in range(STEPS):
        total = sum(step()[0] for step in steps)  # what the hospitals decrypt
        mean = mean_gradient(total, hospitals, mechanism=steps[0].mechanism, settings=settings)
        for update in updates:
            update.apply(mean)
    return _validation_loss(models[0], data)


@pytest.mark.slow
def test_dopamine_reaches_the_validation_loss_of_opacus_central_dp_sgd():
    """Same q, sigma, C, lr, momentum and steps: one hospital or three, the loss is central DP-SGD's.

    The losses are noisy (sd about 0.015 at 0.24), so the tolerance is six standard errors of the
    difference of the means: equal means fail with probability about 1e-4 (Student's t, 10 degrees
    of freedom). A mean gradient divided by K twice ends at loss 0.62 and fails by a wide margin.
    """
    torch.set_num_threads(1)
    data = load_dataset("digits")
    mean, std = input_statistics(data.validation.x)
    spec = ModelSpec("mlp", data.input_shape, data.num_classes, (32,), mean, std)
    losses = {"opacus": [], 1: [], 3: []}
    for _ in range(6):
        initial = (spec, get_flat_parameters(build_model(spec)))
        losses["opacus"].append(_opacus_central(data, initial))
        for hospitals in (1, 3):
            losses[hospitals].append(_dopamine(data, initial, hospitals))
    central = losses["opacus"]
    for hospitals in (1, 3):
        ours = losses[hospitals]
        standard_error = math.sqrt((np.var(central, ddof=1) + np.var(ours, ddof=1)) / len(ours))
        assert abs(np.mean(ours) - np.mean(central)) < max(0.05 * np.mean(central), 6 * standard_error), losses


def test_diverged_gradients_are_an_error_not_a_hang():
    mechanism = SkellamMechanism.calibrate(dimension=4, max_grad_norm=1.0, noise_multiplier=1.0, quorum=1)
    with pytest.raises(ValueError, match="not finite"):
        mechanism.round_examples(np.array([[np.nan, 0, 0, 0]]), secure_generator())
    with pytest.raises(ValueError, match="could not be rounded"):
        mechanism.round_examples(np.array([[10.0, 0, 0, 0]]), secure_generator())  # far above C
