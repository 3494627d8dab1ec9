"""consilium-compare's report of its runs: the table (``comparison.md``), the plot (``comparison.png``),
and the line it prints as each run ends.

The table gives test accuracy and AUC as mean and standard deviation over the seeds, the epsilon
each run spent, by view and level, with its accountant, and wall time; the plot gives test accuracy
against the epsilon the table matches (against the server; central-dp's of its released model), a
panel per level that was run. Both read the runs as ``compare`` summarises them in ``comparison.json``.
"""

from __future__ import annotations

import statistics
from pathlib import Path


def table(result: dict) -> str:
    """A markdown table: one row per method and target, mean and standard deviation over the seeds."""
    rows = {}
    for entry in result["runs"]:
        rows.setdefault((entry["method"], entry["level"], entry["target_epsilon"]), []).append(entry)
    lines = [
        f"{result['hospitals']} hospitals on {Path(result['data']).name}, {len({e['seed'] for e in result['runs']})} seeds, "
        f"delta {result['delta']:g}. Scores of the round selected on validation {result['select_on']} among the "
        "candidate rounds the row's column gives, mean ± standard deviation over seeds. Epsilon at the row's level (per "
        "record, or per hospital for dp-fedavg); against the server, central-dp's "
        "curator sees every record. Wall time on a shared 2-core machine: a federation's parties are separate processes "
        "of one thread each, a baseline is one process.",
        "",
        f"| method | level | target ε | ε against the server | ε against a fellow hospital | ε per record (dp-fedavg) | accountant | candidates | validation {result['select_on']} | test accuracy | test AUC | wall s | send-offset overruns |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (method, level, target), entries in rows.items():
        epsilons = [e["epsilon"] for e in entries if e["epsilon"] is not None]
        against_server = "curator: none" if method == "central-dp" else _spread([e["server"] for e in epsilons], 2)
        incomplete = sum(not e["complete"] for e in entries)
        lines.append(
            f"| {method}{f' ({incomplete} runs stopped early)' if incomplete else ''} | {level} | {'—' if target is None else f'{target:g}'} | "
            f"{against_server} | {_spread([e['peer_hospital'] for e in epsilons], 2)} | {_spread([e['record_epsilon'] for e in entries], 2)} | "
            f"{entries[0]['accountant'] or '—'} | {_spread([e['candidates'] for e in entries], 0)} | "
            f"{_spread([e['validation_' + result['select_on']] for e in entries], 3)} | "
            f"{_spread([e['test_accuracy'] for e in entries], 3)} | "
            f"{_spread([e['test_auc'] for e in entries], 3)} | {_spread([e['wall_seconds'] for e in entries], 0)} | "
            f"{_overruns(entries)} |"
        )
    return "\n".join(lines) + "\n"


def _overruns(entries: list[dict]) -> str:
    """Steps that overran their send offset, over the row's runs (their uploads' send times may tell batch sizes)."""
    counts = [e.get("send_offset_overruns") for e in entries]
    return "—" if all(count is None for count in counts) else str(sum(count or 0 for count in counts))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = _plotted_levels(result["runs"])
    if not levels:
        return
    figure, axes = plt.subplots(1, len(levels), figsize=(5.5 * len(levels) + 0.5, 4.5), sharey=True, squeeze=False)
    axes = axes[0]
    without_privacy = _accuracy_without_privacy(result["runs"])
    for axis, (level, label) in zip(axes, levels.items()):
        _plot_level(axis, result["runs"], level, label, without_privacy)
    axes[0].set_ylabel("test accuracy")
    figure.suptitle(
        f"{Path(result['data']).name}, {result['hospitals']} hospitals, delta {result['delta']:g}: mean and standard deviation over seeds "
        "(methods at one epsilon drawn a little apart)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _plotted_levels(runs: list[dict]) -> dict[str, str]:
    """Each privacy level that was run, with its panel's x-axis label."""
    labels = {
        "record": "epsilon per record, against the server (central-dp: of its released model)",
        "hospital": "epsilon per hospital, against the server",
    }
    return {level: label for level, label in labels.items() if any(e["level"] == level for e in runs)}


def _accuracy_without_privacy(runs: list[dict]) -> dict[str, list[float]]:
    """Each method without privacy (central, fedavg): its runs' test accuracies."""
    without_privacy = {}
    for entry in runs:
        if entry["level"] == "none" and entry["test_accuracy"] is not None:
            without_privacy.setdefault(entry["method"], []).append(entry["test_accuracy"])
    return without_privacy


def _plot_level(axis, runs: list[dict], level: str, label: str, without_privacy: dict[str, list[float]]) -> None:
    """One level's panel: each method's test accuracy against epsilon, and the methods without privacy as lines."""
    xs = []
    for index, method in enumerate(dict.fromkeys(e["method"] for e in runs if e["level"] == level)):
        points = _accuracy_by_epsilon(runs, method)
        dodge = 1 + 0.04 * index  # methods at one epsilon side by side, not on top of each other
        xs += [x * dodge for x, _, _ in points]
        axis.errorbar(
            [x * dodge for x, _, _ in points],
            [y for _, y, _ in points],
            yerr=[s for _, _, s in points],
            marker="o",
            capsize=3,
            label=method,
        )
    for method, accuracy in without_privacy.items():
        axis.axhline(
            statistics.mean(accuracy),
            linestyle=":",
            color="grey" if method == "central" else "black",
            label=f"{method} (no privacy)",
        )
    axis.set_xscale("log")
    if xs:
        axis.set_xlim(min(xs) / 1.3, max(xs) * 1.3)
    axis.set_xlabel(label)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)


def _accuracy_by_epsilon(runs: list[dict], method: str) -> list[tuple[float, float, float]]:
    """A method's points, by epsilon: the mean matched epsilon, and the mean and standard deviation of test accuracy
    over the runs of each target."""
    by_target = {}
    for entry in runs:
        if entry["method"] == method and entry["test_accuracy"] is not None:
            by_target.setdefault(entry["target_epsilon"], []).append(entry)
    return sorted(
        (
            statistics.mean(_matched_epsilon(e) for e in group),
            statistics.mean(e["test_accuracy"] for e in group),
            _std([e["test_accuracy"] for e in group]),
        )
        for group in by_target.values()
    )


def _matched_epsilon(entry: dict) -> float:
    """The epsilon the table matches: against the server, or central-dp's of its released model (its
    curator sees every record), which is its budget, Dopamine's epsilon against the server."""
    epsilon = entry["epsilon"]
    return epsilon["peer_hospital"] if epsilon["server"] is None else epsilon["server"]


def row_scores(entry: dict) -> str:
    """One run's scores and epsilon in a line, for the progress the comparison prints."""
    epsilon = (
        "no privacy"
        if entry["epsilon"] is None
        else f"epsilon {entry['epsilon']['peer_hospital']:.2f} per {entry['level']} against a fellow hospital"
    )
    stopped = "" if entry["complete"] else " (stopped early)"
    return f"test accuracy {_shown(entry['test_accuracy'], 3)}, AUC {_shown(entry['test_auc'], 3)}, {epsilon}{stopped}"


def _spread(values: list, digits: int) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    return (
        f"{statistics.mean(values):.{digits}f} ± {_std(values):.{digits}f}"
        if len(values) > 1
        else f"{values[0]:.{digits}f}"
    )


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _shown(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"
