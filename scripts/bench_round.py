"""consilium-bench-round: what secure aggregation adds to a whole Dopamine round, phase by phase.

Each setting runs twice as a real ``consilium-federation`` (a server and K hospital processes over
CurveZMQ), with the same model, data, K, seed and rounds:

- ``secure``: the protocol as it is, one-time-key uploads with their sealed shares, the encrypted sum,
  endorsements, proofs and releases, the sum opened by every party;
- ``plaintext``: ``--insecure-plaintext-benchmark`` (``crypto.insecure_plaintext``), the same round
  with the integer updates sent and summed in the clear, and nothing else changed.

The hospitals send at once (``--send-offset 0``): the offset that hides a round's compute time
would otherwise hide the encryption time too. A round's wall time is the server's, from RoundStart
to the evaluated model: ``collect`` (the hospitals' step, encryption and upload, and the server's
additions) + ``release`` (the sum down, decryption, endorsements, the mean back) + ``evaluate``.
Each run's figures are medians over the rounds after the first (warm-up). Every process shares this
machine's cores, as in the main job (docs/tutorials/first-federation.md).

``--flower`` adds a peer system to each pair: the same round over Flower's SecAgg+ (``scripts/_flower.py``,
the optional dependency group ``bench-flower``), with the same model, data, K, seed, rounds and
Dopamine step, timed and counted the same way.

A shared machine's speed drifts by a fifth from one run to the next, as much as the difference
being measured, so each setting runs ``--repeats`` pairs, alternating which mode goes first: the
ratio is each pair's, and the table gives their median and range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from consilium.orchestration.local import run_local_federation
from consilium.orchestration.spec import RunSpec
from consilium.protocol.run.rules import ConfigError
from consilium.scripts._cli import run
from consilium.scripts._flower import require_flower, run_flower_secaggplus
from consilium.training.methods.flags import non_negative_int, positive_int

# Each setting's rounds and secure/plaintext pairs, unless --rounds and --repeats say otherwise: the
# 11M setting's round takes about a minute on 2 cores, most of it five hospitals' ResNet-18 steps.
SETTINGS = {
    "default": {
        "what": "the main job's model: MLP 30-48-2 on breast_cancer, K = 3",
        "spec": RunSpec(hospitals=3),
        "rounds": 12,
        "repeats": 3,
    },
    "1M": {
        "what": "MLP 64-1024-880-10 (977,370 parameters) on digits, K = 5",
        "spec": RunSpec(data="digits", hospitals=5, hidden=(1024, 880)),
        "rounds": 12,
        "repeats": 3,
    },
    "11M": {
        "what": "ResNet-18 with GroupNorm (11,168,706 parameters) on PneumoniaMNIST's 28x28 images (--images), K = 5",
        # q = 0.02: B = 15.5 records a hospital a round, as in the main job; a round may take minutes on a CPU.
        "spec": RunSpec(hospitals=5, model="resnet18", round_timeout=900.0, flags={"sample_rate": 0.02}),
        "rounds": 4,
        "repeats": 1,
    },
}
_TARGETS = {"1M": 1.15, "11M": 1.30}  # issue 32: the secure round at most this much the plaintext one, K = 5
MODES = {"secure": False, "plaintext": True}  # insecure_plaintext_benchmark
FLOWER = "flower-secagg+"
_SERVER_PHASES = ("collect", "aggregate", "release", "evaluate")
_HOSPITAL_PHASES = ("train", "encrypt", "decrypt")
_PHASES_EXPLAINED = (
    "Phases: `train` is the hospital's DP-SGD step with its noise share; `encrypt` encodes, encrypts and serialises "
    "the update (plaintext: packs it); `decrypt` decrypts, checks and decodes the sum; `collect` runs from RoundStart "
    "to the last update in; `aggregate` is the server's deserialising and adding (within collect); `release` runs "
    "from the sum's sending to the released mean; `evaluate` applies it and scores the validation split."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-bench-round",
        description="Time the same Dopamine federation with secure aggregation on and off (an insecure plaintext "
        "mode that exists only for this comparison), phase by phase; write results.md and results.json.",
    )
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), help="which to run")
    parser.add_argument(
        "--rounds", type=positive_int, help="rounds per run, the first not counted (default: each setting's, 12 or 4)"
    )
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed of the data split and partition (default: 0)"
    )
    parser.add_argument(
        "--repeats", type=positive_int, help="secure/plaintext pairs per setting (default: each setting's, 3 or 1)"
    )
    parser.add_argument(
        "--images",
        default="../shared/data/pneumoniamnist.npz",
        help="the 11M setting's MedMNIST-format images (default: ../shared/data/pneumoniamnist.npz)",
    )
    parser.add_argument("--device", help="where the parties' models compute, e.g. cuda (default: cpu)")
    parser.add_argument(
        "--flower",
        action="store_true",
        help="also run each setting over Flower's SecAgg+ (needs pip install -e '.[bench-flower]')",
    )
    parser.add_argument("--out", type=Path, default=Path("results/bench_round"), help="where the table goes")
    parser.add_argument("--work", type=Path, default=Path("runs/bench_round"), help="where each run's files go")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(run(lambda: benchmark(args)))


def benchmark(args: argparse.Namespace) -> None:
    if args.rounds is not None and args.rounds < 2:
        raise ConfigError("--rounds must be at least 2: the first round is warm-up")
    if args.flower:
        require_flower()  # before minutes of Consilium's runs
    runs: dict[str, dict[str, list[dict]]] = {}
    for setting in args.settings:
        repeats = args.repeats or SETTINGS[setting]["repeats"]
        for repeat in range(repeats):
            for mode in list(MODES)[:: 1 if repeat % 2 == 0 else -1]:  # secure first, then plaintext first, ...
                out = args.work / f"{setting}-{mode}-{repeat + 1}"
                spec = replace(
                    SETTINGS[setting]["spec"],
                    data=args.images if setting == "11M" else SETTINGS[setting]["spec"].data,
                    device=args.device,
                    insecure_plaintext_benchmark=MODES[mode],
                    rounds=args.rounds or SETTINGS[setting]["rounds"],
                    seed=args.seed,
                    send_offset=0.0,
                    epsilon_budget=1000.0,
                    out=out,
                )
                print(
                    f"== {setting}, {mode}, pair {repeat + 1} of {repeats}: consilium-federation {' '.join(spec.argv())}",
                    flush=True,
                )
                report = run_local_federation(spec)
                runs.setdefault(setting, {}).setdefault(mode, []).append(
                    {"argv": spec.argv(), "summary": summarise(report)}
                )
            if args.flower:
                print(f"== {setting}, {FLOWER}, after pair {repeat + 1} of {repeats}", flush=True)
                flower_spec = replace(
                    spec, insecure_plaintext_benchmark=False, out=args.work / f"{setting}-flower-{repeat + 1}"
                )
                runs[setting].setdefault(FLOWER, []).append(
                    {"argv": flower_spec.argv(), "summary": run_flower_secaggplus(flower_spec)}
                )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"argv": sys.argv[1:], "runs": runs}, indent=1))
    (args.out / "results.md").write_text(results_table(runs, args))
    print(f"results: {args.out / 'results.md'}", flush=True)


def summarise(report: dict) -> dict:
    """Median seconds of each phase over the released rounds after the first, and the bytes of an update."""
    rounds = [r for r in report["rounds"] if r["status"] == "released"][1:]
    if not rounds:
        raise ValueError("no round was released after the first; see the run's logs")
    median = statistics.median
    hospital_rounds = [h for r in rounds for h in r["hospitals"].values()]
    return {
        "rounds": len(rounds),
        "parameters": report["bfv"]["vector_length"],
        "round": median([sum(r["seconds"][p] for p in ("collect", "release", "evaluate")) for r in rounds]),
        "server": {phase: median([r["seconds"][phase] for r in rounds]) for phase in _SERVER_PHASES},
        "hospital": {phase: median([h["seconds"][phase] for h in hospital_rounds]) for phase in _HOSPITAL_PHASES},
        "update_bytes": median([h["update_bytes"] for h in hospital_rounds]),
        "validation_accuracy": report["final"]["validation_accuracy"],
    }


def results_table(runs: dict[str, dict[str, list[dict]]], args: argparse.Namespace) -> str:
    lines = _table_head(args)
    verdicts = []
    for setting, modes in runs.items():
        ratios = _ratios_to_plaintext(modes)
        lines += [_mode_row(setting, mode, results, ratios[mode]) for mode, results in modes.items()]
        verdicts += _verdicts(setting, modes, ratios)
    lines += ["", *verdicts, "", "## Settings", ""]
    lines += _settings_lines(runs)
    lines += ["", _PHASES_EXPLAINED]
    return "\n".join(lines) + "\n"


def _table_head(args: argparse.Namespace) -> list[str]:
    """The title, how the figures were made, and the table's header rows."""
    return [
        "# Secure aggregation's cost in a whole Dopamine round",
        "",
        f"Command: `consilium-bench-round{''.join(' ' + a for a in sys.argv[1:])}` on {_machine(args)}. Each setting ran "
        "its pairs of `consilium-federation` runs (listed under Settings) on this machine, alternating which mode went "
        "first; a run's seconds are medians over its rounds after the first, and each cell is the median over the pairs. The "
        "ratio is each pair's round over its plaintext round: their median, and their range in brackets. "
        "`plaintext` is `--insecure-plaintext-benchmark`: the same round with the updates sent and summed in the clear "
        "(no privacy).",
        "",
        "| setting | mode | round (s) | ratio to plaintext | hospital: train | encrypt | decrypt | server: collect | "
        "aggregate | release | evaluate | update bytes | validation accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def _ratios_to_plaintext(modes: dict[str, list[dict]]) -> dict[str, list[float]]:
    """Each mode's rounds over the plaintext rounds, run by run in pair order."""
    return {
        mode: [run["summary"]["round"] / plain["summary"]["round"] for run, plain in zip(results, modes["plaintext"])]
        for mode, results in modes.items()
    }


def _mode_row(setting: str, mode: str, results: list[dict], ratios: list[float]) -> str:
    """The table's row for one mode of one setting: medians over its runs."""
    median = statistics.median
    s = [result["summary"] for result in results]
    phases = [
        *(_median_of(s, "hospital", p) for p in _HOSPITAL_PHASES),
        *(_median_of(s, "server", p) for p in _SERVER_PHASES),
    ]
    cells = [
        setting,
        mode,
        f"{median(x['round'] for x in s):.3f}",
        f"{median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
        *phases,
        f"{median(x['update_bytes'] for x in s):,.0f}",
        f"{median(x['validation_accuracy'] for x in s):.3f}",
    ]
    return "| " + " | ".join(cells) + " |"


def _verdicts(setting: str, modes: dict[str, list[dict]], ratios: dict[str, list[float]]) -> list[str]:
    """Whether the setting met its target, if it has one, and how it fared against Flower, if Flower ran."""
    secure = statistics.median(ratios["secure"])
    verdicts = []
    if setting in _TARGETS:
        verdicts.append(
            f"- Secure round at most {_TARGETS[setting]}x plaintext at about {setting} parameters and K = 5: "
            f"{secure:.2f}x, **{'met' if secure <= _TARGETS[setting] else 'not met'}**."
        )
    if FLOWER in modes:
        verdicts.append(_against_flower(setting, modes))
    return verdicts


def _settings_lines(runs: dict[str, dict[str, list[dict]]]) -> list[str]:
    """Each setting's command line, and how Flower ran where it did."""
    lines = [
        f"- **{setting}**: {SETTINGS[setting]['what']}; {len(runs[setting]['secure'])} pair(s); "
        f"`{' '.join(runs[setting]['secure'][0]['argv'])}`"
        for setting in runs
    ]
    flowers = [r["summary"] for modes in runs.values() for r in modes.get(FLOWER, [])]
    if flowers:
        lines.append(
            f"- **{FLOWER}**: the same setting's round over Flower's SecAgg+ (`SecAggPlusWorkflow` with "
            f"`secaggplus_mod`, Flower's simulation engine, one CPU per virtual client), settings "
            f"`{json.dumps(flowers[0]['secaggplus'])}`; each client runs Consilium's Dopamine step and sends its share "
            "of the mean gradient, which Flower clips to the clipping range (the largest magnitude sent was "
            f"{max(f['largest_value'] for f in flowers):.3g}, so nothing was clipped), quantises and masks. Its update "
            "bytes are every payload byte of a client's four SecAgg+ replies in a round."
        )
    return lines


def _median_of(summaries: list[dict], party: str, phase: str) -> str:
    """A phase's median seconds, or a dash where the mode does not time its phases (Flower)."""
    timed = [s[party][phase] for s in summaries if party in s]
    return f"{statistics.median(timed):.3f}" if timed else "-"


def _against_flower(setting: str, modes: dict[str, list[dict]]) -> str:
    """Which secure round is faster, and whose upload is smaller, in plain words."""
    median = statistics.median
    ours, theirs = ([r["summary"] for r in modes[m]] for m in ("secure", FLOWER))
    round_ours, round_theirs = median(s["round"] for s in ours), median(s["round"] for s in theirs)
    bytes_ours, bytes_theirs = median(s["update_bytes"] for s in ours), median(s["update_bytes"] for s in theirs)
    faster = (
        f"Consilium's secure round is {round_theirs / round_ours:.2f}x as fast as Flower SecAgg+'s "
        f"({round_ours:.3f} s against {round_theirs:.3f} s)"
        if round_ours <= round_theirs
        else f"Flower SecAgg+'s round is {round_ours / round_theirs:.2f}x as fast as Consilium's secure round "
        f"({round_theirs:.3f} s against {round_ours:.3f} s)"
    )
    return (
        f"- Against Flower SecAgg+ at {setting}: {faster}; a "
        f"Consilium hospital uploads {bytes_ours:,.0f} bytes a round, a Flower client {bytes_theirs:,.0f} "
        f"({bytes_theirs / bytes_ours:.2f}x); validation accuracy after the same rounds "
        f"{median(s['validation_accuracy'] for s in ours):.3f} against {median(s['validation_accuracy'] for s in theirs):.3f}."
    )


def _machine(args: argparse.Namespace) -> str:
    """The CPU and its cores, and the GPU where the models computed on one."""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = "an unknown CPU"
    shown = f"{cpu}, {os.cpu_count()} cores"
    if args.device and args.device.startswith("cuda"):
        import torch

        shown += f", training and scoring on {torch.cuda.get_device_name(torch.device(args.device))}"
    return shown


if __name__ == "__main__":
    main()
