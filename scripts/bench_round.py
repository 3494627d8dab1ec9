"""consilium-bench-round: what secure aggregation adds to a whole Dopamine round, phase by phase.

Each setting runs twice as a real ``consilium-federation`` (a server and K hospital processes over
CurveZMQ), with the same model, data, K, seed and rounds:

- ``secure``: the protocol as it is, BFV uploads with check slots, the encrypted sum, decryption;
- ``plaintext``: ``--insecure-plaintext-benchmark`` (``crypto.insecure_plaintext``), the same round
  with the integer updates sent and summed in the clear, and nothing else changed.

The hospitals send at once (``--send-offset 0``): the offset that hides a round's compute time
would otherwise hide the encryption time too. A round's wall time is the server's, from RoundStart
to the evaluated model: ``collect`` (the hospitals' step, encryption and upload, and the server's
additions) + ``release`` (the sum down, decryption, endorsements, the mean back) + ``evaluate``.
Figures are medians over the rounds after the first (warm-up). Every process shares this machine's
cores, as in the README's main job.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from scripts import federation
from scripts._cli import positive_int, run

SETTINGS = {
    "default": {"what": "the main job's model: MLP 30-48-2 on breast_cancer, K = 3", "argv": ["--hospitals", "3"]},
    "1M": {
        "what": "MLP 64-1024-880-10 (977,370 parameters) on digits, K = 5",
        "argv": ["--data", "digits", "--hospitals", "5", "--hidden", "1024,880"],
    },
}
MODES = {"secure": [], "plaintext": ["--insecure-plaintext-benchmark"]}
_SERVER_PHASES = ("collect", "aggregate", "release", "evaluate")
_HOSPITAL_PHASES = ("train", "encrypt", "decrypt")
_TARGET_RATIO = 1.25  # issue 8: the secure round at most 1.25x the plaintext one at about 1M parameters, K = 5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-bench-round",
        description="Time the same Dopamine federation with secure aggregation on and off (an insecure plaintext "
        "mode that exists only for this comparison), phase by phase; write results.md and results.json.",
    )
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), help="which to run")
    parser.add_argument("--rounds", type=positive_int, default=12, help="rounds per run, the first not counted (default: 12)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data split and partition (default: 0)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_round"), help="where the table goes")
    parser.add_argument("--work", type=Path, default=Path("runs/bench_round"), help="where each run's files go")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(run(lambda: benchmark(args)))


def benchmark(args: argparse.Namespace) -> None:
    if args.rounds < 2:
        raise ValueError("--rounds must be at least 2: the first round is warm-up")
    runs: dict[str, dict[str, dict]] = {}
    for setting in args.settings:
        for mode, mode_argv in MODES.items():
            out = args.work / f"{setting}-{mode}"
            argv = [
                *SETTINGS[setting]["argv"], *mode_argv, "--rounds", str(args.rounds), "--seed", str(args.seed),
                "--send-offset", "0", "--epsilon-budget", "1000", "--out", str(out),
            ]  # fmt: skip
            print(f"== {setting}, {mode}: consilium-federation {' '.join(argv)}", flush=True)
            report = federation.run_federation(federation.build_parser().parse_args(argv))
            runs.setdefault(setting, {})[mode] = {"argv": argv, "summary": summarise(report)}
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


def results_table(runs: dict[str, dict[str, dict]], args: argparse.Namespace) -> str:
    lines = [
        "# Secure aggregation's cost in a whole Dopamine round",
        "",
        f"Command: `consilium-bench-round{''.join(' ' + a for a in sys.argv[1:])}`. Each row is one `consilium-federation` "
        f"run of {args.rounds} rounds on this machine; seconds are medians over rounds 2 to {args.rounds}. `plaintext` is "
        "`--insecure-plaintext-benchmark`: the same round with the updates sent and summed in the clear (no privacy).",
        "",
        "| setting | mode | round (s) | ratio to plaintext | hospital: train | encrypt | decrypt | server: collect | "
        "aggregate | release | evaluate | update bytes | validation accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for setting, modes in runs.items():
        plain = modes["plaintext"]["summary"]["round"]
        for mode, result in modes.items():
            s = result["summary"]
            lines.append(
                "| " + " | ".join([
                    setting, mode, f"{s['round']:.3f}", f"{s['round'] / plain:.2f}x",
                    *(f"{s['hospital'][p]:.3f}" for p in _HOSPITAL_PHASES),
                    *(f"{s['server'][p]:.3f}" for p in _SERVER_PHASES),
                    f"{s['update_bytes']:,.0f}", f"{s['validation_accuracy']:.3f}",
                ]) + " |"
            )  # fmt: skip
        if setting == "1M":
            ratio = modes["secure"]["summary"]["round"] / plain
            verdicts.append(f"- Secure round at most {_TARGET_RATIO}x plaintext at about 1M parameters and K = 5: "
                            f"{ratio:.2f}x, **{'met' if ratio <= _TARGET_RATIO else 'not met'}**.")
    lines += ["", *verdicts, "", "## Settings", ""]
    lines += [f"- **{setting}**: {SETTINGS[setting]['what']}; `{' '.join(runs[setting]['secure']['argv'])}`" for setting in runs]
    lines += [
        "",
        "Phases: `train` is the hospital's DP-SGD step with its noise share; `encrypt` encodes, encrypts and serialises "
        "the update (plaintext: packs it); `decrypt` decrypts, checks and decodes the sum; `collect` runs from RoundStart "
        "to the last update in; `aggregate` is the server's deserialising and adding (within collect); `release` runs "
        "from the sum's sending to the released mean; `evaluate` applies it and scores the validation split.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
