"""consilium-compare: every method and baseline on one dataset, with the same model, partition and budgets.

For each seed (the partition, and the initial model; for built-in data the split too), through
``consilium-federation``:

- **record level**, for each ``--epsilons`` target: Dopamine as a real federation over ``--rounds``
  steps at rate q, with the least sigma whose epsilon against the server, as its ledgers account it
  (Skellam RDP, ``training.privacy.accounting``), stays within the target. Then ``central-dp`` (CDP) and
  ``fedavg-local-dp`` (FPDP) with the same steps at the same q, learning rate and momentum, given the
  epsilon that Dopamine spent and Opacus's RDP accountant: the same accountant family, so about the
  same noise. (Opacus's PRV would give them less noise for the same epsilon, which would measure
  the accountants rather than the methods.) CDP's curator sees every record: its epsilon covers
  the released model only;
- **hospital level**, for each ``--hospital-epsilons`` target: dp-fedavg with v = 1 (no
  intermediaries), fixed v = ``--subclients``, and adaptive v up to it (charged at that most), each
  with the least z whose hospital-level epsilon against the server stays within the target. Equal
  hospital-level epsilon is the comparison that says whether intermediaries help;
- ``central`` (C) and ``fedavg`` (F), without privacy.

Every run keeps the round with the best validation score (AUC by default: ``--select-on``) among
its candidates and is scored on the test split, which the data must have. Dopamine's candidates are every 1/q-th step, an epoch's
worth: as many as the DP baselines' epochs (``--rounds`` times q, 20 by default), and as many as the
rounds of the others (``--fedavg-rounds``, 20 by default). More candidates on a small validation
split would favour a lucky round. Writes into ``--out``: ``comparison.json`` (every run, rewritten
after each), the table ``comparison.md`` and the plot ``comparison.png`` (``scripts/_compare_report.py``
says what they show), and each run's own report under ``runs/``. Run again with the same ``--out``
and arguments, it reuses the runs already done (a run is redone if its arguments changed).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, TextIO

from consilium.protocol.run.rules import ConfigError
from consilium.orchestration.local import run_local_federation
from consilium.orchestration.planning import least_noise_multiplier
from consilium.orchestration.spec import RunSpec
from consilium.scripts._cli import run
from consilium.scripts._compare_report import plot, row_scores, table
from consilium.training.methods.flags import positive_float, positive_int, probability, rate, widths
from consilium.training.data.datasets import load_dataset
from consilium.training.methods.dopamine import DopamineSettings
from consilium.training.models.evaluation import SELECTION_METRICS

_NO_BUDGET = 1e9  # the comparison fixes each run's noise and rounds; a hospital's budget must not stop it early
_COMPLETED = "completed all rounds"
_PROGRESS_S = 30.0  # the most seconds a run goes without a line on the console
_FEDERATION_LR = next(flag.default for flag in DopamineSettings.FLAGS if flag.name == "--lr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="consilium-compare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data",
        required=True,
        help="a dataset with a test split: a MedMNIST-format .npz, or an image folder (train/<class>/*.png, test/, "
        "optional val/)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--hospitals", type=positive_int, default=6, help="K (default: 6)")
    parser.add_argument("--seeds", type=positive_int, default=3, help="repetitions, seeds 0 .. n-1 (default: 3)")
    parser.add_argument("--epsilons", type=_numbers, default=(1.0, 4.0), help="record-level targets (default: 1,4)")
    parser.add_argument(
        "--hospital-epsilons", type=_numbers, default=(30.0,), help="hospital-level targets for dp-fedavg (default: 30)"
    )
    parser.add_argument("--delta", type=probability, default=1e-5, help="delta of every epsilon (default: 1e-5)")
    parser.add_argument(
        "--rounds", type=positive_int, default=200, help="Dopamine's steps, and the DP baselines' (default: 200)"
    )
    parser.add_argument(
        "--sample-rate", type=rate, default=0.1, help="q of Dopamine and the DP baselines (default: 0.1)"
    )
    parser.add_argument(
        "--lr",
        type=positive_float,
        default=_FEDERATION_LR,
        help=f"the DP-SGD learning rate of Dopamine and the DP baselines (default: consilium-federation's, {_FEDERATION_LR:g})",
    )
    parser.add_argument(
        "--fedavg-rounds", type=positive_int, default=20, help="rounds of dp-fedavg and F, epochs of C (default: 20)"
    )
    parser.add_argument(
        "--subclients",
        type=positive_int,
        default=4,
        help="dp-fedavg's fixed v, and the most adaptive v may reach (default: 4)",
    )
    parser.add_argument(
        "--select-on",
        choices=SELECTION_METRICS,
        default="auc",
        help="the validation score every run selects its model on (default: auc, which the table reports and which "
        "imbalanced classes leave informative where accuracy stays at the majority class's share)",
    )
    parser.add_argument("--model", help="model architecture (default: the data's, as consilium-federation chooses it)")
    parser.add_argument("--hidden", type=widths, default=RunSpec.hidden, help="MLP hidden widths, comma-separated")
    parser.add_argument(
        "--methods",
        type=lambda text: tuple(text.split(",")),
        help="only these, comma-separated: dopamine, central-dp, fedavg-local-dp, dp-fedavg-v1, dp-fedavg-vV, dp-fedavg-adaptive-vV "
        "(V: --subclients), central, fedavg (default: all)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(run(lambda: compare(args)))


def compare(args: argparse.Namespace) -> dict:
    known = _methods(args)
    unknown = sorted(set(args.methods or ()) - set(known))
    if unknown:
        raise ConfigError(f"unknown methods {', '.join(unknown)}; choose from {', '.join(known)}")
    if load_dataset(args.data).test is None:
        raise ConfigError(f"{args.data} has no test split to score on (a MedMNIST-format .npz has one)")
    plan = _plan(args, wanted=set(args.methods or known))
    result = {
        "data": args.data,
        "hospitals": args.hospitals,
        "seeds": args.seeds,
        "delta": args.delta,
        "select_on": args.select_on,
        "runs": [],
    }
    for number, planned in enumerate(plan, start=1):
        spec = replace(planned["spec"], out=args.out / "runs" / planned["name"], **_matched(planned, result["runs"]))
        result["runs"].append({**planned, "spec": spec.to_dict(), **_summary(_report(spec))})
        entry = result["runs"][-1]
        print(
            f"[{number}/{len(plan)}] {planned['name']}: {row_scores(entry)} ({entry['wall_seconds']:.0f} s)",
            flush=True,
        )
        (args.out / "comparison.json").write_text(json.dumps(result, indent=1))
    (args.out / "comparison.md").write_text(table(result))
    plot(result, args.out / "comparison.png")
    print(f"table: {args.out / 'comparison.md'}, plot: {args.out / 'comparison.png'}", flush=True)
    return result


def _report(spec: RunSpec) -> dict:
    """The report of the run of ``spec``: the one in its folder if made with the same spec, else a new one."""
    made_with = spec.out / "spec.json"
    if (
        made_with.exists()
        and json.loads(made_with.read_text()) == spec.to_dict()
        and (spec.out / "report.json").exists()
    ):
        return json.loads((spec.out / "report.json").read_text())
    if spec.out.exists():  # an unfinished or different run: start it again
        shutil.rmtree(spec.out)
    spec.out.mkdir(parents=True)
    with (spec.out / "output.log").open("w") as log:
        report = run_local_federation(spec, echo=_progress(spec.out.name, log))
    made_with.write_text(json.dumps(spec.to_dict()))
    return report


def _progress(name: str, log: TextIO) -> Callable[[str], None]:
    """Each line of a run to its log; to the console, one at most every ``_PROGRESS_S``, so that a long run
    shows how far it is."""
    shown = [time.monotonic()]

    def echo(line: str) -> None:
        print(line, file=log, flush=True)
        if time.monotonic() - shown[0] >= _PROGRESS_S:
            shown[0] = time.monotonic()
            print(f"    {name}: {line}", flush=True)

    return echo


def _methods(args: argparse.Namespace) -> tuple[str, ...]:
    v = args.subclients
    return (
        "dopamine",
        "central-dp",
        "fedavg-local-dp",
        "dp-fedavg-v1",
        f"dp-fedavg-v{v}",
        f"dp-fedavg-adaptive-v{v}",
        "central",
        "fedavg",
    )


def _plan(args: argparse.Namespace, wanted: set[str]) -> list[dict]:
    """The runs of the ``wanted`` methods, in order: a DP baseline after the Dopamine run whose epsilon it is matched to."""
    steps_per_epoch = math.ceil(1 / args.sample_rate)
    if {"central-dp", "fedavg-local-dp"} & wanted and args.rounds % steps_per_epoch:
        raise ConfigError(
            f"--rounds must be a multiple of 1/q = {steps_per_epoch}: the DP baselines take the same steps in whole epochs"
        )
    base = RunSpec(
        data=args.data,
        hospitals=args.hospitals,
        delta=args.delta,
        model=args.model,
        hidden=args.hidden,
        select_on=args.select_on,
    )
    noise: dict[tuple, RunSpec] = {}

    def calibrated(spec: RunSpec, target: float) -> RunSpec:
        """``spec`` at the least noise within ``target``, which depends on the method, its settings and K, not the seed."""
        key = (json.dumps(spec.to_dict()), target)
        if key not in noise:
            noise[key] = spec.with_flags(noise_multiplier=least_noise_multiplier(spec, target))
        return noise[key]

    plan = []
    for seed in range(args.seeds):
        plan += _record_level(args, base, wanted, calibrated, seed, steps_per_epoch)
        plan += _hospital_level(args, base, wanted, calibrated, seed)
        for baseline in [name for name in ("central", "fedavg") if name in wanted]:
            spec = replace(base, method=baseline, rounds=args.fedavg_rounds)
            plan.append(_run(baseline, f"{baseline}-seed{seed}", seed, "none", None, spec))
    return plan


def _record_level(args, base: RunSpec, wanted: set[str], calibrated, seed: int, steps_per_epoch: int) -> list[dict]:
    """Dopamine at each record-level target, and each DP baseline with the same steps, matched to its epsilon."""
    runs = []
    # lr always given: a run folder made under another default is then never taken for one made under this one
    dp_sgd = {"sample_rate": args.sample_rate, "momentum": 0.9, "lr": args.lr}
    for target in args.epsilons:
        dopamine = f"dopamine-eps{target:g}-seed{seed}"
        if "dopamine" in wanted:
            spec = replace(
                base,
                method="dopamine",
                rounds=args.rounds,
                epsilon_budget=_NO_BUDGET,
                select_every=steps_per_epoch,  # as many candidates as the DP baselines' epochs
            ).with_flags(**dp_sgd)
            runs.append(_run("dopamine", dopamine, seed, "record", target, calibrated(spec, target)))
        for baseline in [name for name in ("central-dp", "fedavg-local-dp") if name in wanted]:
            spec = replace(base, method=baseline, rounds=args.rounds // steps_per_epoch)
            spec = spec.with_flags(accountant="rdp", **dp_sgd)
            name = f"{baseline}-eps{target:g}-seed{seed}"
            runs.append(_run(baseline, name, seed, "record", target, spec, matched_to=dopamine))
    return runs


def _hospital_level(args, base: RunSpec, wanted: set[str], calibrated, seed: int) -> list[dict]:
    """dp-fedavg without intermediaries, with a fixed v and with an adaptive v, at each hospital-level target."""
    v = args.subclients
    variants = {
        "dp-fedavg-v1": {"subclients": 1},
        f"dp-fedavg-v{v}": {"subclients": v},
        f"dp-fedavg-adaptive-v{v}": {"subclients": 1, "adaptive_subclients": v},
    }
    runs = []
    for target in args.hospital_epsilons:
        for method, split in variants.items():
            if method in wanted:
                spec = replace(base, method="dp-fedavg", rounds=args.fedavg_rounds, epsilon_budget=_NO_BUDGET)
                spec = calibrated(spec.with_flags(**split), target)
                runs.append(_run(method, f"{method}-eps{target:g}-seed{seed}", seed, "hospital", target, spec))
    return runs


def _run(
    method: str,
    name: str,
    seed: int,
    level: str,
    target: float | None,
    spec: RunSpec,
    matched_to: str | None = None,
) -> dict:
    return {
        "method": method,
        "name": name,
        "seed": seed,
        "level": level,
        "target_epsilon": target,
        "spec": replace(spec, seed=seed),
        "matched_to": matched_to,
    }


def _matched(planned: dict, done: list[dict]) -> dict:
    """A DP baseline's budget: the epsilon its Dopamine run spent against the server (its target without one)."""
    if planned["matched_to"] is None:
        return {}
    dopamine = next((r for r in done if r["name"] == planned["matched_to"]), None)
    return {"epsilon_budget": dopamine["epsilon"]["server"] if dopamine else planned["target_epsilon"]}


