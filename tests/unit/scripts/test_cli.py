"""What a user sees from the launchers: help everywhere, and one line for a mistake."""

import contextlib
import importlib.util
import io
import json
import logging
import subprocess

import pytest

from conftest import run_launcher
from consilium.protocol.run.checkpoint import Checkpoint
from consilium.protocol.run.rules import ConfigError
from consilium.protocol.identity.roster import local_federation
from consilium.scripts import federation
from consilium.orchestration.run_flags import (
    FEDERATION_METHODS,
    build_run_config,
    resolve_data_defaults,
    resolve_run_arguments,
)
from scripted_peers import small_run_config
from consilium.training.data.datasets import load_dataset
from consilium.training.models.build import build_model, get_flat_parameters


@pytest.mark.parametrize(
    "module",
    [
        "keygen",
        "provision",
        "roster",
        "server",
        "tallier",
        "hospital",
        "federation",
        "compare",
        "bench_crypto",
        "bench_round",
        "bench_tallier",
    ],
)
def test_every_launcher_has_help(module):
    result = run_launcher(module, "--help")
    assert result.returncode == 0 and "usage:" in result.stdout


def _assert_one_line_error(returncode, stderr, fragment):
    assert returncode == 2, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], stderr


def _run_in_this_process(monkeypatch, module, *args):
    """A launcher's ``main`` as its console script calls it, with its stderr and exit status.

    The same code as a launched process minus the interpreter's start (seconds of importing torch
    and Opacus each). As in a fresh process, the root logger has no handler, so a logged traceback
    reaches the captured stderr; an exception that escapes ``main`` fails the test as a traceback
    would, and so does starting a process: every mistake is refused before any process starts.
    """

    def no_process(*args, **kwargs):
        raise AssertionError(f"{module} started a process before refusing the mistake: {args}")

    stderr = io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    with monkeypatch.context() as patch:
        patch.setattr(subprocess, "Popen", no_process)
        patch.setattr(
            "consilium.scripts._run._reuse_freed_memory", lambda: None
        )  # glibc's settings would outlive the call
        root.handlers = []
        try:
            with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exit:
                importlib.import_module(f"consilium.scripts.{module}").main([str(arg) for arg in args])
        finally:
            root.handlers, root.level = handlers, level
    return exit.value.code, stderr.getvalue()


def test_a_launched_process_reports_a_mistake_in_one_line(tmp_path):
    result = run_launcher("hospital", "--federation", tmp_path / "nowhere", "--name", "hospital-1")
    _assert_one_line_error(result.returncode, result.stderr, "only a party new to the federation makes keys")


