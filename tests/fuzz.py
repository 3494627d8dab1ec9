"""The fuzzer: hostile messages against a real server and a real hospital, counting what breaks.

Run from the repository, beside the tests whose scripted peers it uses (``tests/scripted_peers.py``)::

    .venv/bin/python tests/fuzz.py --messages 100000 --seed 7 --out results/fuzz

Targets, each a real component:

- ``server``: a consilium-server process (its rate limit lifted, so that the messages are read,
  not dropped). Two scripted hospitals run honest rounds; before each of hospital-2's messages of a
  round (its update, its endorsement, its release) hospital-2 first sends a batch of fuzz messages.
  Every round's sum must then decrypt to exactly the sum of the two honest updates, the endorsements
  the server relays must be both hospitals' own, the server must keep running with no traceback in
  its log, and its report must count exactly as many rejected messages as were sent.
- ``hospital``: a consilium-hospital process, with a second one beside it, against a scripted
  server that sends hospital-1 a batch of fuzz messages while it waits for each round's aggregate.
  The round must then complete with both hospitals releasing the same digest, and hospital-1 must
  count every message as rejected. Messages the hospital would act on (an aggregate or endorsements
  for its pending round) end its run when hostile, so they are not fuzzed here:
  ``tests/test_malicious_server.py`` sends those, and the ``decrypt`` target fuzzes the loader.
- ``decrypt``: mutated aggregates into ``SecretContext.decrypt_sum`` in this process (its rejected
  count is the fuzzer's own: this target checks for crashes and accepted forgeries). Anything but a
  ``BfvError`` is a crash (a segfault ends the run), and a mutation that decrypts to anything but
  the honest sum is a state change. A small change to a coefficient stays within BFV's decryption
  noise and decrypts to exactly the honest sum; those are counted apart.

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

from crypto.bfv import BfvError, CiphertextSum, PublicContext, SecretContext
from crypto.bfv_parameters import select_bfv_parameters
from crypto.endorsement import EndorsementError, check_endorsements
from protocol.messages import (
    TO_HOSPITAL,
    TO_SERVER,
    Aggregate,
    Endorsement,
    Endorsements,
    Finish,
    Hello,
    KeyReady,
    KeyRequest,
    KeySetup,
    MeanRequest,
    MessageError,
    Released,
    RoundAbort,
    RunKey,
    RoundStart,
    SealedKey,
    Update,
    Withdraw,
    decode,
    encode,
    release_digest,
)
from protocol.party_keys import SERVER, Credentials
from protocol.roster import local_federation
from orchestration.local import free_port
from scripts._cli import configure_logging, run
from training.flags import positive_int
from scripted_peers import ScriptedHospital, ScriptedServer, small_run_config

_BATCH = 300  # fuzz messages per phase of a round
_MAX_RSS_GROWTH_KIB = 64 * 1024  # beyond this from the first round to the largest, memory is not bounded
_SHARES = {"server": 0.5, "hospital": 0.35, "decrypt": 0.15}
_FIELD_NAMES = sorted({f.name for cls in TO_SERVER | TO_HOSPITAL for f in dataclasses.fields(cls)} | {"sender", "x"})
_TYPE_NAMES = sorted(cls.TYPE for cls in TO_SERVER | TO_HOSPITAL) + ["", "Update", "update ", "\x00", "hello\n"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tests/fuzz.py", description=__doc__.split("\n\n")[0])
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
    configure_logging("error")
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
        elif op == 1:  # the seed record at the end
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
    roster = local_federation(work / "federation", hospitals=2, address=f"tcp://127.0.0.1:{free_port()}")
    rounds = max(1, math.ceil(quota / (3 * _BATCH)))
    log_path = work / "server.log"
    command = [
        sys.executable,
        "-m",
        "scripts.server",
        "--federation",
        work / "federation",
        "--roster-fingerprint",
        roster.fingerprint,
        "--out",
        work / "server",
        "--rounds",
        rounds,
        "--quorum",
        "2",
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
    h1, h2 = (
        ScriptedHospital(roster, Credentials.load(work / "federation" / name)) for name in ("hospital-1", "hospital-2")
    )
    try:
        h1.send(Hello())
        h2.send(Hello())
        config = h1.welcome()
        h2.welcome()
        h2.send_run_key()
        h1.send(h1.key_setup())
        h2.receive_key()
        params, limit = config.bfv_parameters(), config.message_limit()
        public = PublicContext(params)
        bound = params.sum_bound // params.max_contributors
        for round_number in range(1, rounds + 1):
            h1.expect(RoundStart)
            h2.expect(RoundStart)
            x1, x2 = (mutator.rng.integers(-bound, bound, params.vector_length, endpoint=True) for _ in range(2))
            u1 = h1.secret.encrypt_update(x1, round_number=round_number, hospital="hospital-1")
            u2 = h2.secret.encrypt_update(x2, round_number=round_number, hospital="hospital-2")
            h1.send(Update(round=round_number, chunks=tuple(u1)))
            update = encode(Update(round=round_number, chunks=tuple(u2)))
            bases = [
                update,
                encode(Hello()),
                encode(KeyReady()),
                encode(RunKey(certified_key=b"k" * 96)),
                encode(KeySetup(sealed_keys={"hospital-1": b"b" * 200})),
                encode(Released(round=round_number, digest=b"d" * 32, mean_gradient=b"")),
            ]

            def accepted_now(message) -> bool:
                if isinstance(message, Withdraw):
                    return True
                if isinstance(message, Update) and message.round == round_number:
                    try:
                        CiphertextSum(public).add(message.chunks)
                    except BfvError:
                        return False
                    return True
                return False

            as_update = lambda chunks: _pack({"v": 1, "type": "update", "round": round_number, "chunks": chunks})  # noqa: E731
            _send_batch(h2.send_raw, mutator, result, bases, as_update, u2, accepted_now, TO_SERVER, limit, quota)
            h2.send_raw(update)

            aggregate = h1.expect(Aggregate)
            h2.expect(Aggregate)
            total = h1.secret.decrypt_sum(
                aggregate.chunks, round_number=round_number, contributors=aggregate.contributors
            )
            if aggregate.contributors != ("hospital-1", "hospital-2") or not np.array_equal(total, x1 + x2):
                result.state_changes += 1
            h1.endorse(aggregate)
            statement = h2.statement(aggregate)
            signer = {"hospital-2": h2.roster.party("hospital-2").identity.signing}
            bases.append(encode(Endorsement(round=round_number, signature=h2.signature(aggregate))))
            next_round = dataclasses.replace(aggregate, round=round_number + 1)
            forged = [bytes(64), mutator.rng.bytes(64), h1.signature(aggregate), h2.signature(next_round)]
            for forgery in forged:  # the few a random mutation would hardly ever hit
                h2.send(Endorsement(round=round_number, signature=forgery))
                result.sent += 1
                result.by_family["forged_endorsement"] = result.by_family.get("forged_endorsement", 0) + 1

            def endorsement_accepted(message) -> bool:
                if not (isinstance(message, Endorsement) and message.round == round_number):
                    return False
                try:
                    check_endorsements(statement, {"hospital-2": message.signature}, signer)
                except EndorsementError:
                    return False
                return True

            _send_batch(
                h2.send_raw, mutator, result, bases, as_update, u2, endorsement_accepted, TO_SERVER, limit, quota
            )
            h2.endorse(aggregate)
            everyone = {name: h1.roster.party(name).identity.signing for name in aggregate.contributors}
            for hospital in (h1, h2):  # what the real hospitals check before they use the sum
                try:
                    check_endorsements(statement, hospital.expect(Endorsements).signatures, everyone)
                except EndorsementError as error:
                    result.state_changes += 1
                    result.notes.append(f"round {round_number}: {error}")
            mean = (total / 2).astype("<f4").tobytes()
            digest = release_digest(round_number, mean)
            h1.send(Released(round=round_number, digest=digest, mean_gradient=mean))

            def release_accepted(message) -> bool:
                return isinstance(message, Released) and message.round == round_number and not message.mean_gradient

            _send_batch(h2.send_raw, mutator, result, bases, as_update, u2, release_accepted, TO_SERVER, limit, quota)
            h2.send(Released(round=round_number, digest=digest, mean_gradient=b""))
            result.rounds += 1
            _track_rss(result, process.pid)
            _progress("server", result, quota)
        h1.expect(Finish)
        h2.expect(Finish)
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
        h1.close()
        h2.close()
        result.tracebacks += log_path.read_text().count("Traceback")


def _fuzz_hospital(quota: int, mutator: _Mutator, result: TargetResult, work: Path) -> None:
    work.mkdir(parents=True)
    federation = work / "federation"
    roster = local_federation(federation, hospitals=2, address=f"tcp://127.0.0.1:{free_port()}")
    rounds = max(1, math.ceil(quota / _BATCH))
    config = small_run_config(roster, quorum=2, rounds=rounds)
    server = ScriptedServer(roster, Credentials.load(federation / SERVER), config)
    logs = {name: work / f"{name}.log" for name in config.hospitals}
    processes = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scripts.hospital",
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
                "2",
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
    try:
        server.set_up()
        for round_number in range(1, rounds + 1):
            uploads = server.start_round(round_number)
            chunks = tuple(server.add(*uploads.values()))
            aggregate = Aggregate(round=round_number, contributors=config.hospitals, chunks=chunks)
            bases = [
                encode(aggregate),
                encode(Endorsements(round=round_number, signatures={name: b"s" * 64 for name in config.hospitals})),
                encode(RoundStart(round=round_number + 1)),
                encode(RoundAbort(round=round_number, reason="fuzz")),
                encode(KeyRequest(run_keys={"hospital-2": b"k" * 96})),
                encode(SealedKey(box=b"b" * 200, sealer="hospital-2")),
                encode(MeanRequest(round=round_number)),
                encode(Finish(reason="fuzz")),
            ]

            def acted_on(message) -> bool:
                if isinstance(message, (RoundStart, Finish)):
                    return True
                if isinstance(message, MeanRequest):  # the last round's release is sent again
                    return message.round == round_number - 1
                return isinstance(message, (Aggregate, Endorsements, RoundAbort)) and message.round == round_number

            def as_aggregate(mutated) -> bytes:
                # For a round not pending: one for the pending round the hospital would try to decrypt, and
                # leave the run on failure (test_malicious_server); the decrypt target fuzzes that loader.
                body = {"v": 1, "type": "aggregate", "round": round_number + 1, "contributors": list(config.hospitals)}
                return _pack({**body, "chunks": mutated})

            send = lambda payload: server.send_raw(target, payload)  # noqa: E731
            _send_batch(send, mutator, result, bases, as_aggregate, list(chunks), acted_on, TO_HOSPITAL, limit, quota)
            for name in config.hospitals:
                server.send(name, aggregate)
            endorsements = server.receive_from_each(Endorsement, config.hospitals)
            signatures = {name: message.signature for name, message in endorsements.items()}
            for name in config.hospitals:
                server.send(name, Endorsements(round=round_number, signatures=signatures))
            releases = server.receive_from_each(Released, config.hospitals)
            if len({message.digest for message in releases.values()}) != 1:
                result.state_changes += 1
            result.rounds += 1
            _track_rss(result, processes[target].pid)
            _progress("hospital", result, quota)
        for name in config.hospitals:
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
    params = select_bfv_parameters(max_contributors=3, vector_length=300, sum_bound=40_000)
    names = ["hospital-1", "hospital-2", "hospital-3"]
    result.rejected = 0
    while result.sent < quota:
        round_number = result.rounds + 1
        secret = SecretContext.generate(params, run_id="f0f0f0f0")
        total = CiphertextSum(PublicContext(params))
        for name in names:
            total.add(secret.encrypt_update(np.arange(300), round_number=round_number, hospital=name))
        honest = total.to_chunks()
        expected = 3 * np.arange(300)
        until = min(result.sent + _BATCH, quota)
        while result.sent < until:
            chunks = mutator.mutate_chunks(honest)
            if chunks == honest:
                continue
            result.sent += 1
            result.by_family["ciphertext"] = result.by_family.get("ciphertext", 0) + 1
            try:
                decrypted = secret.decrypt_sum(chunks, round_number=round_number, contributors=names)
            except BfvError:
                result.rejected += 1
            except Exception as error:  # anything else is the finding
                result.crashes += 1
                result.notes.append(f"{type(error).__name__}: {error}"[:200])
            else:
                if np.array_equal(decrypted, expected):
                    result.accepted_unchanged += 1
                else:
                    result.state_changes += 1
        result.rounds += 1
        _track_rss(result, os.getpid())
        _progress("decrypt", result, quota)


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
