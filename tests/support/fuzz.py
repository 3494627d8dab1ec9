"""The fuzzer: hostile messages against a real server and a real hospital, counting what breaks.

Run from the repository, beside the tests whose scripted peers it uses (``tests/support/scripted_peers.py``)::

    .venv/bin/python tests/support/fuzz.py --messages 100000 --seed 7 --out results/fuzz

Targets, each a real component:

- ``server``: a consilium-server process (its rate limit lifted, so that the messages are read,
  not dropped). Three scripted hospitals run honest rounds; before each of hospital-2's messages of
  a round (its update, endorsement, proof and release) hospital-2 first sends a batch of fuzz
  messages. The endorsements and proofs the server relays must pass every hospital's checks, every
  round's sum must open to exactly the sum of the three honest updates, the server must keep running
  with no traceback in its log, and its report must count exactly as many rejected messages as
  were sent.
- ``hospital``: a consilium-hospital process, with two more beside it, against a scripted server
  that sends hospital-1 a batch of fuzz messages while it waits for each round's aggregate. The
  round must then complete with every hospital confirming the same mean, and hospital-1 must count
  every message as rejected. Messages the hospital would act on (a step of its pending round) make
  it refuse the round when hostile, so they are not fuzzed here: ``tests/integration/test_malicious_server.py``
  sends those, and the ``decrypt`` target fuzzes the checks.
- ``decrypt``: mutated sums into the checks every member makes before it releases anything
  (``protocol.secure_round``: each endorses the sum it was sent, and the hashes they signed must
  refuse it), in this process (its rejected count is the fuzzer's own: this target checks for
  crashes and accepted forgeries). Anything but a refusal is a crash, and a mutated sum that passes
  is a state change.

Messages come from five families: random bytes; generated maps of a random type with random
fields; real messages with bytes flipped, cut or inserted; real messages with a field dropped,
added or given another value; and real ciphertexts mutated (flipped coefficient or seed bytes, wrong
lengths and counts, zeros, all ones), plus, every round, endorsements signed by the wrong key or
for the wrong round, which a random mutation would hardly ever produce. A fuzz message that the target would accept as valid input
at that moment (a mutation that leaves a ciphertext valid, a Withdraw) is counted as skipped, not
sent: the check is that everything sent is rejected and changes nothing.

The fuzzer's own randomness is seeded (``--seed``) so that a failure can be replayed; it protects
nothing. A target's run is clean when nothing crashed, no traceback was logged, no state changed,
every message sent was counted as rejected, and its resident memory grew by less than 64 MiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgpack
import numpy as np

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.bfv_parameters import select_bfv_parameters
from consilium.crypto.one_time_keys import unpack_ring
from consilium.crypto.sealed_box import certify_key
from consilium.protocol.wire.messages import (
    PROTOCOL_VERSION,
    TO_HOSPITAL,
    TO_SERVER,
    Aggregate,
    BoxKey,
    Confirmed,
    Endorsements,
    Finish,
    Hello,
    MessageError,
    Proofs,
    Refused,
    Releases,
    RoundAbort,
    RoundStart,
    Update,
    Withdraw,
)
from consilium.protocol.wire.codec import decode, encode
from consilium.protocol.secure_round.hospital_round import HospitalRound
from consilium.protocol.secure_round.statement import RoundRefused, RoundSetting, box_key_context, box_keys_digest
from consilium.protocol.secure_round.sum_round import SumRound
from consilium.protocol.identity.party_keys import SERVER, Credentials
from consilium.protocol.identity.roster import local_federation
from consilium.orchestration.local import free_port
from consilium.scripts._cli import configure_logging, run
from consilium.training.methods.flags import positive_int
from scripted_peers import ScriptedHospital, ScriptedServer, small_run_config

_BATCH = 300  # fuzz messages per phase of a round
_MAX_RSS_GROWTH_KIB = 64 * 1024  # beyond this from the first round to the largest, memory is not bounded
_SHARES = {"server": 0.5, "hospital": 0.35, "decrypt": 0.15}  # of the messages
_FIELD_NAMES = sorted({f.name for cls in TO_SERVER | TO_HOSPITAL for f in dataclasses.fields(cls)} | {"sender", "x"})
_TYPE_NAMES = sorted(cls.TYPE for cls in TO_SERVER | TO_HOSPITAL) + ["", "Update", "update ", "\x00", "hello\n"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tests/support/fuzz.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=positive_int, default=100_000, help="fuzz messages in all (default: 100000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fuzzer's own choices (default: 0)")
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for fuzz.json and fuzz.md (and, after a failure, work/)"
    )
    parser.add_argument(
        "--targets", nargs="+", choices=list(_SHARES), default=list(_SHARES), help="what to fuzz (default: all three)"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(argparse.Namespace(log_level="error", log_file=None))
    sys.exit(run(lambda: fuzz(args.messages, args.seed, args.out, args.targets)))


@dataclass
class TargetResult:
    sent: int = 0
    skipped_as_valid: int = 0
    by_family: dict[str, int] = field(default_factory=dict)
    rejected: int | None = None  # as counted by the target itself
    # decrypt only: accepted because it decrypts to exactly the honest sum (a change within BFV's noise)
    accepted_unchanged: int = 0
    crashes: int = 0
    tracebacks: int = 0
    state_changes: int = 0
    rounds: int = 0
    rss_kib: dict[str, int] = field(default_factory=dict)  # first, largest and last resident size
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        growth = self.rss_kib.get("largest", 0) - self.rss_kib.get("first", 0)
        return not (self.crashes or self.tracebacks or self.state_changes or growth > _MAX_RSS_GROWTH_KIB) and (
            self.rejected is not None and self.rejected + self.accepted_unchanged == self.sent
        )


def fuzz(messages: int, seed: int, out: Path, targets: list[str] = list(_SHARES)) -> dict:
    rng = np.random.default_rng(seed)
    shares = {name: _SHARES[name] / sum(_SHARES[t] for t in targets) for name in targets}
    quotas = {name: max(1, round(messages * share)) for name, share in shares.items()}
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    results = {}
    for name, target in (("server", _fuzz_server), ("hospital", _fuzz_hospital), ("decrypt", _fuzz_decrypt)):
        if name not in targets:
            continue
        started = time.perf_counter()
        result = TargetResult()
        target(quotas[name], _Mutator(rng), result, work / name)
        result.seconds = round(time.perf_counter() - started, 1)
        results[name] = result
        print(
            f"\r{name}: {result.sent} sent, {'clean' if result.clean else 'FAILED'}" + " " * 20,
            file=sys.stderr,
            flush=True,
        )
    report = {
        "messages_sent": sum(r.sent for r in results.values()),
        "seed": seed,
        "clean": all(r.clean for r in results.values()),
        "targets": {name: {**dataclasses.asdict(r), "clean": r.clean} for name, r in results.items()},
    }
    if report["clean"]:
        shutil.rmtree(work, ignore_errors=True)  # the processes' logs are kept only to diagnose a failure
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz.json").write_text(json.dumps(report, indent=1))
    (out / "fuzz.md").write_text(_markdown(report))
    print(
        f"{report['messages_sent']} messages, {'no crash, traceback or state change' if report['clean'] else 'FAILURES'}; "
        f"results in {out}"
    )
    if not report["clean"]:
        raise SystemExit(1)
    return report


# -- the mutator ------------------------------------------------------------------------------------


class _Mutator:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def message(
        self, bases: list[bytes], ciphertexts: Callable[[list[bytes]], bytes], chunks: list[bytes]
    ) -> tuple[str, bytes]:
        """One fuzz message and its family; ``ciphertexts(chunks)`` wraps mutated chunks in a real message."""
        family = ("random_bytes", "generated", "byte_mutation", "structural", "ciphertext")[self.rng.integers(5)]
        if family == "random_bytes":
            return family, self.rng.bytes(int(self.rng.integers(0, 300)))
        if family == "generated":
            return family, self._generated()
        base = bases[self.rng.integers(len(bases))]
        if family == "byte_mutation":
            return family, self._mutate_bytes(base)
        if family == "structural":
            return family, self._mutate_structure(msgpack.unpackb(base, raw=False))
        return family, ciphertexts(self.mutate_chunks(chunks))

    def _value(self, depth: int = 0):
        kind = int(self.rng.integers(0, 11 if depth < 3 else 8))
        rng = self.rng
        if kind == 0:
            return None
        if kind == 1:
            return bool(rng.integers(2))
        if kind == 2:
            return int(rng.integers(-5, 6))
        if kind == 3:
            return [2**63 - 1, -(2**63), 2**64 - 1, 2**32, -1, 10**12][rng.integers(6)]
        if kind == 4:
            return [math.nan, math.inf, -0.0, 1.0, 1e308][rng.integers(5)]
        if kind == 5:
            length = int(rng.integers(0, 40)) if rng.random() < 0.9 else 600
            return "".join(chr(c) for c in rng.integers(0, 0x2FFF, length))
        if kind == 6:
            return rng.bytes(int(rng.integers(0, 100)))
        if kind == 7:
            return msgpack.ExtType(int(rng.integers(0, 128)), rng.bytes(int(rng.integers(0, 20))))
        if kind == 8:
            return [self._value(depth + 1) for _ in range(int(rng.integers(0, 5)))]
        keys = [_FIELD_NAMES[rng.integers(len(_FIELD_NAMES))], rng.bytes(3), int(rng.integers(9))]
        return {keys[rng.integers(3)]: self._value(depth + 1) for _ in range(int(rng.integers(0, 4)))}

    def _generated(self) -> bytes:
        rng = self.rng
        body = {
            "v": [1, 1, 1, 0, 2, True, 1.0, "1", None][rng.integers(9)],
            "type": _TYPE_NAMES[rng.integers(len(_TYPE_NAMES))],
        }
        for _ in range(int(rng.integers(0, 5))):
            body[_FIELD_NAMES[rng.integers(len(_FIELD_NAMES))]] = self._value()
        return msgpack.packb(body, use_bin_type=bool(rng.random() < 0.8))

    def _mutate_bytes(self, base: bytes) -> bytes:
        data = bytearray(base)
        for _ in range(int(self.rng.integers(1, 4))):
            op = int(self.rng.integers(5))
            at = int(self.rng.integers(0, len(data) + 1))
            if op == 0 and data:  # flip bits
                for _ in range(int(self.rng.integers(1, 9))):
                    data[self.rng.integers(len(data))] ^= 1 << int(self.rng.integers(8))
            elif op == 1:
                del data[at:]
            elif op == 2:
                data[at:at] = self.rng.bytes(int(self.rng.integers(1, 16)))
            elif op == 3 and data:
                start = int(self.rng.integers(len(data)))
                data[at:at] = data[start : start + int(self.rng.integers(1, 64))]
            elif data:
                data[self.rng.integers(len(data))] = int(self.rng.choice([0x00, 0x7F, 0x80, 0xC1, 0xDC, 0xDF, 0xFF]))
        return bytes(data)

    def _mutate_structure(self, body) -> bytes:
        rng = self.rng
        names = list(body)
        op = int(rng.integers(6))
        if op == 0 and names:
            del body[names[rng.integers(len(names))]]
        elif op == 1:
            body[_FIELD_NAMES[rng.integers(len(_FIELD_NAMES))]] = self._value()
        elif op == 2 and names:
            body[names[rng.integers(len(names))]] = self._value()
        elif op == 3:
            body["v"] = [True, 1.0, 2, 0, -1, "1", None, 2**64 - 1][rng.integers(8)]
        elif op == 4:
            body["type"] = _TYPE_NAMES[rng.integers(len(_TYPE_NAMES))]
        else:
            return msgpack.packb([body], use_bin_type=True)
        return msgpack.packb(body, use_bin_type=True)

    def mutate_chunks(self, chunks: list[bytes]) -> list:
        rng = self.rng
        chunks = list(chunks)
        op = int(rng.integers(9))
        target = int(rng.integers(len(chunks)))
        chunk = bytearray(chunks[target])
        if op == 0:  # a coefficient bit
            chunk[rng.integers(len(chunk) - 65)] ^= 1 << int(rng.integers(8))
        elif op == 1:  # the last coefficients
            chunk[len(chunk) - 1 - int(rng.integers(65))] ^= 1 << int(rng.integers(8))
        elif op == 2:
            chunk = chunk[: int(rng.integers(len(chunk)))]
        elif op == 3:
            chunk += rng.bytes(int(rng.integers(1, 100)))
        elif op == 4:
            chunk = bytearray(len(chunk))
        elif op == 5:
            chunk = bytearray(b"\xff" * len(chunk))
        elif op == 6:
            return chunks + chunks[:1]
        elif op == 7:
            return chunks[:-1]
        else:
            return chunks[:target] + [self._value()] + chunks[target + 1 :]
        chunks[target] = bytes(chunk)
        return chunks


def _pack(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _decoded(payload: bytes, accept: frozenset, limit: int):
    try:
        return decode(payload, accept=accept, max_bytes=limit)
    except MessageError:
        return None


# -- targets ----------------------------------------------------------------------------------------


def _environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _track_rss(result: TargetResult, pid: int) -> None:
    rss = _rss_kib(pid)
    result.rss_kib.setdefault("first", rss)
    result.rss_kib["largest"] = max(result.rss_kib.get("largest", 0), rss)
    result.rss_kib["last"] = rss


def _progress(name: str, result: TargetResult, quota: int) -> None:
    print(f"\r{name}: {result.sent:,}/{quota:,} messages", end="", file=sys.stderr, flush=True)


def _fuzz_server(quota: int, mutator: _Mutator, result: TargetResult, work: Path) -> None:
    work.mkdir(parents=True)
    roster = local_federation(work / "federation", hospitals=3, address=f"tcp://127.0.0.1:{free_port()}")
    rounds = max(1, math.ceil(quota / (4 * _BATCH)))
    log_path = work / "server.log"
    command = [
        sys.executable,
        "-m",
        "consilium.scripts.server",
        "--federation",
        work / "federation",
        "--roster-fingerprint",
        roster.fingerprint,
        "--out",
        work / "server",
        "--rounds",
        rounds,
        "--expected-batch-size",
        "5",
        "--hidden",
        "4",
        "--join-timeout",
        "60",
        "--round-timeout",
        "120",
        "--max-messages-per-second",
        "1e9",
    ]
    process = subprocess.Popen(
        [str(part) for part in command], stdout=subprocess.DEVNULL, stderr=log_path.open("w"), env=_environment()
    )
    hospitals = [
        ScriptedHospital(roster, Credentials.load(work / "federation" / name))
        for name in ("hospital-1", "hospital-2", "hospital-3")
    ]
    fuzzer, names = hospitals[1], [h.name for h in hospitals]
    try:
        for hospital in hospitals:
            hospital.send(Hello())
        config = hospitals[0].welcome()
        for hospital in hospitals[1:]:
            hospital.welcome()
        params, limit = config.bfv_parameters(), config.message_limit()
        public = PublicContext(params)
        bound = params.sum_bound // params.max_contributors
        for round_number in range(1, rounds + 1):
            starts = {h.name: h.expect(RoundStart) for h in hospitals}
            values = {
                h.name: mutator.rng.integers(-bound, bound, params.vector_length, endpoint=True) for h in hospitals
            }
            updates = {h.name: h.upload(starts[h.name], values[h.name]) for h in hospitals}
            honest = fuzzer_update = updates[fuzzer.name]
            bases = [
                encode(fuzzer_update),
                encode(Hello()),
                encode(BoxKey(round=round_number + 1, certified_key=b"k" * 96)),
                encode(Confirmed(round=round_number, digest=b"d" * 32)),
                encode(Refused(round=round_number, reason="fuzz", named=("server",), openings={})),
            ]

            def acted_on(message, sent) -> bool:
                """The very message hospital-2 is about to send, or a refusal of the round, which ends it."""
                return message == sent or (isinstance(message, Refused) and message.round == round_number)

            def as_update(chunks, update=honest) -> bytes:
                body = {"v": PROTOCOL_VERSION, "type": "update", "round": round_number, "chunks": chunks}
                return _pack({**body, "boxes": update.boxes, "next_box_key": update.next_box_key})

            def update_accepted(message) -> bool:
                if isinstance(message, Withdraw):
                    return True
                if not (isinstance(message, Update) and message.round == round_number):
                    return False
                try:
                    unpack_ring(public, list(message.chunks), "upload")
                except BfvError:
                    return False
                return len(message.chunks) == params.chunk_count and set(message.boxes) == set(names)

            for hospital in hospitals:
                if hospital is not fuzzer:
                    hospital.send(updates[hospital.name])
            chunks = list(fuzzer_update.chunks)
            _send_batch(
                fuzzer.send_raw, mutator, result, bases, as_update, chunks, update_accepted, TO_SERVER, limit, quota
            )
            fuzzer.send(fuzzer_update)

            aggregates = {h.name: h.expect(Aggregate) for h in hospitals}
            if any(a.contributors != tuple(names) for a in aggregates.values()):
                result.state_changes += 1

            def answer_after_a_batch(answers: dict, forged_signatures=()) -> None:
                """The others send their answers; hospital-2 sends ``forged_signatures`` on its own (the few a
                random mutation would hardly ever hit), a batch of mutations, then its honest answer."""
                for hospital in hospitals:
                    if hospital is not fuzzer:
                        hospital.send(answers[hospital.name])
                honest = answers[fuzzer.name]
                bases.append(encode(honest))
                for forgery in forged_signatures:
                    fuzzer.send(dataclasses.replace(honest, signature=forgery))
                    result.sent += 1
                    result.by_family["forged_endorsement"] = result.by_family.get("forged_endorsement", 0) + 1
                same = lambda message, sent=honest: acted_on(message, sent)  # noqa: E731
                _send_batch(fuzzer.send_raw, mutator, result, bases, as_update, chunks, same, TO_SERVER, limit, quota)
                fuzzer.send(honest)

            endorsements = {h.name: h.endorse(aggregates[h.name]) for h in hospitals}
            answer_after_a_batch(
                endorsements, forged_signatures=[bytes(64), mutator.rng.bytes(64), endorsements["hospital-1"].signature]
            )
            relayed = {h.name: h.expect(Endorsements) for h in hospitals}
            try:  # what the real hospitals check before they prove: every member's own signature and hashes
                proofs = {h.name: h.prove(relayed[h.name]) for h in hospitals}
            except RoundRefused as refusal:
                result.state_changes += 1
                result.notes.append(f"round {round_number}: {refusal}")
                raise
            answer_after_a_batch(proofs)
            relayed = {h.name: h.expect(Proofs) for h in hospitals}
            answer_after_a_batch({h.name: h.release(relayed[h.name]) for h in hospitals})
            opened = {h.name: h.expect(Releases) for h in hospitals}
            for hospital in hospitals:
                hospital.send(hospital.confirm(opened[hospital.name]))
                if not np.array_equal(hospital.opened[round_number], sum(values.values())):
                    result.state_changes += 1
            result.rounds += 1
            _track_rss(result, process.pid)
            _progress("server", result, quota)
        for hospital in hospitals:
            hospital.expect(Finish)
        status = process.wait(timeout=120)
        if status != 0:
            result.crashes += 1
            result.notes.append(f"the server exited with status {status}")
        report = json.loads((work / "server" / "server_report.json").read_text())
        result.rejected = report["rejected_messages"]
        if report["final"]["rounds_released"] != rounds:
            result.state_changes += 1
            result.notes.append(
                f"{report['final']['rounds_released']} of {rounds} rounds released: {report['finish_reason']}"
            )
    except Exception as error:  # a server that stopped answering is the finding, not a fuzzer bug to hide
        result.notes.append(f"{type(error).__name__}: {error}")
        if process.poll() is not None:
            result.crashes += 1
            result.notes.append(f"the server exited with status {process.returncode}: {_last_line(log_path)}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for hospital in hospitals:
            hospital.close()
        result.tracebacks += log_path.read_text().count("Traceback")


def _fuzz_hospital(quota: int, mutator: _Mutator, result: TargetResult, work: Path) -> None:
    work.mkdir(parents=True)
    federation = work / "federation"
    roster = local_federation(federation, hospitals=3, address=f"tcp://127.0.0.1:{free_port()}")
    rounds = max(1, math.ceil(quota / _BATCH))
    config = small_run_config(roster, quorum=3, rounds=rounds)
    server = ScriptedServer(roster, Credentials.load(federation / SERVER), config)
    logs = {name: work / f"{name}.log" for name in config.hospitals}
    processes = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "consilium.scripts.hospital",
                "--federation",
                str(federation),
                "--roster-fingerprint",
                roster.fingerprint,
                "--name",
                name,
                "--timeout",
                "120",
                "--send-offset",
                "0",
                "--epsilon-budget",
                "1e9",
                "--parts",
                "3",
                "--part",
                str(index),
            ],
            stdout=subprocess.DEVNULL,
            stderr=logs[name].open("w"),
            env=_environment(),
        )
        for index, name in enumerate(config.hospitals, start=1)
    }
    target = "hospital-1"
    limit = config.message_limit()
    members = tuple(config.hospitals)
    try:
        server.set_up()
        for round_number in range(1, rounds + 1):
            updates = server.start_round(round_number)
            aggregates = server.aggregate(updates, round_number, members)
            aggregate = aggregates[target]
            bases = [
                encode(aggregate),
                encode(Endorsements(round=round_number, hashes={}, commitments={}, signatures={})),
                encode(Proofs(round=round_number, seeds={}, proofs={}, signatures={})),
                encode(Releases(round=round_number, shares={}, masks={}, signatures={})),
                encode(RoundStart(round=round_number + 1, box_keys={})),
                encode(RoundAbort(round=round_number, reason="fuzz")),
                encode(Finish(reason="fuzz")),
            ]

            def acted_on(message) -> bool:
                if isinstance(message, (RoundStart, Finish)):
                    return True
                steps = (Aggregate, Endorsements, Proofs, Releases, RoundAbort)
                return isinstance(message, steps) and message.round == round_number

            def as_aggregate(mutated) -> bytes:
                # For a round not pending: one for the pending round would be checked and refused, ending
                # the round (test_malicious_server sends those); the decrypt target fuzzes the checks.
                body = {"v": PROTOCOL_VERSION, "type": "aggregate", "round": round_number + 1}
                body |= {"contributors": list(members), "digests": aggregate.digests, "boxes": aggregate.boxes}
                return _pack({**body, "chunks": mutated})

            send = lambda payload: server.send_raw(target, payload)  # noqa: E731
            chunks = list(aggregate.chunks)
            _send_batch(send, mutator, result, bases, as_aggregate, chunks, acted_on, TO_HOSPITAL, limit, quota)
            for name in members:
                server.send(name, aggregates[name])
            confirmed = server.relay(round_number, members)
            if len({message.digest for message in confirmed.values()}) != 1:
                result.state_changes += 1
            result.rounds += 1
            _track_rss(result, processes[target].pid)
            _progress("hospital", result, quota)
        for name in members:
            server.send(name, Finish(reason="fuzzing done"))
        for name, process in processes.items():
            status = process.wait(timeout=120)
            if status != 0:
                result.crashes += 1
                result.notes.append(f"{name} exited with status {status}")
        metrics = json.loads((federation / target / f"metrics-{config.run_id}.json").read_text())
        result.rejected = metrics["rejected_messages"]
    except Exception as error:
        result.notes.append(f"{type(error).__name__}: {error}")
        for name, process in processes.items():
            if process.poll() is not None:
                result.crashes += 1
                result.notes.append(f"{name} exited with status {process.returncode}: {_last_line(logs[name])}")
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        server.close()
        result.tracebacks += sum(path.read_text().count("Traceback") for path in logs.values())


def _fuzz_decrypt(quota: int, mutator: _Mutator, result: TargetResult, work: Path) -> None:
    """Mutated sums into every check a hospital makes of the sum (``protocol.secure_round``): each member
    endorses the mutated sum, and the hashes they signed must refuse it before anyone proves or releases."""
    params = select_bfv_parameters(max_contributors=3, vector_length=300, sum_bound=40_000)
    public = PublicContext(params)
    names = ("hospital-1", "hospital-2", "hospital-3")
    signing = {name: Ed25519PrivateKey.generate() for name in names}
    identities = {name: key.public_key() for name, key in signing.items()}
    state = dict(round_state={}, previous_result=bytes(32))
    result.rejected = 0
    while result.sent < quota:
        round_number = result.rounds + 1
        setting = RoundSetting("f0f0f0f0:00", round_number, names, threshold=2, quorum=3, params=params)
        boxes = {name: X25519PrivateKey.generate() for name in names}
        box_keys = {
            name: certify_key(
                key.public_key(), signer=signing[name], context=box_key_context(setting.run, name, round_number)
            )
            for name, key in boxes.items()
        }
        slots = np.zeros(params.chunk_count * params.poly_modulus_degree, dtype=np.int64)
        slots[:300] = params.digits.to_slots(np.arange(300))
        server = SumRound(setting, public)
        uploads = {}
        for name in names:
            one = HospitalRound(setting, public, name=name, signing=signing[name], box=boxes[name])
            uploads[name] = one.upload(slots, box_keys, identities)
            server.add(name, uploads[name][0])
        honest = server.total(names, box_keys, **state)
        until = min(result.sent + _BATCH, quota)
        while result.sent < until:
            chunks = mutator.mutate_chunks(honest)
            if chunks == honest:
                continue
            result.sent += 1
            result.by_family["ciphertext"] = result.by_family.get("ciphertext", 0) + 1
            try:
                members = {}
                for name in names:
                    members[name] = HospitalRound(setting, public, name=name, signing=signing[name], box=boxes[name])
                    members[name]._steps._done, members[name]._upload = 1, unpack_ring(public, uploads[name][0], "ours")
                    members[name]._digest, members[name]._key = server.digests[name], None
                    members[name]._box_keys_digest = box_keys_digest(setting, box_keys)
                boxes_to = {name: {dealer: uploads[dealer][1][name] for dealer in names} for name in names}
                endorsed = {
                    name: member.endorse(names, server.digests, chunks, boxes_to[name], identities, **state)
                    for name, member in members.items()
                }
                members["hospital-1"]._key = _FakeDealing()  # never reached: the hashes refuse first
                members["hospital-1"].prove(endorsed, identities)
            except RoundRefused:
                result.rejected += 1
            except Exception as error:  # anything else is the finding
                result.crashes += 1
                result.notes.append(f"{type(error).__name__}: {error}"[:200])
            else:
                result.state_changes += 1  # a changed sum passed every check before release
        result.rounds += 1
        _track_rss(result, os.getpid())
        _progress("decrypt", result, quota)


class _FakeDealing:
    """Stands where a member's key would be proved; the fuzz target fails the round before that."""

    @property
    def dealing(self):
        raise AssertionError("a mutated sum reached the proof")


