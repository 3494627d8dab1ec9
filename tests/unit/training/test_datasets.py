import numpy as np
import pytest

from conftest import SHARED_DATA
from consilium.training.data.datasets import DatasetError, load_dataset
from consilium.training.data.partition import PartitionError, partition


def test_builtin_breast_cancer_is_real_and_split_without_overlap():
    data = load_dataset("breast_cancer")
    assert data.input_shape == (30,) and data.num_classes == 2
    assert len(data.train) + len(data.validation) == 569
    assert len(data.validation) == 114
    assert data.train.x.dtype == np.float32 and data.train.y.dtype == np.int64
    rows = {row.tobytes() for row in data.train.x}
    assert not any(row.tobytes() in rows for row in data.validation.x)


def test_the_split_seed_is_what_every_party_must_share():
    a, b, c = (load_dataset("digits", split_seed=s) for s in (0, 0, 1))
    assert a.input_shape == (64,) and a.num_classes == 10 and a.train.x.max() <= 1.0
    assert np.array_equal(a.validation.y, b.validation.y)
    assert not np.array_equal(a.validation.x, c.validation.x)


def test_medmnist_and_keras_npz_files_load(tmp_path):
    rng = np.random.default_rng(0)
    images = lambda n: rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)  # noqa: E731
    np.savez(
        tmp_path / "med.npz",
        train_images=images(20),
        train_labels=rng.integers(0, 2, (20, 1)),
        val_images=images(5),
        val_labels=rng.integers(0, 2, (5, 1)),
        test_images=images(5),
        test_labels=rng.integers(0, 2, (5, 1)),
    )
    np.savez(
        tmp_path / "keras.npz", x_train=images(20), y_train=np.arange(20) % 10, x_test=images(5), y_test=np.arange(5)
    )
    med = load_dataset(str(tmp_path / "med.npz"))
    keras = load_dataset(str(tmp_path / "keras.npz"))
    assert med.input_shape == (1, 28, 28) and len(med.validation) == 5 and len(med.test) == 5
    assert keras.test is None  # its test split is the validation split
    assert keras.num_classes == 10 and 0.0 <= keras.train.x.min() and keras.train.x.max() <= 1.0


def test_bad_files_get_a_clear_error(tmp_path):
    with pytest.raises(DatasetError, match="no dataset file"):
        load_dataset(str(tmp_path / "missing.npz"))
    (tmp_path / "junk.npz").write_bytes(b"not a zip file")
    with pytest.raises(DatasetError, match="cannot read"):
        load_dataset(str(tmp_path / "junk.npz"))
    np.savez(tmp_path / "odd.npz", features=np.zeros((3, 2)))
    with pytest.raises(DatasetError, match="neither MedMNIST"):
        load_dataset(str(tmp_path / "odd.npz"))


@pytest.mark.skipif(not (SHARED_DATA / "pneumoniamnist.npz").exists(), reason="shared data not present")
def test_the_shared_pneumoniamnist_file_loads():
    data = load_dataset(str(SHARED_DATA / "pneumoniamnist.npz"))
    assert data.input_shape == (1, 28, 28) and data.num_classes == 2
    assert len(data.train) == 3882 and len(data.validation) == 524 and len(data.test) == 624


@pytest.mark.parametrize(
    "scheme, options", [("iid", {}), ("label_skew", {"classes_per_part": 6}), ("dirichlet", {"alpha": 0.3})]
)
def test_partitions_are_disjoint_complete_and_non_empty(scheme, options):
    labels = load_dataset("digits").train.y
    parts = partition(labels, 5, scheme, seed=3, **options)
    together = np.concatenate(parts)
    assert len(parts) == 5 and all(len(p) for p in parts)
    assert len(together) == len(set(together.tolist())) == len(labels)


def test_label_skew_gives_each_part_only_its_classes():
    labels = load_dataset("digits").train.y
    for part in partition(labels, 4, "label_skew", classes_per_part=6):
        assert len(np.unique(labels[part])) == 6


def test_impossible_partitions_are_refused():
    labels = np.repeat(np.arange(10), 5)
    with pytest.raises(PartitionError, match="leave classes"):
        partition(labels, 2, "label_skew", classes_per_part=2)
    with pytest.raises(PartitionError, match="non-empty"):
        partition(labels[:3], 5)
    with pytest.raises(PartitionError, match="unknown partition scheme"):
        partition(labels, 2, "round_robin")
