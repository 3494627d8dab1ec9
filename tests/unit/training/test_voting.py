import numpy as np
import pytest
import torch

from consilium.training.data.datasets import Split, load_dataset
from consilium.training.models.build import accuracy, build_model
from consilium.training.models.spec import ModelSpec
from consilium.training.voting.votes import (
    PcaFeatures,
    _jittered,
    knn_votes,
    noise_share,
    teacher_votes,
    train_classifier,
    train_student,
)
from consilium.training.voting.vote_privacy import NoisePool, VotingSettings
from consilium.training.privacy.secure_random import secure_generator


def test_knn_votes_count_the_labels_of_the_nearest_records():
    data = Split(x=np.array([[0.0], [1.0], [2.0], [10.0], [11.0]], dtype=np.float32), y=np.array([0, 0, 1, 2, 2]))
    queries = np.array([[0.4], [10.6], [1.5]], dtype=np.float32)
    votes = knn_votes(lambda x: x.astype(np.float64), data, queries, neighbours=2, classes=3)
    assert votes.tolist() == [[2, 0, 0], [0, 0, 2], [1, 1, 0]]  # the tie at 1.5 goes to the record listed first


def test_removing_a_record_moves_at_most_one_neighbour_in_and_one_out():
    """The record-level sensitivity of kNN-DPFL, on records with many ties in distance."""
    generator = np.random.default_rng()
    data = Split(x=generator.integers(0, 3, size=(60, 40)).astype(np.float32), y=generator.integers(0, 5, size=60))
    queries = generator.integers(0, 3, size=(30, 40)).astype(np.float32) + generator.normal(0, 1e-9, size=(30, 40))
    phi = PcaFeatures.fit(generator.random((50, 40)), dimensions=8)
    features = phi(data.x)  # each row alike in any batch: BLAS would sum in an order that depends on the batch
    assert all(np.array_equal(phi(data.x[i : i + 1]), features[i : i + 1]) for i in range(len(data)))
    votes = knn_votes(phi, data, queries, neighbours=7, classes=5)
    assert np.array_equal(
        votes, np.concatenate([knn_votes(phi, data, q[None], neighbours=7, classes=5) for q in queries])
    )
    for removed in range(len(data)):
        changed = knn_votes(
            phi, data.subset(np.delete(np.arange(len(data)), removed)), queries, neighbours=7, classes=5
        )
        assert np.abs(changed - votes).sum(axis=1).max() <= 2


def test_knn_needs_more_records_than_neighbours():
    data = Split(x=np.zeros((3, 2), dtype=np.float32), y=np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="this hospital has 3"):
        knn_votes(lambda x: x, data, np.zeros((1, 2)), neighbours=3, classes=2)


def test_votes_on_digits_mostly_agree_with_the_true_labels():
    digits = load_dataset("digits")
    public, private = digits.validation, digits.train
    phi = PcaFeatures.fit(public.x, dimensions=20)
    votes = knn_votes(phi, private, public.x, neighbours=5, classes=10)
    assert (votes.sum(axis=1) == 5).all()
    assert np.mean(votes.argmax(axis=1) == public.y) > 0.9
    spec = ModelSpec("mlp", digits.input_shape, 10, hidden=(32,))
    teacher = train_classifier(spec, private, epochs=20, seed=0)
    one_hot = teacher_votes(teacher, public.x, 10)
    assert (one_hot.sum(axis=1) == 1).all()
    assert np.mean(one_hot.argmax(axis=1) == public.y) > 0.9


def test_a_teacher_abstains_where_it_is_unsure():
    logits = np.array(
        [[5.0, 0.0, 0.0], [0.1, 0.0, 0.0], [0.0, 0.0, 4.0]], dtype=np.float32
    )  # softmax tops 0.99, 0.36, 0.96
    assert teacher_votes(torch.nn.Identity(), logits, 3, min_confidence=0.5).tolist() == [
        [1, 0, 0],
        [0, 0, 0],
        [0, 0, 1],
    ]
    assert teacher_votes(torch.nn.Identity(), logits, 3).sum() == 3


