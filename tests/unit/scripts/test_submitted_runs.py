"""What an admin may submit to a coordinator: consilium-server's run flags, never the coordinator's own, no
code, and data only inside the operator's --data-root (``scripts.server._submitted``)."""

import argparse

import numpy as np
import pytest

from consilium.protocol.run.rules import ConfigError
from consilium.scripts.server import _submitted, build_parser, serve


@pytest.fixture
def coordinator(tmp_path):
    root = tmp_path / "data"
    (root / "images" / "a").mkdir(parents=True)
    np.savez(root / "ward.npz", x_train=np.zeros((2, 2)))
    (tmp_path / "outside.npz").write_bytes(b"")
    (root / "link.npz").symlink_to(tmp_path / "outside.npz")
    (root / "loop").symlink_to(root / "loop")
    (root / "prep.py").write_text("raise SystemExit('ran an admin-named module')\n")
    return argparse.Namespace(federation=tmp_path / "fed", data_root=root), tmp_path / "runs" / "run-1"


def test_a_run_s_flags_are_parsed_as_the_server_s_in_the_coordinator_s_federation_and_folder(coordinator):
    args, folder = coordinator
    submitted = _submitted(args, ("--method", "knn-dpfl", "--rounds=3", "--data", "ward.npz"), folder)
    assert (submitted.method, submitted.rounds, submitted.out) == ("knn-dpfl", 3, folder)
    assert submitted.data == str((args.data_root / "ward.npz").resolve())
    assert _submitted(args, ("--data", "images"), folder).data == str((args.data_root / "images").resolve())
    assert _submitted(args, (), folder).data == "breast_cancer"


@pytest.mark.parametrize(
    "flags, why",
    [
        (("--out", "/tmp/elsewhere"), "--out is the coordinator's"),
        (("--out=/tmp/elsewhere",), "--out is the coordinator's"),
        (("--listen", "tcp://0.0.0.0:1"), "--listen is the coordinator's"),
        (("--insecure-plaintext-benchmark",), "the coordinator's"),
        (("--transcript", "/tmp/t"), "the coordinator's"),
        (("-hx",), "the coordinator's"),  # would be -h: help, then exit
        (("--fed", "/tmp/other"), "unrecognized arguments"),  # no abbreviations
        (("--rounds", "many"), "--rounds: not a number"),
        (("--model", "own_models:net"), "built-in models only"),
        (("--data", "prep.py:load"), "no code"),
        (("--data", "../outside.npz"), "is not"),
        (("--data", "link.npz"), "is not"),  # a link out of the root
        (("--data", "loop"), "is not there"),
        (("--data", "prep.py"), "is not"),  # neither .npz nor a folder
        (("--data", "missing.npz"), "is not there"),
    ],
)
def test_what_a_submitted_run_may_not_say_is_refused_in_one_line(coordinator, flags, why):
    args, folder = coordinator
    with pytest.raises(ConfigError, match=why):
        _submitted(args, flags, folder)


def test_without_a_data_root_a_submitted_run_takes_built_in_data_only(coordinator):
    args, folder = coordinator
    args.data_root = None
    assert _submitted(args, ("--data", "digits"), folder).data == "digits"
    with pytest.raises(ConfigError, match="built-in data"):
        _submitted(args, ("--data", str(folder)), folder)


@pytest.mark.parametrize("flag", [("--transcript", "audit.log"), ("--resume",)])
def test_a_coordinator_refuses_what_it_would_not_do_rather_than_ignore_it(tmp_path, flag):
    args = build_parser().parse_args(["--federation", str(tmp_path), "--out", str(tmp_path), "--coordinate", *flag])
    with pytest.raises(ConfigError, match="without --resume or --transcript"):
        serve(args)