def test_user_mistakes_get_one_line(tmp_path, monkeypatch):
    federation = tmp_path / "federation"
    roster = local_federation(federation, hospitals=3, address="tcp://127.0.0.1:5999")
    confirmed = ["--federation", federation, "--roster-fingerprint", roster.fingerprint]
    hospital = [*confirmed, "--name", "hospital-1"]
    server = [*confirmed, "--out", tmp_path / "out", "--expected-batch-size", "5"]
    used = tmp_path / "used"
    used.mkdir()
    (used / "privacy_ledger.jsonl").write_text("")
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "checkpoint.json").write_text('{"format": "consilium-server-checkpoint", "version": 1, "config"')
    secure = tmp_path / "secure"  # a checkpointed run with secure aggregation, before its first round
    config = small_run_config(roster, quorum=3, rounds=3)
    model = get_flat_parameters(build_model(config.model)).tobytes()
    Checkpoint(config.to_dict(), model, model, bytes(len(model)), 0, list(config.hospitals), [], {}, []).save(secure)
    damaged = {}  # checkpoints a disk or a hand damaged: each resume refused in one line
    for label, change in (
        ("negative", {"hidden": [-1]}),
        ("huge", {"hidden": [2**64]}),
        ("wide", {"input_shape": [10**9]}),
    ):
        damaged[label] = tmp_path / label
        bad = config.to_dict()
        bad["model"].update(change)
        Checkpoint(bad, model, model, bytes(len(model)), 0, list(config.hospitals), [], {}, []).save(damaged[label])
    for label, change in (("not_bytes", {"initial_parameters": {}}), ("joins", {"joins": [{"hospital": "h"}]})):
        damaged[label] = tmp_path / label  # well-formed JSON, with a field that is not what it must be
        damaged[label].mkdir()
        record = json.loads((secure / "checkpoint.json").read_text())
        (damaged[label] / "checkpoint.json").write_text(json.dumps({**record, **change}))
    damaged["cut"] = tmp_path / "cut"
    damaged["cut"].mkdir()
    (damaged["cut"] / "checkpoint.json").write_bytes((secure / "checkpoint.json").read_bytes()[:-40])
    cases = [
        (("hospital", *hospital, "--data", tmp_path / "missing.npz"), "no dataset file"),
        (
            ("hospital", "--federation", tmp_path / "nowhere", "--name", "hospital-1"),
            "only a party new to the federation makes keys",
        ),
        (
            ("hospital", *hospital, "--parts", "2", "--part", "3"),
            "give one --part between 1 and --parts (2) for each --name",
        ),
        (
            ("hospital", *hospital, "--name", "hospital-2"),
            "several --name in one process are for simulating voting runs",
        ),
        (
            ("federation", "--out", tmp_path / "many", "--hospitals-per-process", "2"),
            "--hospitals-per-process is for voting runs",
        ),
        (
            ("federation", "--out", tmp_path / "vote", "--method", "knn-dpfl", "--insecure-plaintext-benchmark"),
            "not for knn-dpfl",
        ),
        (("hospital", *hospital, "--method", "knn-dpfl", "--insecure-plaintext-benchmark"), "not for voting"),
        (
            ("hospital", *confirmed, "--name", "hospital-7"),
            "hospital-7/secret_keys.toml (this party's keys stay in the folder",
        ),
        (("hospital", "--federation", federation, "--name", "hospital-2"), "the roster is not confirmed"),
        (
            ("hospital", *confirmed[:2], "--roster-fingerprint", "12345", "--name", "hospital-2"),
            "the roster's fingerprint is",
        ),
        (("server", *server, "--data", tmp_path / "missing.npz"), "no dataset file"),
        (("server", *server, "--model", "cnn"), "the CNN needs"),
        (("server", *server, "--quorum", "4"), "exceeds the 3 hospitals"),
        (("server", *server, "--rejoin-window", "100000"), "must be at most 86400 s"),
        (("server", *server, "--method", "knn-dpfl", "--rejoin-window", "60"), "--rejoin-window is for training runs"),
        (("server", *server, "--quorum", "2"), "the quorum must be at least the threshold plus one (3)"),
        (
            ("provision", "--out", federation, "--address", "tcp://h:1", federation / "server" / "server.public.toml"),
            "already holds a roster",
        ),
        (
            ("keygen", "--role", "hospital", "--name", "hospital-1", "--out", federation / "hospital-1"),
            "holds a party's keys already",
        ),
        (
            ("keygen", "--role", "tallier", "--name", "tallier-1", "--out", tmp_path / "t1"),
            "a tallier needs its MPC address",
        ),
        (("server", *confirmed, "--out", used, "--expected-batch-size", "5"), "already holds a run"),
        (("server", *confirmed, "--out", used, "--resume"), "holds no checkpoint"),
        (("server", *confirmed, "--out", torn, "--resume"), "checkpoint.json is unreadable"),
        *[
            (("server", *confirmed, "--out", folder, "--resume"), "holds an unusable configuration")
            for folder in list(damaged.values())[:3]
        ],
        (("server", *confirmed, "--out", damaged["cut"], "--resume"), "checkpoint.json is unreadable"),
        (
            ("server", *confirmed, "--out", damaged["not_bytes"], "--resume"),
            "is unusable: its model is not float32 values",
        ),
        (("server", *confirmed, "--out", damaged["joins"], "--resume"), "is unusable: 'before_round'"),
        (
            ("server", *confirmed, "--out", secure, "--resume", "--select-every", "3"),
            "resume it with --select-every 1 --select-on accuracy, or without either flag",
        ),
        (
            ("server", *confirmed, "--out", secure, "--resume", "--insecure-plaintext-benchmark"),
            "the checkpointed run uses 'bfv' aggregation",
        ),
        (("server", *confirmed, "--out", tmp_path / "new"), "--expected-batch-size is required"),
        (("federation", "--out", tmp_path / "run", "--data", tmp_path / "missing.npz"), "no dataset file"),
        (("federation", "--out", tmp_path / "fedsgd", "--method", "fedsgd"), "unknown method 'fedsgd'"),
        (
            ("federation", "--out", tmp_path / "v", "--method", "dp-fedavg", "--subclients", "200"),
            "more sub-clients than records",
        ),
        (
            ("federation", "--out", tmp_path / "most-v", "--method", "dp-fedavg", "--adaptive-subclients", "500"),
            "up to v = 500 sub-clients",
        ),
        (
            (
                "federation",
                "--out",
                tmp_path / "first-v",
                "--method",
                "dp-fedavg",
                "--subclients",
                "3",
                "--adaptive-subclients",
                "2",
            ),
            "v = 3 sub-clients is more than the most v may reach, 2",
        ),
        (
            ("federation", "--out", tmp_path / "adaptive", "--adaptive-subclients", "4"),
            "--adaptive-subclients is for dp-fedavg runs",
        ),
        (
            ("federation", "--out", tmp_path / "opt", "--method", "dp-fedavg", "--server-optimizer", "fedprox"),
            "unknown server optimizer 'fedprox'",
        ),
        (
            ("federation", "--out", tmp_path / "local", "--method", "dp-fedavg", "--local-optimizer", "lbfgs"),
            "unknown local optimizer 'lbfgs'",
        ),
        (
            (
                "federation",
                "--out",
                tmp_path / "budget",
                "--method",
                "dp-fedavg",
                "--noise-multiplier",
                "0.5",
                "--epsilon-budget",
                "1",
            ),
            "the first round alone exceeds --epsilon-budget",
        ),
        (
            ("federation", "--out", tmp_path / "dopamine-budget", "--noise-multiplier", "0.3"),
            "the first round alone exceeds",
        ),
        (
            ("federation", "--out", tmp_path / "cross", "--method", "dp-fedavg", "--lr", "0.1"),
            "--lr is for dopamine, central-dp, fedavg-local-dp runs, not dp-fedavg",
        ),
        (
            ("federation", "--out", tmp_path / "c", "--method", "central", "--noise-multiplier", "3"),
            "--noise-multiplier is for dopamine, dp-fedavg runs, not central",
        ),
        (("federation", "--out", tmp_path / "f", "--method", "fedavg", "--epsilon-budget", "3"), "fedavg spends none"),
        (
            ("federation", "--out", tmp_path / "cdp", "--method", "central-dp", "--insecure-plaintext-benchmark"),
            "not for central-dp",
        ),
        (
            ("federation", "--out", tmp_path / "q", "--method", "central", "--quorum", "2"),
            "--quorum is for the secure round",
        ),
        (
            ("federation", "--out", tmp_path / "clip", "--method", "dp-fedavg", "--clip-lr", "0.1"),
            "give --clip-quantile too",
        ),
        (
            ("federation", "--out", tmp_path / "clip-d", "--clip-quantile", "0.5"),
            "--clip-quantile is for dp-fedavg runs, not dopamine",
        ),
        (("server", *server, "--method", "dp-fedavg"), "--expected-batch-size is for dopamine runs"),
        (("server", *server, "--target-epsilon", "4", "--noise-multiplier", "2"), "not both: the target sets"),
        (("server", *server, "--target-epsilon", "4", "--method", "knn-dpfl"), "the noise of a new training run"),
        (("federation", "--out", tmp_path / "t", "--target-epsilon", "4", "--epsilon-budget", "2"), "over --epsilon"),
    ]
    for args, fragment in cases:
        _assert_one_line_error(*_run_in_this_process(monkeypatch, *args), fragment)
    assert sorted(p.name for p in secure.iterdir()) == ["checkpoint.json"]  # a refused resume began no ledger


