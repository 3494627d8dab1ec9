"""consilium-admin: submit, watch and stop runs at a coordinator (consilium-server --coordinate)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from consilium.errors import ConsiliumError
from consilium.protocol.identity.roster_confirmation import join_federation
from consilium.protocol.wire.codec import decode, encode
from consilium.protocol.wire.messages import (
    TO_ADMIN,
    AdminAnswer,
    Message,
    MessageError,
    RunLog,
    Status,
    StopRun,
    Submit,
)
from consilium.protocol.wire.transport import ClientTransport, Reconnected, TransportError
from consilium.scripts._cli import add_roster_fingerprint, run
from consilium.training.methods.flags import positive_float

_ANSWER_BYTES = 1 << 20  # a Status or a run's log: far less
_DEFAULT_TIMEOUT_S = 30.0


class NoAnswer(ConsiliumError):
    """The coordinator did not answer in time, or could not be reached."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consilium-admin",
        description="Ask a coordinator (consilium-server --coordinate) to run a run, what it is doing, to stop a run, "
        "or for a run's lines. Authenticated by this admin's key, as every party is; each site's policy still "
        "decides whether its hospital takes part.",
    )
    parser.add_argument("--federation", type=Path, required=True, help="federation directory holding roster.toml")
    parser.add_argument("--name", required=True, help="this admin's name; its keys are in FEDERATION/NAME")
    add_roster_fingerprint(parser)
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=_DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for the coordinator's answer (default: {_DEFAULT_TIMEOUT_S:g})",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    submit = actions.add_parser(
        "submit", help="queue a run: consilium-server's run flags, after --, e.g. -- --method dopamine --rounds 5"
    )
    submit.add_argument("flags", nargs=argparse.REMAINDER, help="the run's flags")
    actions.add_parser("status", help="who is connected, and each run: queued, running (its last line) or how it ended")
    for action, what in (("stop", "stop a run, queued or running"), ("logs", "a run's lines, the last 200")):
        actions.add_parser(action, help=what).add_argument("run", help="the run's name, as submit answered: run-N")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(run(lambda: ask(args)))


def ask(args: argparse.Namespace) -> None:
    question = _question(args)
    roster, credentials = join_federation(args.federation, args.name, args.roster_fingerprint)
    transport = ClientTransport(roster.server_address, roster.server.curve_public, credentials.curve, _ANSWER_BYTES)
    try:
        transport.send(encode(question))
        answer = _answer(transport, args.timeout)
    finally:
        transport.close()
    if not answer.ok:
        raise NoAnswer("the coordinator refused: " + ("; ".join(answer.lines) or "it gave no reason"))
    for line in answer.lines:
        print(line, flush=True)


def _question(args: argparse.Namespace) -> Message:
    if args.action == "submit":
        flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
        return Submit(flags=tuple(flags))
    if args.action == "status":
        return Status()
    return StopRun(run=args.run) if args.action == "stop" else RunLog(run=args.run)


def _answer(transport: ClientTransport, timeout_s: float) -> AdminAnswer:
    try:
        payload = transport.receive(timeout_s)
    except (Reconnected, TransportError) as error:
        raise NoAnswer(f"no answer from the coordinator: {error}") from None
    if payload is None:
        raise NoAnswer(
            f"no answer from the coordinator within {timeout_s:g} s: is consilium-server --coordinate running at the "
            "roster's address? A coordinator busy with a run answers when it next waits, so ask status before "
            "submitting again"
        )
    try:
        return decode(payload, accept=TO_ADMIN, max_bytes=_ANSWER_BYTES)
    except MessageError as error:
        raise NoAnswer(f"the coordinator's answer is malformed: {error}") from None


if __name__ == "__main__":
    main()
