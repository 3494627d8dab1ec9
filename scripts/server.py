"""consilium-server: run the aggregator of a provisioned federation."""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

from consilium.protocol.run.config import INSECURE_PLAINTEXT, RunConfig

from consilium.protocol.run.rules import ConfigError
from consilium.protocol.identity.party_keys import SERVER, Credentials
from consilium.protocol.identity.roster import Roster
from consilium.protocol.identity.roster_confirmation import join_federation
from consilium.protocol.run.participants import Timeouts
from consilium.protocol.run.server import Server
from consilium.protocol.voting.voting_config import VotingConfig
from consilium.protocol.voting.voting_server import VotingServer
from consilium.orchestration.run_flags import (
    build_run_config,
    chosen_aggregation,
    model_spec,
    resolve_data_defaults,
    resolve_run_arguments,
)
from consilium.orchestration.planning import calibrated, planned_spend, spend_line
from consilium.scripts._cli import add_logging_arguments, add_roster_fingerprint, configure_logging, run
from consilium.scripts._server_network import add_network_arguments, listening_on, server_timeouts
from consilium.scripts._run_arguments import add_hardware_arguments, add_image_arguments, add_run_arguments
from consilium.training.privacy.accounting import DEFAULT_BUDGET_VIEW, VIEWS
from consilium.training.methods.flags import non_negative_int, positive_float, positive_int
from consilium.training.models.compute_device import use_device
from consilium.training.models.evaluation import SELECTION_METRICS, Selection
from consilium.training.models.build import use_model_code
from consilium.training.models.own_code import is_reference
from consilium.training.data.datasets import Dataset, Split, load_dataset
from consilium.training.voting.vote_privacy import VOTING_METHODS, VotingSettings
from consilium.training.voting.votes import PcaFeatures, split_public_pool


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-server",
        description="Run the server: it sums the hospitals' encrypted updates and evaluates the released model "
        "(Dopamine, DP-FedAvg), or has the hospitals label its public records by private vote and trains a student on them.",
    )
    parser.add_argument(
        "--federation",
        type=Path,
        required=True,
        help="federation directory: roster.toml, and the server's keys in server/",
    )
    add_roster_fingerprint(parser)
    parser.add_argument("--out", type=Path, required=True, help="directory for the report, ledger and final model")
    parser.add_argument(
        "--data",
        default="breast_cancer",
        help="validation data: breast_cancer, digits, an .npz path, an image folder, or module:function of your own code",
    )
    add_image_arguments(parser)
    add_hardware_arguments(parser)
    parser.add_argument(
        "--data-seed", type=non_negative_int, default=0, help="train/validation split of built-in data (default: 0)"
    )
    _add_model_arguments(parser)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="go on with the run checkpointed in --out, after the server stopped (its settings are the checkpoint's; "
        "the hospitals join again by themselves)",
    )
    parser.add_argument(
        "--expected-batch-size",
        type=positive_float,
        help="B: the federation-wide divisor of each hospital's share, a public figure the consortium agrees "
        "(q times a typical hospital's record count, coarsely)",
    )
    add_run_arguments(parser)
    _add_target_arguments(parser)
    _add_audit_arguments(parser)
    add_network_arguments(parser)
    parser.add_argument(
        "--insecure-plaintext-benchmark",
        action="store_true",
        help="Dopamine and dp-fedavg: sum UNENCRYPTED updates; no privacy claim holds. Only for consilium-bench-round's comparison "
        "with secure aggregation (the hospitals must say the same)",
    )
    add_logging_arguments(parser)
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the model and its selection")
    group.add_argument(
        "--model-seed",
        type=non_negative_int,
        help="draw the initial model's weights from this seed (public: no noise, sampling or rounding uses it; "
        "default: a fresh draw)",
    )
    group.add_argument(
        "--select-every",
        type=positive_int,
        help="select the model kept among every n-th round and the last (default: 1, every round; a resumed run keeps "
        "its own): a comparison gives every method the same number of candidates",
    )
    group.add_argument(
        "--select-on",
        choices=SELECTION_METRICS,
        help="the validation score that selects the model kept (default: accuracy; a resumed run keeps its own): AUC "
        "where the classes are imbalanced",
    )


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("privacy plan")
    group.add_argument(
        "--target-epsilon",
        type=positive_float,
        help="dopamine, dp-fedavg: calibrate the noise multiplier so that the run, every round released at the "
        "quorum, spends at most this epsilon against --target-view and each view before it (as Opacus's "
        "make_private_with_epsilon does); the plan is printed before round 1 in any case",
    )
    group.add_argument(
        "--target-view",
        choices=VIEWS,
        default=DEFAULT_BUDGET_VIEW,
        help=f"the view --target-epsilon binds on (default: {DEFAULT_BUDGET_VIEW}, as a hospital's budget)",
    )


