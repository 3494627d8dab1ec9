"""A ``consilium-server`` run made ready from its flags: the training or voting server, on a socket of its own
or a coordinator's, and the lines it prints (``scripts.server`` parses the flags; ``orchestration.coordinator``
runs what an admin submits)."""

from __future__ import annotations

import argparse
import secrets
from dataclasses import dataclass
from typing import Callable

from consilium.protocol.run.config import INSECURE_PLAINTEXT, RunConfig
from consilium.protocol.run.rules import ConfigError
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
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
from consilium.protocol.wire.transport import ServerTransport
from consilium.scripts._server_network import listening_on, server_timeouts
from consilium.training.models.evaluation import Selection
from consilium.training.models.build import use_model_code
from consilium.training.models.own_code import is_reference
from consilium.training.data.datasets import Dataset, Split, load_dataset
from consilium.training.voting.vote_privacy import VOTING_METHODS, VotingSettings, default_quorum
from consilium.training.voting.votes import PcaFeatures, split_public_pool


@dataclass
class ServerRun:
    """A run made ready on a socket: what ``orchestration.coordinator`` runs, and what this command runs once."""

    server: Server | VotingServer
    parties: tuple[str, ...]
    finished: Callable[[dict], str]
    say: Callable[[str], None]

    def run(self) -> None:
        self.say(self.finished(self.server.run()))


# A run's flags, checked; then, given the roster, credentials and socket, the run made ready (ConfigError).
_Prepare = Callable[[Roster, Credentials, ServerTransport | None], ServerRun]


def prepared_run(args: argparse.Namespace, say: Callable[[str], None]) -> _Prepare:
    check_run_flags(args)
    if is_reference(args.model):  # a resumed run's own model, too
        use_model_code(args.model)

    def prepare(roster: Roster, credentials: Credentials, transport: ServerTransport | None) -> ServerRun:
        dataset = load_dataset(
            args.data, split_seed=args.data_seed, image_size=args.image_size, image_channels=args.image_channels
        )
        resolve_data_defaults(args, dataset.input_shape)
        timeouts = server_timeouts(args)
        if args.method in VOTING_METHODS:
            return _voting_run(args, roster, credentials, dataset, timeouts, transport, say)
        return _training_run(args, roster, credentials, dataset, timeouts, transport, say)

    return prepare


def check_run_flags(args: argparse.Namespace) -> None:
    """What the run's flags say alone, checked before anything is loaded (``ConfigError``)."""
    if args.target_epsilon is not None and args.noise_multiplier is not None:
        raise ConfigError("give --target-epsilon or --noise-multiplier, not both: the target sets the noise")
    if args.target_epsilon is not None and (args.method in VOTING_METHODS or args.resume):
        raise ConfigError("--target-epsilon calibrates the noise of a new training run")
    resolve_run_arguments(args)


def _training_run(
    args: argparse.Namespace,
    roster: Roster,
    credentials: Credentials,
    dataset: Dataset,
    timeouts: Timeouts,
    transport: ServerTransport | None,
    say: Callable[[str], None],
) -> ServerRun:
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
        transport=transport,
        on_round=lambda record: say(_round_line(record, server.config, len(roster.hospitals))),
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
        say(f"server on {listening_on(args, roster)}: resuming run {server.config.run_id} from {args.out}")
    else:
        server = Server(config=_new_run(args, roster, dataset, say), **settings)

    def finished(report: dict) -> str:
        final = report["final"]
        return f"finished ({report['finish_reason']}): {final['rounds_released']} rounds released, report in {args.out}"

    return ServerRun(server, server.config.hospitals, finished, say)


def _new_run(args: argparse.Namespace, roster: Roster, dataset: Dataset, say: Callable[[str], None]) -> RunConfig:
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
    say(
        f"server on {listening_on(args, roster)}: run {config.run_id}, {len(hospitals)} hospitals, "
        f"{params.vector_length} parameters {encoding}"
    )
    if not args.insecure_plaintext_benchmark:
        say(f"{spend_line(config, planned_spend(config))}, if every hospital of the roster joins")
    return config


def _voting_run(
    args: argparse.Namespace,
    roster: Roster,
    credentials: Credentials,
    dataset: Dataset,
    timeouts: Timeouts,
    transport: ServerTransport | None,
    say: Callable[[str], None],
) -> ServerRun:
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
        on_round=lambda record: say(_vote_line(record, server.config)),
        listen=args.listen,
        transport=transport,
    )
    if args.resume:
        checkpointed = VotingServer.checkpointed_config(args.out)  # before the server binds or touches a ledger
        if checkpointed.voting.method != args.method:
            raise ConfigError(f"the checkpointed run is a {checkpointed.voting.method} run; pass the same --method")
        server = VotingServer.resume(**settings)
        say(f"server on {listening_on(args, roster)}: resuming run {server.config.run_id} from {args.out}")
    else:
        config, feature_map = _voting_config(args, roster, dataset, public_pool)
        server = VotingServer(config=config, feature_map=feature_map, **settings)
        field = config.field()
        say(
            f"server on {listening_on(args, roster)}: {args.method} run {config.run_id}, {len(config.hospitals)} hospitals, "
            f"{len(config.talliers)} talliers, {config.rounds} rounds of {config.queries_per_round} queries from a public pool of "
            f"{len(public_pool)} (test: {len(test)}), MPC over {field.bit_length}-bit integers, revealing {config.reveal}"
        )

    def finished(report: dict) -> str:
        final = report["final"]
        return (
            f"finished ({report['finish_reason']}): {final['queries_labelled']} queries labelled, "
            f"{final['queries_withheld']} withheld, label accuracy {_shown(final['label_accuracy'])}, "
            f"student test accuracy {_shown(final['student_test_accuracy'])}; report in {args.out}"
        )

    return ServerRun(server, (*server.config.hospitals, *server.config.talliers), finished, say)


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
                quorum=args.quorum or default_quorum(len(roster.hospitals)),
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


def _vote_line(record: dict, config: VotingConfig) -> str:
    prefix = f"round {record['round']:>4}/{config.rounds}"
    if record["status"] == "labelled":
        epsilon = record["epsilon"]
        return (
            f"{prefix}  label_acc {_shown(record['label_accuracy'])}  withheld {record['labels_withheld']}  "
            f"voters {len(record['voters'])}/{len(config.hospitals)}  "
            f"epsilon {epsilon['record']['server']:.3f} per record, {epsilon['hospital']['server']:.3f} per hospital "
            f"(delta {config.delta:g})  MPC {record['mpc_seconds'] / config.queries_per_round * 1000:.1f} ms/query"
            + (
                "  REFUSED: "
                + "; ".join(f"{name} ({why})" for name, why in zip(record["refused"], record["refused_because"]))
                if record["refused"]
                else ""
            )
        )
    void = "  VOID: every tallier signed that it released nothing; each hospital that voted may cancel its charge"
    return f"{prefix}  aborted: {record['reason']}" + (void if record["void"] else "")


def _shown(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _round_line(record: dict, config: RunConfig, consortium: int) -> str:
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
        return (
            f"{prefix}  val_acc {record['validation_accuracy']:.3f}  {privacy}  "
            f"contributors {len(record['contributors'])}/{len(config.hospitals)}{state}"
        )
    return f"{prefix}  aborted: {record['reason']}"