@pytest.mark.parametrize(
    "argv, reason",
    [
        (("federation", "--sample-rate", "1.5"), "must be in (0, 1]"),
        (("federation", "--seed", "-1"), "argument --seed: must be non-negative"),
        (("server", "--federation", "f", "--out", "o", "--listen", "0.0.0.0:5555"), "must look like tcp://HOST:PORT"),
    ],
)
def test_bad_numbers_are_refused_by_the_parser(argv, reason):
    result = run_launcher(*argv)
    assert result.returncode == 2 and reason in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "argv, input_shape, model, learning_rate",
    [
        ((), (1, 28, 28), "cnn", 0.05),
        ((), (30,), "mlp", 0.05),
        (("--method", "central-dp"), (1, 28, 28), "cnn", 0.05),
        (("--lr", "0.2", "--model", "mlp"), (1, 28, 28), "mlp", 0.2),
        (("--method", "dp-fedavg"), (1, 28, 28), "cnn", None),  # dp-fedavg reads --local-lr, never --lr
    ],
)
def test_images_default_to_the_cnn_and_dp_sgd_to_one_learning_rate(argv, input_shape, model, learning_rate):
    args = federation.build_parser().parse_args(list(argv))
    resolve_run_arguments(args, FEDERATION_METHODS)
    resolve_data_defaults(args, input_shape)
    assert (args.model, args.lr) == (model, learning_rate)