def _last_line(log: Path) -> str:
    lines = log.read_text().strip().splitlines()
    return lines[-1][:300] if lines else "(nothing logged)"


def _send_batch(send, mutator, result, bases, wrap, chunks, accepted_now, accept, limit, quota) -> None:
    until = min(result.sent + _BATCH, quota)
    while result.sent < until:
        family, payload = mutator.message(bases, wrap, chunks)
        message = _decoded(payload, accept, limit)
        # A valid Hello during the rounds is acted on too: the hospital joins again before the next round.
        if message is not None and (accepted_now(message) or isinstance(message, Hello)):
            result.skipped_as_valid += 1
            continue
        send(payload)
        result.sent += 1
        result.by_family[family] = result.by_family.get(family, 0) + 1


def _markdown(report: dict) -> str:
    lines = [
        f"# Fuzzing: {report['messages_sent']:,} messages, seed {report['seed']}",
        "",
        "| target | sent | skipped as valid | rejected (target's count) | accepted, same plaintext | crashes | tracebacks | state changes | rounds | RSS first / largest / last (MiB) | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["targets"].items():
        rss = " / ".join(f"{r['rss_kib'].get(k, 0) / 1024:.0f}" for k in ("first", "largest", "last"))
        lines.append(
            f"| {name} | {r['sent']:,} | {r['skipped_as_valid']:,} | {r['rejected'] if r['rejected'] is None else format(r['rejected'], ',')} | {r['accepted_unchanged']:,} | {r['crashes']} | {r['tracebacks']} "
            f"| {r['state_changes']} | {r['rounds']} | {rss} | {r['seconds']} |"
        )
    lines += [
        "",
        "Families sent: "
        + "; ".join(
            f"{name}: " + ", ".join(f"{family} {count:,}" for family, count in sorted(r["by_family"].items()))
            for name, r in report["targets"].items()
        ),
    ]
    notes = [f"- {name}: {note}" for name, r in report["targets"].items() for note in r["notes"]]
    return "\n".join(lines + (["", "Notes:", *notes] if notes else [])) + "\n"


if __name__ == "__main__":
    main()
