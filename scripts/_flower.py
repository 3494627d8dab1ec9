"""The round benchmark's peer: the same Dopamine round over Flower's SecAgg+ (``consilium-bench-round --flower``).

Flower (https://flower.ai) is a peer system, run here as its users run it: its simulation runtime
(Ray) starts K virtual clients, ``SecAggPlusWorkflow`` on the server and ``secaggplus_mod`` on each
client mask and sum the clients' vectors (SecAgg+: pairwise masks from Diffie-Hellman keys, Shamir
shares of the seeds for dropouts). What the clients sum is exactly what Consilium's hospitals sum:
each runs Consilium's own Dopamine step (``training.methods.dopamine``: Poisson sampling, per-example
clipping, randomised rounding and its share of Skellam noise) on its part of the same data, and
uploads its share over the federation-wide divisor, ``s_k / (gamma B)``; Flower's FedAvg averages
them with weight 1, which is Dopamine's mean gradient, and the server applies it with Dopamine's
momentum rule to the same model. Flower quantises each value within ``[-8, 8]`` to 2^22 levels
(stochastically) and masks modulo 2^32.

Measured as Consilium's round is: from the round's start (``configure_fit``) to the evaluated
model, medians over the rounds after the first; the upload is every byte a client's SecAgg+ replies
carry in a round (keys, encrypted shares, the masked vector, the unmasking shares), payloads only.

Needs the optional dependency group ``bench-flower`` (``pip install -e '.[bench-flower]'``), which
nothing else of Consilium imports.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from consilium.orchestration.run_flags import build_run_config
from consilium.orchestration.spec import RunSpec, resolve
from consilium.protocol.run.rules import ConfigError
from consilium.training.data.datasets import Split
from consilium.training.methods.dopamine import mean_gradient
from consilium.training.models.evaluation import evaluate
from consilium.training.models.build import build_model, get_flat_parameters, set_flat_parameters
from consilium.training.data.partition import partition

__all__ = ["require_flower", "run_flower_secaggplus"]

_BYTES_FILE = "CONSILIUM_FLOWER_BYTES"  # where each client's SecAgg+ replies are counted


def require_flower() -> None:
    """``ConfigError`` in one line where Flower's simulation engine is not installed."""
    try:
        import flwr.simulation  # noqa: F401
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("--flower needs Flower's simulation engine: pip install -e '.[bench-flower]'") from None


def run_flower_secaggplus(spec: RunSpec) -> dict:
    """``spec``'s Dopamine run over Flower's SecAgg+; its summary as ``consilium-bench-round``'s ``summarise`` gives."""
    require_flower()
    # Flower is optional, so its names are imported here and handed to the helpers that build on them.
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.simulation import run_simulation

    spec, data = resolve(spec)
    config = build_run_config(spec.values(), tuple(f"hospital-{k}" for k in range(1, spec.hospitals + 1)), data)
    parts = partition(data.train.y, spec.hospitals, spec.partition, seed=spec.seed, alpha=spec.alpha)
    settings, model_spec = config.training, config.model
    model = build_model(model_spec)
    mechanism = settings.mechanism(sum(p.numel() for p in model.parameters()))
    rule = settings.update_rule(model)
    timings: dict[int, list[float]] = {}
    accuracy: dict[int, float] = {}

    client_fn = _dopamine_client_fn(NumPyClient, data, parts, model_spec, settings, mechanism)
    strategy = _dopamine_strategy(
        FedAvg,
        ndarrays_to_parameters,
        parameters_to_ndarrays,
        model=model,
        rule=rule,
        timings=timings,
        evaluate_fn=_scorer(model, data, timings, accuracy),
        hospitals=spec.hospitals,
    )
    server_app = ServerApp()
    workflow = SecAggPlusWorkflow(
        num_shares=spec.hospitals, reconstruction_threshold=spec.hospitals // 2 + 1, timeout=spec.round_timeout
    )

    @server_app.main()
    def main(grid, context) -> None:
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=spec.rounds), strategy=strategy)
        DefaultWorkflow(fit_workflow=workflow)(grid, legacy)

    client_app = ClientApp(client_fn=client_fn, mods=[_count_upload, secaggplus_mod])
    uploads, peak = _simulate(run_simulation, server_app, client_app, spec.hospitals)
    return _summary(timings, accuracy, mechanism, workflow, uploads, peak)


def _dopamine_client_fn(numpy_client: type, data, parts: list[np.ndarray], model_spec, settings, mechanism):
    """Flower's ``client_fn``: a client on its partition of the training records that runs Consilium's Dopamine step
    and replies with its share of the mean gradient."""

    # Ray pickles client_fn, with all it closes over, for every message a virtual client handles: so it closes over
    # only what a client needs, never the server's model.
    class Client(numpy_client):
        def __init__(self, records: Split) -> None:
            self.model = build_model(model_spec)
            self.step = settings.local_step(self.model, records)

        def fit(self, parameters, config):
            set_flat_parameters(self.model, parameters[0])
            share, _ = self.step()
            mean = mean_gradient(share, 1, mechanism=mechanism, settings=settings)
            with open(os.environ[_BYTES_FILE], "a") as counted:  # Flower clips what lies beyond its range
                counted.write(f"peak {float(np.abs(mean).max())!r}\n")
            return [mean], 1, {}

    # Flower reads this signature: its one argument must be the context, not a ``cid``.
    def client_fn(context):
        return Client(data.train.subset(parts[int(context.node_config["partition-id"])])).to_client()

    return client_fn