def test_adaptive_clipping_flags_reach_the_run_s_settings():
    args = federation.build_parser().parse_args(["--method", "dp-fedavg", "--clip-quantile", "0.7", "--clip-lr", "0.3"])
    resolve_run_arguments(args, FEDERATION_METHODS)
    data = load_dataset("breast_cancer")
    resolve_data_defaults(args, data.input_shape)
    training = build_run_config(args, ("hospital-1", "hospital-2", "hospital-3"), data).training
    assert (training.clip_rule, training.target_quantile, training.clip_learning_rate) == ("adaptive", 0.7, 0.3)
    assert training.round_state() == {"max_update_norm": 0.5}  # --max-update-norm's default, the first round's C


def test_federation_help_groups_the_flags_by_the_methods_that_read_them():
    groups = {group.title: group for group in federation.build_parser()._action_groups}
    flags_of = {
        title: {flag for action in group._group_actions for flag in action.option_strings}
        for title, group in groups.items()
    }
    assert "--queries-per-round" in flags_of["ae-dpfl, knn-dpfl"]
    assert "--accountant" in flags_of["central-dp, fedavg-local-dp"]
    assert {"--subclients", "--clip-quantile"} <= flags_of["dp-fedavg (each flag names the methods that read it)"]
    assert "--sample-rate" in flags_of["dopamine (each flag names the methods that read it)"]
    shown = federation.build_parser().format_help()
    assert "dopamine: sigma" in shown and "dp-fedavg: z" in shown  # one flag, a meaning and a default per method


def test_a_flag_another_method_reads_is_refused_and_the_method_s_defaults_filled_in():
    args = federation.build_parser().parse_args(["--method", "dopamine", "--queries-per-round", "20"])
    with pytest.raises(ConfigError, match="--queries-per-round is for ae-dpfl, knn-dpfl runs, not dopamine"):
        resolve_run_arguments(args, FEDERATION_METHODS)
    args = federation.build_parser().parse_args(["--method", "dp-fedavg"])
    resolve_run_arguments(args, FEDERATION_METHODS)
    assert (args.rounds, args.noise_multiplier, args.subclients, args.epsilon_budget) == (10, 6.0, 2, 10.0)
    assert args.sample_rate is None and args.queries_per_round is None


def test_the_round_benchmark_asks_for_flower_before_running_anything(monkeypatch):
    if importlib.util.find_spec("flwr") is not None:
        pytest.skip("Flower is installed here (the bench-flower group)")
    returncode, stderr = _run_in_this_process(monkeypatch, "bench_round", "--settings", "default", "--flower")
    _assert_one_line_error(returncode, stderr, "pip install -e '.[bench-flower]'")
