"""A local federation's report: the server's merged with each hospital's metrics, its plot, and its summary line.

``report.json`` of a secure-round run is the server's report (``protocol.run.server_report``) with, per
round, each hospital's own metrics (``protocol.run.hospital_metrics``: time per phase, bytes on the
wire); a voting run's is the voting server's; a baseline's is its own (``training.methods.baselines``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from consilium.protocol.run.config import INSECURE_PLAINTEXT, SECURE_AGGREGATION

__all__ = [
    "baseline_summary",
    "build_report",
    "plot_report",
    "plot_vote_report",
    "training_summary",
    "vote_summary",
    "vote_warning",
]

_MEANINGFUL_EPSILON = 10.0


def build_report(server: dict, hospitals: dict[str, dict], *, wall_seconds: float) -> dict:
    """Merge the server's report with each hospital's own metrics, round by round."""
    by_round = {name: {r["round"]: r for r in metrics.get("rounds", [])} for name, metrics in hospitals.items()}
    rounds = []
    for record in server["rounds"]:
        record = dict(record)
        record["hospitals"] = {
            name: rounds_of[record["round"]] for name, rounds_of in by_round.items() if record["round"] in rounds_of
        }
        rounds.append(record)
    hospital_rounds = [r for rounds_of in by_round.values() for r in rounds_of.values()]
    return {
        "config": server["config"],
        "run_fingerprint": server["run_fingerprint"],
        "bfv": server["bfv"],
        "mechanism": server["mechanism"],
        "final": {**server["final"], "finish_reason": server["finish_reason"]},
        "wire": _wire(hospital_rounds, float32_bytes=4 * server["parameter_count"]),
        "phase_seconds": {
            "server": {
                **server["phase_seconds"],
                **{
                    f"{phase}_per_round": _mean_seconds(server["rounds"], phase)
                    for phase in ("collect", "aggregate", "release", "evaluate")
                },
            },
            "hospital_per_round": {
                phase: _mean_seconds(hospital_rounds, phase) for phase in ("train", "encrypt", "decrypt")
            },
        },
        "send_offset_overruns": sum(r["overran_send_offset"] for r in hospital_rounds),
        "rejected_messages": server["rejected_messages"],
        "wall_seconds": wall_seconds,
        "rounds": rounds,
    }


def training_summary(report: dict) -> str:
    """The line a secure-round run ends with: its scores, its epsilons and its upload."""
    final, wire = report["final"], report["wire"]
    epsilon = final["epsilon"]
    if report["config"]["aggregation"] == SECURE_AGGREGATION:
        (level, _), *others = final["epsilon_levels"].items()
        privacy = (
            f"epsilon per {level} at delta {final['delta']:g}: {epsilon['server']:.3f} against the server, "
            f"{epsilon['peer_hospital']:.3f} against a fellow hospital, {epsilon['coalition']:.3f} against the server "
            f"with {_hospitals(final['coalition'])}, {epsilon['collusion']:.3f} if all the others collude; "
            + "".join(
                f"per {name}: {e['server']:.3f}, {e['peer_hospital']:.3f}, {e['coalition']:.3f}, {e['collusion']:.3f}; "
                for name, e in others
            )
            + "encrypted update"
        )
    else:
        privacy = "NO privacy guarantee (--insecure-plaintext-benchmark); plaintext update"
    overruns = report["send_offset_overruns"]
    return (
        f"done in {report['wall_seconds']:.0f} s: {_scores(final)}; {privacy} "
        f"{wire['update_bytes_per_round']:.0f} bytes = {wire['update_ratio_to_float32']:.2f}x float32"
        + (
            f"; WARNING: {overruns} steps overran their send offset, so their uploads' send times may tell batch sizes "
            "(raise --send-offset)"
            if overruns
            else ""
        )
    )


def vote_summary(report: dict) -> str:
    """The line a voting run ends with: labels, their accuracy, the student's, epsilon and the MPC's time."""
    final = report["final"]
    epsilon = final["epsilon"]
    return (
        f"done in {report['wall_seconds']:.0f} s ({report['finish_reason']}): {final['queries_labelled']} queries labelled"
        + (f" ({final['queries_withheld']} withheld under the label threshold)" if final["queries_withheld"] else "")
        + ", "
        f"label accuracy {_fraction(final['label_accuracy'])}, student test accuracy {_fraction(final['student_test_accuracy'])}; "
        f"epsilon at delta {final['delta']:g} against the server: {epsilon['record']['server']:.3f} per record, "
        f"{epsilon['hospital']['server']:.3f} per hospital; MPC {1000 * (final['mpc_seconds_per_query'] or 0):.1f} ms per query"
        + (f"; {report['reveal_warning']}" if report["reveal_warning"] else "")
    )


def vote_warning(report: dict) -> str | None:
    """A warning where a voting run's epsilon protects no record meaningfully."""
    epsilon = report["final"]["epsilon"]["record"]["server"]
    if not epsilon > _MEANINGFUL_EPSILON:
        return None
    return (
        f"warning: epsilon {epsilon:.0f} per record protects no record meaningfully; the data-independent guarantee "
        "of voting needs many hospitals (the voting paper's AE-DPFL uses 100) or more noise"
    )


