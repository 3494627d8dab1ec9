"""consilium-compare: matched budgets, selection on validation, scores on test; a real federation and a baseline."""

import json

import numpy as np
import matplotlib.pyplot as plt
import pytest
from sklearn.datasets import load_digits

from conftest import run_launcher
from consilium.scripts import compare


@pytest.fixture(scope="module")
def medmnist_format(tmp_path_factory):
    """The built-in digits as a small two-class MedMNIST-format file, with the test split the comparison scores on."""
    x, y = load_digits(return_X_y=True)
    images, labels = (x.reshape(-1, 8, 8) * 16).clip(0, 255).astype(np.uint8), (y >= 5).astype(np.int64)[:, None]
    path = tmp_path_factory.mktemp("data") / "digits_binary.npz"
    np.savez(
        path,
        train_images=images[:1200],
        train_labels=labels[:1200],
        val_images=images[1200:1500],
        val_labels=labels[1200:1500],
        test_images=images[1500:],
        test_labels=labels[1500:],
    )
    return path


@pytest.mark.slow
def test_dopamine_spends_its_target_and_central_dp_is_given_exactly_what_it_spent(
    medmnist_format, tmp_path, monkeypatch, capsys
):
    argv = [
        "--data",
        str(medmnist_format),
        "--out",
        str(tmp_path / "cmp"),
        "--hospitals",
        "3",
        "--seeds",
        "1",
        "--epsilons",
        "4",
        "--rounds",
        "20",
        "--model",
        "mlp",
        "--hidden",
        "16",
        "--methods",
        "dopamine,central-dp",
    ]
    monkeypatch.setattr(compare, "_PROGRESS_S", 0.0)  # every line of a run on the console, as a long run's would be
    result = compare.compare(compare.build_parser().parse_args(argv))
    dopamine, central_dp = result["runs"]
    progress = capsys.readouterr().out
    assert f"    {dopamine['name']}: round   20/20" in progress  # within the run, before its result line
    assert progress.index(f"    {dopamine['name']}: round") < progress.index(f"[1/2] {dopamine['name']}:")
    assert (dopamine["method"], central_dp["method"]) == ("dopamine", "central-dp")
    # the least noise within the target, as the run's own ledger counted it; the baseline under the same accountant family
    assert 3.9 < dopamine["epsilon"]["server"] <= 4.0 and dopamine["complete"]
    assert central_dp["epsilon"] == {
        "server": None,
        "peer_hospital": pytest.approx(dopamine["epsilon"]["server"], abs=0.02),
    }
    assert (dopamine["accountant"], central_dp["accountant"]) == ("Skellam RDP", "Gaussian RDP (Opacus)")

    # the same number of candidate rounds: Dopamine's every 1/q = 10th step, central-dp's 2 epochs
    assert dopamine["candidates"] == central_dp["candidates"] == 2
    report = json.loads((tmp_path / "cmp" / "runs" / dopamine["name"] / "report.json").read_text())
    released = [r for r in report["rounds"] if r["status"] == "released" and r["round"] % 10 == 0]
    assert [r["round"] for r in released] == [10, 20]
    best = max(released, key=lambda r: (r["validation_auc"], -r["round"]))  # consilium-compare selects on AUC
    selected = report["final"]["selected"]
    assert selected["round"] == best["round"] == dopamine["selected_round"]
    assert dopamine["validation_auc"] == selected["validation_auc"] == best["validation_auc"]  # the score chosen on
    assert selected["test"] == best["test"] and dopamine["test_accuracy"] == best["test"]["accuracy"]
    # only a round that was the best on validation so far was ever scored on test
    running_best, scored = -1.0, []
    for record in released:
        if record["validation_auc"] > running_best:
            running_best = record["validation_auc"]
            scored.append(record["round"])
    assert [r["round"] for r in released if r["test"] is not None] == scored
    assert all(r["test"] is None for r in report["rounds"] if r["round"] % 10)  # never a candidate, never scored
    assert (tmp_path / "cmp" / "runs" / dopamine["name"] / "server" / "selected_model.pt").is_file()

    markdown = (tmp_path / "cmp" / "comparison.md").read_text()
    assert f"| 2 | {dopamine['validation_auc']:.3f} | {dopamine['test_accuracy']:.3f} |" in markdown
    assert "| dopamine | record | 4 |" in markdown and "| central-dp | record | 4 | curator: none |" in markdown
    overruns = report["send_offset_overruns"]  # counted for the federation, none for the baseline that sends nothing
    assert dopamine["send_offset_overruns"] == overruns and central_dp["send_offset_overruns"] is None
    rows = {row.split(" | ")[0]: row for row in markdown.splitlines() if row.startswith("| d") or row.startswith("| c")}
    assert rows["| dopamine"].endswith(f" | {overruns} |") and rows["| central-dp"].endswith(" | — |")
    # one panel: no hospital-level method was run
    assert plt.imread(tmp_path / "cmp" / "comparison.png").shape[1] < 1000
    # run again into the same folder: the runs done with the same arguments are reused, not redone
    again = compare.compare(compare.build_parser().parse_args(argv))
    assert again["runs"] == result["runs"]


def test_the_learning_rate_reaches_dopamine_and_the_dp_baselines(medmnist_format, tmp_path):
    argv = ["--data", str(medmnist_format), "--out", str(tmp_path), "--hospitals", "3", "--seeds", "1"]
    argv += ["--epsilons", "4", "--rounds", "10", "--model", "mlp", "--methods", "dopamine,central-dp,fedavg-local-dp"]
    # the default written out, so that a run folder made under another default is never reused as this one's
    for extra, expected in (([], 0.05), (["--lr", "0.2"], 0.2)):
        plan = compare._plan(
            compare.build_parser().parse_args(argv + extra), {"dopamine", "central-dp", "fedavg-local-dp"}
        )
        assert [run["spec"].flags.get("lr") for run in plan] == [expected] * 3


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (("--methods", "fedsgd"), "unknown methods fedsgd"),
        (("--rounds", "15"), "--rounds must be a multiple of 1/q = 10"),
        (("--epsilons", "1,-2"), "epsilons must be positive"),
        (("--data", "breast_cancer"), "breast_cancer has no test split"),
    ],
)
def test_comparison_mistakes_get_one_line(medmnist_format, tmp_path, extra, fragment):
    result = run_launcher("compare", "--data", str(medmnist_format), "--out", str(tmp_path / "cmp"), *extra)
    assert result.returncode == 2 and "Traceback" not in result.stderr and fragment in result.stderr, result.stderr
