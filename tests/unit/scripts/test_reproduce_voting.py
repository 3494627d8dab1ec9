from consilium.scripts.reproduce_voting import SETTINGS, results_table


def _run(seed, accuracy, epsilon):
    final = {
        "student_test_accuracy": accuracy,
        "label_accuracy": 0.8,
        "queries_labelled": 400,
        "queries_withheld": 100,
        "delta": 1e-3,
        "epsilon": {"hospital": {"server": epsilon}, "record": {"server": 2 * epsilon}},
        "mpc_seconds_per_query": 0.004,
    }
    return {"seed": seed, "argv": [], "report": {"final": final, "wall_seconds": 100.0}}


def test_the_table_says_whether_each_target_is_met_over_the_seeds():
    accuracy, epsilon = SETTINGS["ae-dpfl"]["target"]
    met = results_table({"ae-dpfl": [_run(0, accuracy + 0.01, epsilon), _run(1, accuracy, epsilon)]}, data="mnist.npz")
    assert "| ae-dpfl | 0, 1 | 90.5 ± 0.7% | 80.0 ± 0.0% | 400 ± 0 (of 500) |" in met and f"{epsilon:g}: yes |" in met
    short = results_table({"ae-dpfl": [_run(0, accuracy - 0.01, epsilon)]}, data="mnist.npz")
    over = results_table(
        {"ae-dpfl": [_run(0, accuracy + 0.01, epsilon), _run(1, accuracy + 0.01, epsilon + 0.1)]}, data="mnist.npz"
    )
    assert f"{epsilon:g}: no |" in short and f"{epsilon:g}: no |" in over


def test_runs_without_labels_are_shown_and_counted_as_missing_the_target():
    accuracy, epsilon = SETTINGS["ae-dpfl"]["target"]
    withheld, lost = _run(1, None, epsilon), _run(2, None, epsilon)
    withheld["report"]["final"].update(
        label_accuracy=None, queries_labelled=0, queries_withheld=500
    )  # every label withheld
    lost["report"]["final"].update(
        label_accuracy=None, queries_labelled=0, queries_withheld=0, mpc_seconds_per_query=None
    )
    table = results_table({"ae-dpfl": [withheld]}, data="mnist.npz")
    assert "| ae-dpfl | 1 | n/a | n/a | 0 ± 0 (of 500) |" in table and f"{epsilon:g}: no |" in table
    table = results_table(
        {"ae-dpfl": [_run(0, accuracy + 0.01, epsilon), lost]}, data="mnist.npz"
    )  # every round aborted
    assert "| ae-dpfl | 0, 2 | 91.0 ± 0.0% (1 of 2 runs) |" in table and "| 4.00 ± 0.00 (1 of 2 runs) |" in table
    assert f"{epsilon:g}: no |" in table