def _add_audit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("audit")
    group.add_argument("--transcript", type=Path, help="append the digest of every received message to this audit file")
    group.add_argument(
        "--transcript-payloads",
        action="store_true",
        help="keep whole messages in the transcript, not digests (with any hospital's key, it opens every update)",
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args)
    sys.exit(run(lambda: serve(args)))


def serve(args: argparse.Namespace) -> None:
    if args.target_epsilon is not None and args.noise_multiplier is not None:
        raise ConfigError("give --target-epsilon or --noise-multiplier, not both: the target sets the noise")
    if args.target_epsilon is not None and (args.method in VOTING_METHODS or args.resume):
        raise ConfigError("--target-epsilon calibrates the noise of a new training run")
    resolve_run_arguments(args)
    use_device(args.device)
    if is_reference(args.model):  # a resumed run's own model, too
        use_model_code(args.model)
    roster, credentials = join_federation(args.federation, SERVER, args.roster_fingerprint)
    dataset = load_dataset(
        args.data, split_seed=args.data_seed, image_size=args.image_size, image_channels=args.image_channels
    )
    resolve_data_defaults(args, dataset.input_shape)
    timeouts = server_timeouts(args)
    if args.method in VOTING_METHODS:
        _serve_vote(args, roster, credentials, dataset, timeouts)
        return
    settings = dict(
        roster=roster,
        credentials=credentials,
        validation=dataset.validation,
        test=dataset.test,
        out_dir=args.out,
        timeouts=timeouts,
        transcript=args.transcript,
        transcript_payloads=args.transcript_payloads,
        max_messages_per_second=args.max_messages_per_second,
        listen=args.listen,
        on_round=lambda record: _print_round(record, server.config, len(roster.hospitals)),
        model_seed=args.model_seed,
        selection=None
        if args.select_every is None and args.select_on is None
        else Selection(every=args.select_every or 1, on=args.select_on or "accuracy"),
    )
    if args.resume:
        # Checked before the server binds its socket or begins its ledger.
        checkpointed = Server.checkpointed_config(args.out)
        if checkpointed.dataset != dataset.name:
            raise ConfigError(f"the checkpointed run is on {checkpointed.dataset}; pass the same --data")
        if checkpointed.aggregation != chosen_aggregation(args):
            raise ConfigError(
                f"the checkpointed run uses {checkpointed.aggregation!r} aggregation; resume it with the same "
                "--insecure-plaintext-benchmark setting"
            )
        server = Server.resume(**settings)
        print(
            f"server on {listening_on(args, roster)}: resuming run {server.config.run_id} from {args.out}", flush=True
        )
    else:
        server = Server(config=_new_run(args, roster, dataset), **settings)
    report = server.run()
    final = report["final"]
    print(
        f"finished ({report['finish_reason']}): {final['rounds_released']} rounds released, report in {args.out}",
        flush=True,
    )


def _new_run(args: argparse.Namespace, roster: Roster, dataset: Dataset) -> RunConfig:
    hospitals = tuple(roster.hospitals)
    config = build_run_config(args, hospitals, dataset)
    if args.target_epsilon is not None:
        config = calibrated(config, args.target_epsilon, view=args.target_view)
    params = config.bfv_parameters()
    encoding = (
        "in the clear modulo 2^32 (--insecure-plaintext-benchmark: NO secure aggregation)"
        if args.insecure_plaintext_benchmark
        else f"in {params.chunk_count} BFV ciphertext(s) "
        f"(N={params.poly_modulus_degree}, t={params.plain_modulus}, q={params.coeff_mod_bit_sizes[0]} bits, "
        f"{params.values_per_slot} value(s) a slot)"
    )
    print(
        f"server on {listening_on(args, roster)}: run {config.run_id}, {len(hospitals)} hospitals, "
        f"{params.vector_length} parameters {encoding}",
        flush=True,
    )
    if not args.insecure_plaintext_benchmark:
        print(f"{spend_line(config, planned_spend(config))}, if every hospital of the roster joins", flush=True)
    return config


