"""A model spec says how many parameters its model has without building it, and reads without torch."""

import subprocess
import sys

import pytest

from consilium.training.models.build import build_model, parameter_count
from consilium.training.models.spec import ModelSpec


@pytest.mark.parametrize(
    "spec",
    [
        ModelSpec("mlp", (30,), 2, hidden=(48,)),
        ModelSpec("mlp", (64,), 10, hidden=(32, 16)),
        ModelSpec("cnn", (1, 28, 28), 10),
        ModelSpec("resnet18", (3, 32, 32), 10),
        ModelSpec("resnet18", (1, 28, 28), 2),
    ],
    ids=lambda spec: f"{spec.architecture}-{spec.input_shape}-{spec.num_classes}",
)
def test_the_parameter_count_a_spec_computes_is_the_built_model_s(spec):
    assert spec.parameter_count() == parameter_count(build_model(spec, seed=0))


def test_a_tallier_reads_a_run_and_its_model_spec_without_loading_torch():
    """A tallier only counts votes: loading torch would cost each of its processes most of its start."""
    code = (
        "import sys, consilium.scripts.tallier; "
        "from consilium.training.models.spec import ModelSpec; ModelSpec('resnet18', (3, 32, 32), 10); "
        "print(sorted(m for m in ('torch', 'opacus', 'sklearn') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]"