def _dopamine_strategy(
    fedavg: type, ndarrays_to_parameters, parameters_to_ndarrays, *, model, rule, timings, evaluate_fn, hospitals: int
):
    """Flower's FedAvg over every client, each round timed from ``configure_fit``, its weight-1 average applied to
    ``model`` as Dopamine's mean gradient with ``rule``'s momentum."""

    class DopamineOverSecAgg(fedavg):
        def configure_fit(self, server_round, parameters, client_manager):
            timings[server_round] = [time.perf_counter()]
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):
            averaged, metrics = super().aggregate_fit(server_round, results, failures)
            rule.apply(parameters_to_ndarrays(averaged)[0].astype("<f4"))  # the mean gradient, with momentum
            return ndarrays_to_parameters([get_flat_parameters(model)]), metrics

    return DopamineOverSecAgg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=hospitals,
        min_available_clients=hospitals,
        initial_parameters=ndarrays_to_parameters([get_flat_parameters(model)]),
        evaluate_fn=evaluate_fn,
    )


def _scorer(model, data, timings: dict[int, list[float]], accuracy: dict[int, float]):
    """Flower's ``evaluate_fn``: after each round, the model's validation accuracy, and the round's end time."""

    def scored(server_round, parameters, config):
        if server_round > 0:
            accuracy[server_round] = evaluate(model, data.validation, num_classes=data.num_classes)["accuracy"]
            timings[server_round].append(time.perf_counter())
        return None  # Flower then evaluates nothing more

    return scored


def _simulate(run_simulation, server_app, client_app, hospitals: int) -> tuple[list[int], float]:
    """Run Flower's simulation with its logging quieted; each client's upload a round, and the largest value sent."""
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    with tempfile.TemporaryDirectory(prefix="consilium-flower-") as counted:
        os.environ[_BYTES_FILE] = str(Path(counted) / "bytes")
        flwr_logger.setLevel(logging.ERROR)
        try:
            run_simulation(
                server_app=server_app,
                client_app=client_app,
                num_supernodes=hospitals,
                backend_config={
                    "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                    "init_args": {"log_to_driver": False, "logging_level": logging.ERROR},
                },
            )
        finally:
            flwr_logger.setLevel(level)
        return _uploads(Path(counted) / "bytes")


def _summary(timings, accuracy, mechanism, workflow, uploads: list[int], peak: float) -> dict:
    """The run's figures, medians over the rounds after the first, as ``summarise`` gives Consilium's."""
    rounds = sorted(r for r, t in timings.items() if len(t) == 2)[1:]
    if not rounds:
        raise ConfigError("Flower's run released no round after the first")
    return {
        "rounds": len(rounds),
        "parameters": mechanism.dimension,
        "round": statistics.median(timings[r][1] - timings[r][0] for r in rounds),
        "update_bytes": statistics.median(uploads) if uploads else 0,
        "validation_accuracy": accuracy[max(accuracy)],
        "largest_value": peak,
        "secaggplus": {
            "num_shares": workflow.num_shares,
            "reconstruction_threshold": workflow.reconstruction_threshold,
            "clipping_range": workflow.clipping_range,
            "quantization_range": workflow.quantization_range,
            "modulus_range": workflow.modulus_range,
        },
    }


def _count_upload(message, context, call_next):
    """A client mod around SecAgg+'s: the payload bytes of each reply it makes, appended to a file."""
    reply = call_next(message, context)
    payload = sum(_payload(value) for record in reply.content.config_records.values() for value in record.values())
    with open(os.environ[_BYTES_FILE], "a") as counted:
        counted.write(f"{context.node_id} {payload}\n")
    return reply


def _payload(value) -> int:
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, list):
        return sum(_payload(item) for item in value)
    return np.asarray(value).nbytes


def _uploads(path: Path) -> tuple[list[int], float]:
    """Each client's bytes a round (its four SecAgg+ replies: setup, keys, masked vector, unmasking, summed), and
    the largest magnitude any client sent."""
    by_client: dict[str, list[int]] = {}
    peak = 0.0
    for line in path.read_text().splitlines():
        first, second = line.split()
        if first == "peak":
            peak = max(peak, float(second))
        else:
            by_client.setdefault(first, []).append(int(second))
    return [sum(sizes[i : i + 4]) for sizes in by_client.values() for i in range(0, len(sizes) - 3, 4)], peak