def baseline_summary(report: dict) -> str:
    final = report["final"]
    privacy = (
        "no privacy"
        if final["epsilon"] is None
        else f"epsilon per record {final['epsilon']:.3f} at delta {final['delta']:g}"
    )
    return f"done in {report['wall_seconds']:.0f} s: {_scores(final)}; {privacy}"


def _hospitals(count: int) -> str:
    return f"{count} hospital{'' if count == 1 else 's'}"


def plot_report(report: dict, path: Path) -> None:
    """Validation accuracy and epsilon (each view, at the method's first level) per released round."""
    plt = _pyplot()
    released = [r for r in report["rounds"] if r["status"] == "released"]
    rounds = [r["round"] for r in released]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(rounds, [r["validation_accuracy"] for r in released], color="tab:blue")
    top.set_ylabel("validation accuracy")
    top.grid(alpha=0.3)
    views = (
        ("server", "against the server", "-"),
        ("peer_hospital", "against a fellow hospital", "--"),
        ("coalition", "against the server with tau - 1 hospitals", "-."),
        ("collusion", "if all the others collude", ":"),
    )
    for view, label, style in views:
        bottom.plot(rounds, [r["epsilon"][view] for r in released], label=label, linestyle=style)
    level = next(iter(report["final"]["epsilon_levels"]))
    bottom.set_ylabel(f"epsilon per {level} (delta {report['final']['delta']:g})")
    bottom.set_xlabel("round")
    bottom.legend()
    bottom.grid(alpha=0.3)
    config = report["config"]
    aggregation = (
        "secure aggregation OFF: the epsilons do NOT hold"
        if config["aggregation"] == INSECURE_PLAINTEXT
        else "BFV secure aggregation"
    )
    figure.suptitle(
        f"{config['training']['method']} on {config['dataset']}: {len(config['hospitals'])} hospitals, {aggregation}"
    )
    _save(figure, path)


def plot_vote_report(report: dict, path: Path) -> None:
    """Label accuracy and epsilon (per record and per hospital, against the server) per labelled round."""
    plt = _pyplot()
    labelled = [r for r in report["rounds"] if r["status"] == "labelled"]
    rounds = [r["round"] for r in labelled]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(rounds, [r["label_accuracy"] for r in labelled], marker="o", color="tab:blue")
    top.set_ylabel("label accuracy")
    top.grid(alpha=0.3)
    for level, label in (("record", "per record"), ("hospital", "per hospital")):
        bottom.plot(
            rounds, [r["epsilon"][level]["server"] for r in labelled], marker="o", label=f"{label}, against the server"
        )
    bottom.set_ylabel(f"epsilon (delta {report['final']['delta']:g})")
    bottom.set_xlabel("round")
    bottom.legend()
    bottom.grid(alpha=0.3)
    config = report["config"]
    figure.suptitle(
        f"{report['method']} on {config['dataset']}: {len(config['hospitals'])} hospitals, {len(config['talliers'])} talliers, "
        f"student test accuracy {_fraction(report['final']['student_test_accuracy'])}"
    )
    _save(figure, path)


def _wire(hospital_rounds: list[dict], *, float32_bytes: int) -> dict:
    def mean_of(key: str) -> float:
        return float(np.mean([r[key] for r in hospital_rounds])) if hospital_rounds else 0.0

    return {
        "float32_update_bytes": float32_bytes,
        "update_bytes_per_round": mean_of("update_bytes"),
        "update_ratio_to_float32": mean_of("update_bytes") / float32_bytes,
        "aggregate_bytes_per_round": mean_of("received_bytes"),
        "aggregate_ratio_to_float32": mean_of("received_bytes") / float32_bytes,
        "sent_bytes_per_round": mean_of("sent_bytes"),
        "note": "per hospital per round; update = the encrypted upload with its sealed key shares, aggregate = the "
        "encrypted sum and the shares sealed to this hospital, downloaded; sent = the update plus the endorsement, "
        "proof, release and confirmation",
    }


def _mean_seconds(records: list[dict], phase: str) -> float:
    values = [r["seconds"][phase] for r in records if phase in r["seconds"]]
    return float(np.mean(values)) if values else 0.0


def _scores(final: dict) -> str:
    """The round selected on validation (on the score ``final["selection"]`` names) and, where the data have
    a test split, its test scores."""
    selected = final["selected"]
    if selected is None:
        return "no round released"
    metric = final["selection"]["on"]
    shown = (
        f"validation {metric} {_fraction(selected[f'validation_{metric}'])} "
        f"(round {selected['round']}, the best of {final['selection']['candidates']} candidates)"
    )
    if selected["test"] is not None:
        shown += f", its test accuracy {_fraction(selected['test']['accuracy'])} and AUC {_fraction(selected['test']['auc'])}"
    return shown


def _fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