def _summary(report: dict) -> dict:
    """What the table needs of one run's report (``consilium-federation``'s, or a baseline's)."""
    final = report["final"]
    selected = final["selected"] or {}
    test = selected.get("test") or {}
    epsilon, record_level = final.get("epsilon"), None
    if isinstance(epsilon, (int, float)):  # a DP baseline's, of its released model
        curator = report["method"] == "central-dp"  # who holds every record: no epsilon against it
        epsilon = {"server": None if curator else epsilon, "peer_hospital": epsilon}
    elif epsilon is not None and "hospital" in final["epsilon_levels"]:  # dp-fedavg: per hospital, and per record
        record_level = final["epsilon_levels"]["record"]["server"]
    return {
        "validation_accuracy": selected.get("validation_accuracy"),
        "validation_auc": selected.get("validation_auc"),
        "test_accuracy": test.get("accuracy"),
        "test_auc": test.get("auc"),
        "selected_round": selected.get("round"),
        "candidates": (final.get("selection") or {}).get("candidates"),
        "complete": final.get("finish_reason", _COMPLETED) == _COMPLETED,
        "epsilon": epsilon,  # by view, at the run's first level: per record, or per hospital for dp-fedavg
        "record_epsilon": record_level,
        "accountant": _accountant(final.get("accountant")),
        "wall_seconds": report["wall_seconds"],
        "send_offset_overruns": report.get("send_offset_overruns"),  # a federation's; a baseline sends nothing
    }


def _accountant(name: str | None) -> str | None:
    return "Skellam RDP" if name and "Skellam" in name else name


def _numbers(text: str) -> tuple[float, ...]:
    try:
        values = tuple(dict.fromkeys(float(part) for part in text.split(",")))  # each target once, in order
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not all(v > 0 and math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"epsilons must be positive, got {text!r}")
    return values


if __name__ == "__main__":
    main()
