"""A training method added as docs/how-to/add-a-training-method.md says: one module and one registry line, run through a real federation.

The toy method is Dopamine's step without momentum, under a name of its own. It lives in a module
written to this test's folder, outside the project; a ``sitecustomize`` there holds the one
registry line, so that every process of the federation (each loads its own code: none travels)
knows the method.
"""

import json

import pytest

from conftest import REPO, run_launcher

pytestmark = pytest.mark.slow

TOY_METHOD = '''
from dataclasses import dataclass
from typing import Any, ClassVar

from consilium.training.methods.dopamine import DopamineSettings
from consilium.training.methods.flags import Flag


@dataclass(frozen=True)
class PlainDpSgdSettings(DopamineSettings):
    """Dopamine's noisy step with no momentum."""

    METHOD: ClassVar[str] = "plain-dp-sgd"
    FLAGS: ClassVar[tuple[Flag, ...]] = tuple(f for f in DopamineSettings.FLAGS if f.name != "--momentum")
    DEFAULTS: ClassVar[dict[str, Any]] = {"rounds": 3, "epsilon_budget": 10.0}

    @classmethod
    def from_flags(cls, values, *, quorum):
        return cls(
            sample_rate=values.sample_rate,
            noise_multiplier=values.noise_multiplier,
            max_grad_norm=values.max_grad_norm,
            quorum=quorum,
            expected_batch_size=values.expected_batch_size,
            learning_rate=values.lr,
            momentum=0.0,
        )
'''
REGISTRY_LINE = "import toy_method, consilium.training.methods.registry as methods; methods.register_method(toy_method.PlainDpSgdSettings)\n"


def test_a_method_in_one_module_and_one_registry_line_trains_through_a_real_federation(tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "toy_method.py").write_text(TOY_METHOD)
    (plugins / "sitecustomize.py").write_text(REGISTRY_LINE)
    environment = {"PYTHONPATH": f"{plugins}:{REPO}"}

    shown = run_launcher("federation", "--help", environment=environment)
    assert shown.returncode == 0, shown.stderr
    assert "plain-dp-sgd" in shown.stdout

    refused = run_launcher("federation", "--method", "plain-dp-sgd", "--momentum", "0.5", environment=environment)
    assert refused.returncode == 2 and "--momentum is for dopamine" in refused.stderr, refused.stderr

    out = tmp_path / "run"
    result = run_launcher(
        "federation",
        *("--method", "plain-dp-sgd", "--out", out, "--hidden", "4", "--expected-batch-size", "15"),
        environment=environment,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["training"]["method"] == "plain-dp-sgd"
    assert report["config"]["training"]["momentum"] == 0.0
    assert report["final"]["rounds_released"] == 3
    assert len([line for line in result.stdout.splitlines() if line.startswith("round ")]) == 3
    assert report["final"]["epsilon"]["server"] > 0


def test_a_method_is_registered_once_under_a_free_name_and_shared_flags_keep_their_type():
    from consilium.training.methods.dopamine import DopamineSettings
    from consilium.training.methods.flags import Flag
    from consilium.training.methods.registry import METHODS, register_method

    register_method(DopamineSettings)  # the same class again changes nothing

    class Impostor(DopamineSettings):
        pass

    class Baseline(DopamineSettings):
        METHOD = "central"

    class OtherType(DopamineSettings):
        METHOD = "other-type"
        FLAGS = (Flag("--lr", str, "fast", "a learning rate by name"),)

    for settings in (Impostor, Baseline):
        with pytest.raises(ValueError, match="registered already"):
            register_method(settings)
    with pytest.raises(ValueError, match="--lr with another type"):
        register_method(OtherType)
    with pytest.raises(TypeError):
        METHODS["dopamine"] = Impostor  # the registry is read-only but for register_method
    assert METHODS["dopamine"] is DopamineSettings and "other-type" not in METHODS