def test_the_student_learns_from_the_labelled_queries_and_the_rest_of_the_pool():
    digits = load_dataset("digits")
    spec = ModelSpec("mlp", digits.input_shape, 10, hidden=(32,))
    labelled, unlabelled = digits.train.subset(np.arange(300)), digits.train.x[300:]
    # The initialisation. Unseeded, 6 of 20 students fell below 80% with these 300 labels (at a constant
    # learning rate); from this one, 16 of 16 reached 85 to 89%, and later 8 of 8 reached 82 to 89% with
    # the pool and 87 to 88% without (the shuffling is still fresh each time): one full run in November 2026
    # scored exactly 80%, so the bar is 75%, far above chance (10%) and what a student that does not
    # learn from its labels scores.
    torch.manual_seed(0)
    student = train_student(spec, labelled, unlabelled, epochs=30)
    assert accuracy(student, digits.validation.x, digits.validation.y) > 0.75
    assert (
        accuracy(train_student(spec, labelled, unlabelled[:0], epochs=30), digits.validation.x, digits.validation.y)
        > 0.75
    )


def test_jitter_moves_each_image_by_its_own_small_map_and_only_images():
    generator = torch.Generator()
    generator.manual_seed(0)
    images = torch.zeros(64, 1, 28, 28)
    images[:, :, 10:18, 12:16] = 1.0  # a bar in the middle
    jittered = _jittered(images, generator)
    assert jittered.shape == images.shape and not torch.equal(jittered, images)
    assert len({tuple(image.flatten().tolist()) for image in jittered}) == 64  # a map of its own for each
    assert torch.allclose(jittered.sum(dim=(1, 2, 3)), images.sum(dim=(1, 2, 3)), rtol=0.3)  # moved, not lost
    flat = torch.full((4, 1, 28, 28), 0.25)
    assert torch.allclose(_jittered(flat, generator), flat)  # borders repeat: no black frame drawn in
    with pytest.raises(ValueError, match="jitter moves images"):
        train_classifier(ModelSpec("mlp", (64,), 10), load_dataset("digits").train, epochs=1, jitter=True)


def test_a_noise_share_is_a_skellam_pool_within_its_bounds_and_needs_the_cryptographic_generator():
    mechanism = VotingSettings(method="ae-dpfl", noise_std=10.0, quorum=2).mechanism(
        queries=3, classes=4, level="hospital"
    )

    def share(factor, radius, energy_cap):
        return noise_share(mechanism, NoisePool(factor, radius, energy_cap), generator=secure_generator())

    # Sk(mu) with 2 mu = sigma^2 / quorum = 50: the noise is there, at its variance, M Q C values.
    noise = np.concatenate([share(1, 100, 10**6) for _ in range(500)])
    assert noise.dtype == np.int64 and abs(noise.var() / 50 - 1) < 0.1 and abs(noise.mean()) < 0.5
    pooled = [share(4, 100, 10**6) for _ in range(200)]
    assert all(len(n) == 48 for n in pooled) and abs(np.concatenate(pooled).var() / 50 - 1) < 0.1
    # Drawn again where a value falls outside (about 6% of draws here) or the energy exceeds the cap (about 15%).
    bounded = [share(1, 20, 900) for _ in range(200)]
    assert all(np.abs(n).max() <= 20 and n @ n <= 900 for n in bounded)
    with pytest.raises(RuntimeError, match="8 draws of noise all missed their bounds"):
        share(1, 1, 0)
    with pytest.raises(TypeError, match="cryptographic generator"):
        noise_share(mechanism, NoisePool(1, 100, 10**6), generator=np.random.default_rng(0))


def test_the_feature_map_survives_the_wire_and_refuses_a_wrong_size():
    pool = np.random.default_rng().normal(size=(40, 8)).astype(np.float32)
    features = PcaFeatures.fit(pool, 3)
    restored = PcaFeatures.from_bytes(features.to_bytes(), features=8, dimensions=3)
    assert np.array_equal(restored(pool), features(pool))
    with pytest.raises(ValueError, match="has 192 bytes, got 256"):
        PcaFeatures.from_bytes(features.to_bytes(), features=8, dimensions=2)
    with pytest.raises(ValueError, match="not finite"):
        PcaFeatures.from_bytes(np.full(32, np.nan).tobytes(), features=8, dimensions=3)


def test_a_training_too_short_for_a_cycle_takes_adam_s_constant_steps():
    """One step (one epoch of one batch): a cycle would take it at a 25th of its peak, barely moving the model."""
    spec = ModelSpec("mlp", (4,), 2, hidden=(3,))
    data = Split(np.ones((1, 4), dtype=np.float32), np.array([1]))
    start = torch.nn.utils.parameters_to_vector(build_model(spec, seed=0).parameters())
    trained = train_classifier(spec, data, epochs=1, seed=0, one_cycle=True)
    moved = torch.nn.utils.parameters_to_vector(trained.parameters()) - start
    assert moved.abs().max().item() == pytest.approx(1e-3, rel=0.01)  # Adam's first step: the rate, each way
