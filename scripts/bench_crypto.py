"""consilium-bench-crypto: what secure aggregation costs, against plaintext and two common HE setups.

For each vector length ``d`` and number of hospitals ``K``, every scheme goes through the same
three steps, timed on one core:

1. **upload**, at each hospital: encode, encrypt and serialise one update;
2. **aggregate**, at the server: deserialise and add each upload (reported per upload);
3. **download**, back at a hospital: the server serialises the sum, the hospital deserialises,
   decrypts and decodes it (for Consilium: one hospital's whole part of opening the sum, below).

The schemes, side by side (each a class of ``scripts/_crypto_backends.py``):

- ``plaintext-float32``: the update as float32 bytes, summed in float32 (no protection at all);
- ``tenseal-bfv-default``: TenSEAL's BFV vector at its default coefficient moduli for N = 4096
  ([36, 36, 37] bits), t = 1032193, values in fixed point;
- ``tenseal-ckks-nvflare``: TenSEAL's CKKS vector with NVFlare's defaults (N = 8192, [60, 40, 40],
  scale 2^40);
- ``consilium``: the one-time-key round (``docs/explanation/secure-round.md``) at the parameters a
  Dopamine run computes for ``K`` hospitals and ``d`` (its ``K`` key shares counted in the upload),
  through ``protocol.secure_round``, threshold ``floor(K/2) + 1``: the upload is the encryption, the
  dealing and the ``K`` sealed shares (the shares' bytes are counted); the download is one
  hospital's whole part after its upload: opening its shares, endorsing, proving its dealing,
  checking every proof against its shares, releasing, checking every release, rebuilding the key,
  decrypting and checking the zero slots. The other ``K - 1`` hospitals' steps run untimed.

The TenSEAL rows encrypt with the public key, as TenSEAL and NVFlare do by default. Only
Consilium's parameters depend on ``K``; the other schemes are measured once per ``d``. Each
measurement uses ``--contributions`` distinct uploads (at least ``K`` for Consilium, whose quorum
is every hospital), after one untimed upload and addition: timings are medians per upload, and the
sum is checked against the plaintext sum (CKKS: its largest error is reported). Everything runs
pinned to one core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from consilium.scripts._cli import run
from consilium.scripts._crypto_backends import BACKENDS
from consilium.training.methods.flags import positive_float, positive_int

SCHEMES = tuple(BACKENDS)


@dataclass
class Measurement:
    scheme: str
    length: int
    hospitals: int | None  # None: the scheme does not depend on K
    contributions: int
    upload_bytes: int
    upload_ratio: float  # to the update's float32 bytes
    upload_seconds: float  # median over the contributions
    aggregate_seconds: float  # median over the contributions, one addition each
    download_seconds: float
    max_error: float  # of the decoded sum against the plaintext sum
    parameters: str

    @property
    def upload_values_per_second(self) -> float:
        return self.length / self.upload_seconds

    @property
    def aggregate_values_per_second(self) -> float:
        return self.length / self.aggregate_seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-bench-crypto",
        description="Measure upload, aggregation and download time and wire bytes of Consilium's BFV against "
        "plaintext float32, TenSEAL's default BFV and NVFlare-default CKKS; write results.md, results.json and plots.",
    )
    parser.add_argument(
        "--lengths", type=positive_int, nargs="+", default=[10**4, 10**5, 10**6, 10**7], help="vector lengths d"
    )
    parser.add_argument(
        "--hospitals", type=positive_int, nargs="+", default=[3, 10], help="numbers of hospitals K (at least 3)"
    )
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES), help="which schemes to measure")
    parser.add_argument(
        "--contributions", type=positive_int, default=10, help="distinct uploads per measurement (at least K)"
    )
    parser.add_argument(
        "--noise-multiplier", type=positive_float, default=2.3, help="Dopamine's sigma, for Consilium's parameters"
    )
    parser.add_argument("--max-grad-norm", type=positive_float, default=1.0, help="Dopamine's C")
    parser.add_argument(
        "--expected-batch-size",
        type=positive_float,
        default=15.0,
        help="Dopamine's B: records a hospital samples per round",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("results/bench_crypto"), help="where results.md, results.json and plots go"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(run(lambda: benchmark(args)))


def benchmark(args: argparse.Namespace) -> list[Measurement]:
    _one_core()
    cells = [
        (scheme, length, k)
        for length in args.lengths
        for scheme in args.schemes
        for k in (args.hospitals if scheme.startswith("consilium") else [None])
    ]
    measurements = []
    with tqdm(cells, desc="crypto benchmark", unit="cell", file=sys.stderr) as progress:
        for scheme, length, hospitals in progress:
            progress.set_postfix_str(f"{scheme} d={length:.0e}" + (f" K={hospitals}" if hospitals else ""))
            measurements.append(_measure(scheme, length, hospitals, args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({"argv": sys.argv[1:], "cpu": _cpu(), "measurements": [asdict(m) for m in measurements]}, indent=1)
    )
    (args.out / "results.md").write_text(results_table(measurements, args))
    plot(measurements, args.out)
    print(f"results: {args.out / 'results.md'}")
    return measurements


def _measure(
    scheme: str,
    length: int,
    hospitals: int | None,
    args: argparse.Namespace,
    *,
    repeats: int = 1,
) -> Measurement:
    contributions = min(args.contributions, hospitals or args.contributions)
    backend = BACKENDS[scheme](length, hospitals or max(args.hospitals), args)
    updates = [backend.update(np.random.default_rng(seed)) for seed in range(contributions)]
    backend.add(backend.new_sum(), backend.upload(updates[0], 0))  # warm-up, untimed: first-call allocations
    upload_seconds, aggregate_seconds, download_seconds = [], [], []
    for _ in range(repeats):
        uploads = []
        for index, update in enumerate(updates):
            start = time.perf_counter()
            uploads.append(backend.upload(update, index))
            upload_seconds.append(time.perf_counter() - start)
        total = backend.new_sum()
        for upload in uploads:
            start = time.perf_counter()
            total = backend.add(total, upload)
            aggregate_seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        decoded = backend.download(total, contributions)
        download_seconds.append(time.perf_counter() - start - getattr(backend, "untimed", 0.0))
    expected = np.sum([np.asarray(u, dtype=np.float64) for u in updates], axis=0)
    wire = _wire_bytes(uploads[0])
    return Measurement(
        scheme=scheme,
        length=length,
        hospitals=hospitals,
        contributions=contributions,
        upload_bytes=wire,
        upload_ratio=wire / (4 * length),
        upload_seconds=statistics.median(upload_seconds),
        aggregate_seconds=statistics.median(aggregate_seconds),
        download_seconds=statistics.median(download_seconds),
        max_error=float(np.max(np.abs(np.asarray(decoded, dtype=np.float64) - expected))),
        parameters=backend.parameters,
    )


def _wire_bytes(upload: bytes | list[bytes] | tuple[list[bytes], dict[str, bytes]]) -> int:
    if isinstance(upload, tuple):  # the one-time round: the ciphertexts and the sealed shares
        chunks, boxes = upload
        return _wire_bytes(chunks) + sum(len(box) for box in boxes.values())
    return len(upload) if isinstance(upload, bytes) else sum(len(chunk) for chunk in upload)


def results_table(measurements: list[Measurement], args: argparse.Namespace) -> str:
    lines = [
        "# Crypto overhead: Consilium's BFV against plaintext, TenSEAL's default BFV and NVFlare-default CKKS",
        "",
        f"Command: `{' '.join(['consilium-bench-crypto', *sys.argv[1:]])}` on {_cpu()}, pinned to one core. "
        f"Each cell: {args.contributions} distinct uploads (fewer when K is smaller); "
        "upload and aggregation times are medians over the uploads (one addition each), download is the server serialising the sum and a "
        "hospital deserialising, decrypting, decoding (and, for Consilium, checking) it. Consilium's parameters are "
        f"the ones a Dopamine run computes for K hospitals and d parameters (sigma {args.noise_multiplier}, "
        f"C {args.max_grad_norm}, B {args.expected_batch_size}); the other schemes do not depend on K.",
        "",
        "| scheme | d | K | upload bytes / float32 | upload (M values/s) | aggregate (M values/s per upload) "
        "| download (s) | largest error of the sum | parameters |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in measurements:
        lines.append(
            f"| {m.scheme} | {m.length:.0e} | {m.hospitals or 'any'} | {m.upload_ratio:.2f}x | "
            f"{m.upload_values_per_second / 1e6:.2f} | {m.aggregate_values_per_second / 1e6:.1f} | "
            f"{m.download_seconds:.3f} | {m.max_error:.2g} | {m.parameters} |"
        )
    lines += ["", "## Targets", ""] + _targets(measurements)
    return "\n".join(lines) + "\n"


def _targets(measurements: list[Measurement]) -> list[str]:
    consilium = [m for m in measurements if m.scheme == "consilium"]
    if not consilium:
        return ["(Consilium was not measured.)"]
    ratio = max(consilium, key=lambda m: m.upload_ratio)
    upload = min(consilium, key=lambda m: m.upload_values_per_second)
    aggregate = min(consilium, key=lambda m: m.aggregate_values_per_second)
    lines = [
        f"- Upload at most 1.1x float32 for K <= 100: largest {ratio.upload_ratio:.3f}x (d {ratio.length:.0e}, K {ratio.hospitals}): "
        f"{'met' if ratio.upload_ratio <= 1.1 else 'not met'}.",
        f"- Upload (encode, encrypt, serialise) at least 2M values/s on one core: slowest {upload.upload_values_per_second / 1e6:.2f}M "
        f"(d {upload.length:.0e}, K {upload.hospitals}): {'met' if upload.upload_values_per_second >= 2e6 else 'not met'}.",
        f"- Aggregation at least 10M values/s on one core: slowest {aggregate.aggregate_values_per_second / 1e6:.1f}M "
        f"(d {aggregate.length:.0e}, K {aggregate.hospitals}): {'met' if aggregate.aggregate_values_per_second >= 1e7 else 'not met'}.",
    ]
    return lines


def plot(measurements: list[Measurement], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (
        ("upload bytes / float32", lambda m: m.upload_ratio),
        ("upload: M values/s", lambda m: m.upload_values_per_second / 1e6),
        ("aggregation: M values/s per upload", lambda m: m.aggregate_values_per_second / 1e6),
    )
    for axis, (title, value) in zip(axes, panels):
        for label, series in _series(measurements).items():
            axis.plot([m.length for m in series], [value(m) for m in series], marker="o", label=label)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("values per update (d)")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "crypto_overhead.png", dpi=120)
    plt.close(figure)


def _series(measurements: list[Measurement]) -> dict[str, list[Measurement]]:
    series: dict[str, list[Measurement]] = {}
    for m in measurements:
        label = m.scheme + (f", K={m.hospitals}" if m.hospitals else "")
        series.setdefault(label, []).append(m)
    return series


def _one_core() -> None:
    """Every scheme on the same single core: TenSEAL's contexts otherwise start a thread per core."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def _cpu() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "an unknown CPU"
    return f"{model} ({os.cpu_count()} cores)"


if __name__ == "__main__":
    main()
