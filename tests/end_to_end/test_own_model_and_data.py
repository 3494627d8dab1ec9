"""A hospital team's own model (a file outside the project) and own images (a folder), through real federations."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from conftest import run_launcher
from scripted import HospitalProcess, ServerProcess
from consilium.training.data.datasets import DatasetError, Split, load_dataset
from consilium.training.models.build import ModelError, build_model, check_model_for, describe_model, use_model_code
from consilium.training.models.spec import ModelSpec

OWN_RESNET = '''
"""A small ResNet with GroupNorm, as a hospital team would write its own."""
from torch import nn

WIDTH = {width}


class Block(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(2, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(2, channels)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(x + self.norm2(self.conv2(self.act(self.norm1(self.conv1(x))))))


def build(input_shape, num_classes, norm=None):
    return nn.Sequential(
        nn.Conv2d(input_shape[0], WIDTH, 3, padding=1),
        nn.GroupNorm(2, WIDTH) if norm is None else norm(WIDTH),
        nn.Tanh(),
        Block(WIDTH),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(WIDTH, num_classes),
    )


def build_with_batch_norm(input_shape, num_classes):
    return build(input_shape, num_classes, norm=nn.BatchNorm2d)
'''
CLASSES = {0: "zero", 1: "one", 2: "two"}


def own_resnet(folder: Path, width: int = 8) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "resnet_gn.py"
    path.write_text(OWN_RESNET.format(width=width))
    return path


def image_folder(root: Path, *, splits=("train", "val"), classes=CLASSES) -> Path:
    """Three digits' 8x8 images as PNG files in train/<class>/ and val/<class>/."""
    x, y = load_digits(return_X_y=True)
    for index, (pixels, label) in enumerate(zip(x, y)):
        if label in classes:
            split = splits[-1] if index % 5 == 0 else splits[0]
            folder = root / split / classes[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray((pixels.reshape(8, 8) * 16).clip(0, 255).astype(np.uint8)).save(folder / f"{index}.png")
    return root


@pytest.mark.slow
def test_a_model_in_a_file_of_one_s_own_trains_on_an_image_folder_through_a_real_federation(tmp_path):
    model = own_resnet(tmp_path / "elsewhere")
    data = image_folder(tmp_path / "images")
    out = tmp_path / "run"
    argv = ["--data", data, "--model", f"{model}:build", "--hospitals", "3", "--rounds", "3", "--out", out]
    result = run_launcher("federation", *argv)
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    spec = ModelSpec.from_dict(report["config"]["model"])
    assert (spec.architecture, spec.classes, spec.input_shape) == (
        "resnet_gn.py:build",
        ("one", "two", "zero"),
        (1, 8, 8),
    )
    assert spec.parameters == sum(
        p.numel() for p in build_model(describe_model(f"{model}:build", (1, 8, 8), 3)).parameters()
    )
    assert [r["status"] for r in report["rounds"]] == ["released"] * 3
    for name in (
        "hospital-1",
        "hospital-2",
        "hospital-3",
    ):  # each loaded its own copy of the code, named on its own command line
        assert "Traceback" not in (out / "logs" / f"{name}.log").read_text()


def test_a_model_with_batch_norm_gets_one_line_naming_the_layer_and_the_fix(tmp_path):
    model = own_resnet(tmp_path / "elsewhere")
    data = image_folder(tmp_path / "images")
    result = run_launcher(
        "federation", "--data", data, "--model", f"{model}:build_with_batch_norm", "--out", tmp_path / "run"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "layer 1 (BatchNorm2d) cannot be trained with DP-SGD" in line and "--fix-model replaces it" in line
    fixed = describe_model(f"{model}:build_with_batch_norm", (1, 8, 8), 3, fix=True)
    assert fixed.fix and fixed.digest == describe_model(f"{model}:build", (1, 8, 8), 3).digest  # GroupNorm, as written


@pytest.mark.slow
def test_a_hospital_whose_own_model_code_differs_from_the_run_s_refuses_it(tmp_path):
    """hospital-2 holds a wider copy of resnet_gn.py:build, hospital-3 was given no --model: both refuse in one line."""
    data = image_folder(tmp_path / "images")
    ours, theirs = own_resnet(tmp_path / "server-copy"), own_resnet(tmp_path / "other-copy", width=12)
    server = ServerProcess(tmp_path, 3, "--data", str(data), "--model", f"{ours}:build", "--rounds", "2")
    models = {
        "hospital-1": ["--model", f"{ours}:build"],
        "hospital-2": ["--model", f"{theirs}:build"],
        "hospital-3": [],
    }
    hospitals = {
        name: HospitalProcess(server.federation, name, index, 3, tmp_path / f"{name}.log", "--data", str(data), *extra)
        for index, (name, extra) in enumerate(models.items(), start=1)
    }
    try:
        for name, reason in (
            (
                "hospital-2",
                "hospital-2 refuses the run: the run's model resnet_gn.py:build is not what this party's code builds",
            ),
            (
                "hospital-3",
                "hospital-3 refuses the run: the run trains resnet_gn.py:build, a model of the operators' own code",
            ),
        ):
            assert hospitals[name].process.wait(timeout=120) == 2
            log = hospitals[name].log.read_text()
            assert reason in log and "Traceback" not in log, log
        assert hospitals["hospital-1"].process.poll() is None  # the one with the run's model takes part
    finally:
        for hospital in hospitals.values():
            hospital.kill()
        server.close()


def test_an_image_folder_s_mistakes_get_a_clear_error(tmp_path):
    root = image_folder(tmp_path / "images")
    data = load_dataset(str(root))
    assert data.classes == ("one", "two", "zero") and data.input_shape == (1, 8, 8) and data.test is None
    assert data.num_classes == 3 and 0.0 <= data.train.x.min() and data.train.x.max() <= 1.0
    resized = load_dataset(str(root), image_size=(12, 10), image_channels=3)
    assert resized.input_shape == (3, 12, 10)

    Image.new("L", (9, 9)).save(root / "train" / "one" / "odd.png")
    with pytest.raises(DatasetError, match=r"images of different sizes .* give --image-size"):
        load_dataset(str(root))
    (root / "train" / "two" / "broken.png").write_bytes(b"not an image")
    with pytest.raises(DatasetError, match="cannot read the image .*broken.png"):
        load_dataset(str(root), image_size=(8, 8))
    (root / "val" / "three").mkdir()
    with pytest.raises(DatasetError, match="has classes train/ does not: three"):
        load_dataset(str(root), image_size=(8, 8))
    with pytest.raises(DatasetError, match="no train/ folder"):
        load_dataset(str(tmp_path))
    empty = tmp_path / "empty"
    for name in CLASSES.values():
        (empty / "train" / name).mkdir(parents=True)
    with pytest.raises(DatasetError, match="the train split is empty"):
        load_dataset(str(empty))


def test_a_hospital_whose_class_folders_or_model_differ_from_the_run_s_is_told_which(tmp_path):
    """A hospital without a 'two' folder would number 'zero' as 1: the names are checked, not only the count. A
    hospital whose operator named a model of their own takes part in a run of that model only."""
    x, y = np.zeros((4, 1, 8, 8), np.float32), np.array([0, 1, 0, 1])
    mine = Split(x, y, ("one", "zero"))
    assert "the run's classes are one, two, zero" in mine.misfit((1, 8, 8), 3, ("one", "two", "zero"))
    assert "labels up to 1" in Split(x, y).misfit((1, 8, 8), 1)
    assert Split(x, y, ("one", "two", "zero")).misfit((1, 8, 8), 3, ("one", "two", "zero")) is None
    built_in = describe_model("cnn", (1, 28, 28), 3)
    records = Split(np.zeros((4, 1, 28, 28), np.float32), y)
    check_model_for(built_in, records, None)
    with pytest.raises(
        ModelError, match="the run trains cnn; this party was started with --model for resnet_gn.py:build"
    ):
        check_model_for(built_in, records, use_model_code(f"{own_resnet(tmp_path)}:build"))


def test_a_data_function_of_one_s_own_code_gives_arrays_or_torch_datasets(tmp_path):
    (tmp_path / "my_data.py").write_text(
        "import numpy as np, torch\n"
        "from torch.utils.data import TensorDataset\n"
        "def arrays():\n"
        "    x = np.random.default_rng(0).random((40, 5)).astype(np.float32)\n"
        "    return {'train': (x, np.arange(40) % 2), 'classes': ['no', 'yes']}\n"
        "def tensors():\n"
        "    x = torch.rand(30, 1, 6, 6)\n"
        "    return {'train': TensorDataset(x, torch.arange(30) % 3), 'val': TensorDataset(x[:9], torch.arange(9) % 3)}\n"
        "def wrong():\n"
        "    return [1, 2, 3]\n"
        "def failing():\n"
        "    raise RuntimeError('the archive is offline')\n"
    )
    arrays = load_dataset(f"{tmp_path}/my_data.py:arrays")
    assert (arrays.name, arrays.classes, len(arrays.train), len(arrays.validation)) == (
        "my_data.py:arrays",
        ("no", "yes"),
        32,
        8,
    )
    assert len(load_dataset(f"{tmp_path}/my_data.py:arrays", hold_out=False).train) == 40  # a hospital's own records
    tensors = load_dataset(f"{tmp_path}/my_data.py:tensors")
    assert tensors.input_shape == (1, 6, 6) and tensors.num_classes == 3 and len(tensors.validation) == 9
    with pytest.raises(DatasetError, match="must return a mapping with train"):
        load_dataset(f"{tmp_path}/my_data.py:wrong")
    with pytest.raises(DatasetError, match="failed: RuntimeError: the archive is offline"):
        load_dataset(f"{tmp_path}/my_data.py:failing")
    with pytest.raises(DatasetError, match="has no function missing"):
        load_dataset(f"{tmp_path}/my_data.py:missing")


def test_a_model_s_digest_covers_its_layout_and_an_announced_name_is_never_imported(tmp_path):
    model = own_resnet(tmp_path / "a")
    spec = describe_model(f"{model}:build", (1, 8, 8), 3)
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    use_model_code(f"{own_resnet(tmp_path / 'b', width=10)}:build")  # the same name, another definition
    with pytest.raises(ModelError, match="not what this party's code builds"):
        build_model(spec)
    for announced in ("os:system", "../../etc/passwd.py:x", "x" * 300 + ":f"):  # never loaded: refused or unknown
        with pytest.raises(ValueError):
            build_model(ModelSpec.from_dict({**spec.to_dict(), "architecture": announced}))
    with pytest.raises(ValueError, match="fix must be true or false"):
        ModelSpec.from_dict({**spec.to_dict(), "fix": "yes"})
