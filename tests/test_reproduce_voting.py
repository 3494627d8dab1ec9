from scripts.reproduce_voting import SETTINGS, results_table


def _run(seed, accuracy, epsilon):
    final = {
        "student_test_accuracy": accuracy, "label_accuracy": 0.8, "queries_labelled": 500, "delta": 1e-3,
        "epsilon": {"agent": {"server": epsilon}, "instance": {"server": 2 * epsilon}}, "mpc_seconds_per_query": 0.004,
    }  # fmt: skip
    return {"seed": seed, "argv": [], "report": {"final": final, "wall_seconds": 100.0}}


def test_the_table_says_whether_each_target_is_met_over_the_seeds():
    accuracy, epsilon = SETTINGS["ae-dpfl"]["target"]
    met = results_table({"ae-dpfl": [_run(0, accuracy + 0.01, epsilon), _run(1, accuracy, epsilon)]}, data="mnist.npz")
    assert "| ae-dpfl | 0, 1 | 90.5 ± 0.7% |" in met and f"{epsilon:g}: yes |" in met
    short = results_table({"ae-dpfl": [_run(0, accuracy - 0.01, epsilon)]}, data="mnist.npz")
    over = results_table({"ae-dpfl": [_run(0, accuracy + 0.01, epsilon), _run(1, accuracy + 0.01, epsilon + 0.1)]}, data="mnist.npz")
    assert f"{epsilon:g}: no |" in short and f"{epsilon:g}: no |" in over