def _serve_vote(
    args: argparse.Namespace, roster: Roster, credentials: Credentials, dataset: Dataset, timeouts: Timeouts
) -> None:
    if args.insecure_plaintext_benchmark:
        raise ConfigError(
            "--insecure-plaintext-benchmark is for the secure round (dopamine, dp-fedavg), not for voting"
        )
    if args.select_every is not None or args.select_on is not None:
        raise ConfigError(
            "--select-every and --select-on are for training runs: a voting server trains its model once, at the end"
        )
    public_pool, test = split_public_pool(dataset.validation, args.public_fraction, seed=args.data_seed)
    settings = dict(
        roster=roster,
        credentials=credentials,
        public_pool=public_pool,
        test=test,
        out_dir=args.out,
        student_epochs=args.student_epochs,
        timeouts=timeouts,
        transcript=args.transcript,
        on_round=lambda record: _print_vote(record, server.config),
        listen=args.listen,
    )
    if args.resume:
        checkpointed = VotingServer.checkpointed_config(args.out)  # before the server binds or touches a ledger
        if checkpointed.voting.method != args.method:
            raise ConfigError(f"the checkpointed run is a {checkpointed.voting.method} run; pass the same --method")
        server = VotingServer.resume(**settings)
        print(
            f"server on {listening_on(args, roster)}: resuming run {server.config.run_id} from {args.out}", flush=True
        )
    else:
        config, feature_map = _voting_config(args, roster, dataset, public_pool)
        server = VotingServer(config=config, feature_map=feature_map, **settings)
        field = config.field()
        print(
            f"server on {listening_on(args, roster)}: {args.method} run {config.run_id}, {len(config.hospitals)} hospitals, "
            f"{len(config.talliers)} talliers, {config.rounds} rounds of {config.queries_per_round} queries from a public pool of "
            f"{len(public_pool)} (test: {len(test)}), MPC over {field.bit_length}-bit integers, revealing {config.reveal}",
            flush=True,
        )
    report = server.run()
    final = report["final"]
    print(
        f"finished ({report['finish_reason']}): {final['queries_labelled']} queries labelled, {final['queries_withheld']} withheld, "
        f"label accuracy {_shown(final['label_accuracy'])}, student test accuracy {_shown(final['student_test_accuracy'])}; "
        f"report in {args.out}",
        flush=True,
    )


def _voting_config(
    args: argparse.Namespace, roster: Roster, dataset: Dataset, public_pool: Split
) -> tuple[VotingConfig, bytes]:
    """A new voting run's configuration, and kNN-DPFL's public feature map (``ConfigError``)."""
    try:
        config = VotingConfig(
            run_id=secrets.token_hex(8),
            dataset=dataset.name,
            hospitals=tuple(roster.hospitals),
            talliers=tuple(roster.talliers),
            rounds=args.rounds,
            queries_per_round=args.queries_per_round,
            delta=args.delta,
            voting=VotingSettings(
                method=args.method,
                noise_std=args.vote_noise,
                quorum=args.quorum or len(roster.hospitals),
                neighbours=args.neighbours,
            ),
            reveal=args.reveal,
            label_threshold=args.label_threshold,
            model=model_spec(args, dataset, public_pool),
            teacher_epochs=args.teacher_epochs,
            teacher_confidence=args.teacher_confidence,
            feature_dimensions=args.feature_dimensions,
        )
        feature_map = (
            PcaFeatures.fit(public_pool.x, args.feature_dimensions).to_bytes() if args.method == "knn-dpfl" else b""
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return config, feature_map


def _print_vote(record: dict, config: VotingConfig) -> None:
    prefix = f"round {record['round']:>4}/{config.rounds}"
    if record["status"] == "labelled":
        epsilon = record["epsilon"]
        print(
            f"{prefix}  label_acc {_shown(record['label_accuracy'])}  withheld {record['labels_withheld']}  "
            f"voters {len(record['voters'])}/{len(config.hospitals)}  "
            f"epsilon {epsilon['record']['server']:.3f} per record, {epsilon['hospital']['server']:.3f} per hospital "
            f"(delta {config.delta:g})  MPC {record['mpc_seconds'] / config.queries_per_round * 1000:.1f} ms/query"
            + (
                f"  REFUSED (ballot outside the run's range): {', '.join(record['refused'])}"
                if record["refused"]
                else ""
            ),
            flush=True,
        )
    else:
        print(f"{prefix}  aborted: {record['reason']}", flush=True)


def _shown(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _print_round(record: dict, config: RunConfig, consortium: int) -> None:
    coalition = config.coalition(consortium)
    prefix = f"round {record['round']:>4}/{config.rounds}"
    if record["status"] == "released":
        privacy = (
            "epsilon n/a (insecure plaintext benchmark)"
            if config.aggregation == INSECURE_PLAINTEXT
            else f"epsilon {record['epsilon']['server']:.3f} against the server, "
            f"{record['epsilon']['peer_hospital']:.3f} against a peer, {record['epsilon']['coalition']:.3f} against "
            f"the server with {coalition} hospital{'' if coalition == 1 else 's'} (delta {config.delta:g})"
        )
        state = "".join(f"  {name} {value:.4g}" for name, value in record["round_state"].items())  # adaptive v and C
        print(
            f"{prefix}  val_acc {record['validation_accuracy']:.3f}  {privacy}  "
            f"contributors {len(record['contributors'])}/{len(config.hospitals)}{state}",
            flush=True,
        )
    else:
        print(f"{prefix}  aborted: {record['reason']}", flush=True)


if __name__ == "__main__":
    main()
