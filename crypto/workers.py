"""SEAL's work on every core: the party and ``count - 1`` worker processes, each encrypting,
decrypting or adding its own shard of the ciphertexts.

SEAL's calls through TenSEAL hold Python's GIL (measured on 2 cores: two threads encrypting at once
took as long as one after the other), so a party's cores are used by processes. ``CryptoWorkers``
splits the ciphertexts of an upload into ``count`` contiguous shards. The party itself takes the
first, so that its share never crosses a pipe and ``count`` processes fill ``count`` cores; it
starts ``count - 1`` workers (``python -m crypto.workers``) for the others, each given the run's BFV
parameters and, at a hospital, the run's secret key, over a pipe: the key never touches a disk, an
argument list or the environment. Each shard's holder turns its piece of an update into slots and
encrypts them, decrypts its shard of a sum, or adds its shard of an upload, and the party joins the
results. The check slots (``crypto.membership``) are linear in the data slots: each holder computes
its piece's part of their inner products, and the party only sums the parts and adds the
hospital's tags. The wire bytes are exactly those of one process.

A server's sum is kept shard by shard. Adding is all or nothing, as in one process: every holder
first validates and adds its shard into a pending total, and only when all succeeded does each keep
it; otherwise each drops it and the first shard's reason is raised.

Messages between the party and its workers are msgpack maps over pipes, each answered within
``timeout_s``; a worker that ends or does not answer raises ``WorkerError``, never a hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import Callable

import msgpack
import numpy as np

__all__ = ["CryptoWorkers", "WorkerError", "available_cores"]

_TIMEOUT_S = 600.0
_PIPE_BYTES = 1 << 22
_START_TIMEOUT_S = 120.0
_VALUE_TYPES = {"<i4": "<i4", "<i8": "<i8"}  # the only ones a parent sends an update's values in
# glibc keeps freed blocks of up to 32 MiB for reuse, as every launcher has it do (scripts/_run.py): a
# worker allocates and frees each shard's ciphertexts again and again, and mapping them afresh made
# adding a shard take 8 to 14 ms where reusing them took 7 (5 ciphertexts of N = 32768, measured here).
_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


class WorkerError(RuntimeError):
    """A crypto worker process that ended, or did not answer in time."""


def available_cores() -> int:
    """The cores this process may run on: the default number of crypto workers."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CryptoWorkers:
    """The ciphertexts of one run's parameters (``params``, their ``to_dict``) in ``count`` shards: the
    first for this process, one worker process for each of the others."""

    def __init__(self, params: dict, count: int, *, secret: bytes | None = None, run_id: str = "") -> None:
        chunks = params["chunk_count"]
        self._degree = params["poly_modulus_degree"]
        self._values_per_slot = params["values_per_slot"]
        self.shards = [range(s[0], s[-1] + 1) for s in np.array_split(np.arange(chunks), min(count, chunks))]
        init = {"params": params, "secret": secret, "run_id": run_id}
        self._own = _Shard({**init, "first": self.shards[0].start, "stop": self.shards[0].stop})
        self._processes: list[subprocess.Popen] = []
        self._connections: list[tuple[Connection, Connection]] = []
        try:
            for shard in self.shards[1:]:
                self._start({**init, "first": shard.start, "stop": shard.stop})
            self._ask_each([{"op": "ready"}] * len(self.shards), timeout_s=_START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def encrypt(
        self, values: np.ndarray, *, round_number: int, check_slots: Callable[[list[int]], list[int]]
    ) -> list[bytes]:
        """The packed seeded upload of an update's ``values``, in two steps: each worker turns its piece
        of the values into its shard's slots and returns their part of the check products; the parent
        makes the check slots from the summed products (``check_slots``), and each worker encrypts
        its shard with those that fall in it."""
        dtype = "<i4" if values.size and -(2**31) <= values.min() and values.max() < 2**31 else "<i8"
        values = np.ascontiguousarray(values, dtype=dtype)  # half the bytes through the pipes, where they fit
        per_chunk = self._degree * self._values_per_slot
        pieces = [
            {
                "op": "slots",
                "values": values[s.start * per_chunk : s.stop * per_chunk].tobytes(),
                "dtype": dtype,
                "round": round_number,
            }
            for s in self.shards
        ]
        checks = check_slots([sum(parts) for parts in zip(*self._ask_each(pieces))])
        replies = self._ask_each([{"op": "encrypt", "checks": checks}] * len(self.shards))
        return [chunk for reply in replies for chunk in reply]

    def decrypt(self, chunks: list[bytes], *, round_number: int) -> tuple[np.ndarray, list[int]]:
        """The slots of an aggregate, each shard decrypted and decoded by its worker, and the check
        products of its data slots, summed over the shards."""
        requests = [
            {"op": "decrypt", "chunks": list(chunks[s.start : s.stop]), "round": round_number}
            for s in self._checked(chunks)
        ]
        replies = self._ask_each(requests)
        slots = np.concatenate([np.frombuffer(reply["slots"], dtype="<i8") for reply in replies])
        return slots, [sum(parts) for parts in zip(*(reply["products"] for reply in replies))]

    def reset_sum(self) -> None:
        self._ask_each([{"op": "reset"}] * len(self.shards))

    def add(self, chunks: list[bytes]) -> None:
        """Add an upload to the workers' sum, all or nothing (``BfvError`` from crypto.bfv where it is refused)."""
        requests = [{"op": "add", "chunks": list(chunks[s.start : s.stop])} for s in self._checked(chunks)]
        replies = self._ask_each(requests, raising=False)
        refused = [reply for reply in replies if isinstance(reply, dict) and "refused" in reply]
        self._tell_each({"op": "discard" if refused else "commit"})  # unanswered: the next request waits on it
        if refused:
            from crypto.bfv import BfvError

            raise BfvError(refused[0]["refused"])

    def sum_chunks(self) -> list[bytes]:
        return [chunk for reply in self._ask_each([{"op": "pack"}] * len(self.shards)) for chunk in reply]

    def close(self) -> None:
        for (_, sending), process in zip(self._connections, self._processes):
            try:
                sending.send_bytes(msgpack.packb({"op": "close"}))
            except OSError:
                pass
        for process in self._processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pair in self._connections:
            for connection in pair:
                connection.close()
        self._processes, self._connections = [], []

    def _checked(self, chunks: list[bytes]) -> list[range]:
        from crypto.bfv import BfvError

        if len(chunks) != self.shards[-1].stop:
            raise BfvError(f"expected {self.shards[-1].stop} ciphertexts, got {len(chunks)}")
        return self.shards

    def _start(self, init: dict) -> None:
        to_worker, from_parent = os.pipe()
        to_parent, from_worker = os.pipe()
        for pipe in (from_parent, from_worker):
            _widen(pipe)
        process = subprocess.Popen(
            # -P: nothing imported from the folder the party was started in (the worker is given the key)
            [sys.executable, "-P", "-m", "crypto.workers", str(to_worker), str(from_worker)],
            pass_fds=(to_worker, from_worker),
            stdin=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1", **_ALLOCATOR},
        )
        os.close(to_worker)
        os.close(from_worker)
        receiving, sending = Connection(to_parent, writable=False), Connection(from_parent, readable=False)
        self._processes.append(process)
        self._connections.append((receiving, sending))
        sending.send_bytes(msgpack.packb(init))

    def _tell_each(self, request: dict) -> None:
        """Give every shard's holder ``request``, which it does not answer."""
        self._send([request] * len(self.shards))
        self._own.handle(request)

    def _send(self, requests: list[dict]) -> None:
        """Send request ``j + 1`` to worker ``j`` (request 0 is this process's own)."""
        if not self._processes:
            raise WorkerError("the crypto workers are closed")
        for (_, sending), request in zip(self._connections, requests[1:]):
            try:
                sending.send_bytes(msgpack.packb(request))
            except OSError as error:
                raise WorkerError(f"a crypto worker stopped: {error}") from None

    def _ask_each(self, requests: list[dict], *, timeout_s: float = _TIMEOUT_S, raising: bool = True) -> list:
        """Give shard ``j``'s holder request ``j``, then gather every reply, each within ``timeout_s``:
        the workers work on theirs while this process does its own."""
        self._send(requests)
        replies = {0: self._own.handle(requests[0])}
        deadline = time.monotonic() + timeout_s
        waiting = {receiving: index for index, (receiving, _) in enumerate(self._connections, start=1)}
        while waiting:
            ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WorkerError(f"a crypto worker did not answer within {timeout_s:g} s")
            for receiving in ready:
                try:
                    reply = msgpack.unpackb(receiving.recv_bytes())
                except (EOFError, OSError):
                    raise WorkerError("a crypto worker process ended") from None
                replies[waiting.pop(receiving)] = reply
        ordered = [replies[index] for index in range(len(self.shards))]
        for reply in ordered:
            if "error" in reply:
                raise WorkerError(f"a crypto worker failed: {reply['error']}")
            if raising and "refused" in reply:
                from crypto.bfv import BfvError

                raise BfvError(reply["refused"])
        return [reply.get("result", reply) for reply in ordered]


def _widen(pipe: int) -> None:
    """Let a pipe hold a whole shard (Linux), so that the writer need not wait on the reader every 64 KiB."""
    try:
        import fcntl
    except ImportError:
        return
    for size in (_PIPE_BYTES, 1 << 20):  # a process may not raise it past /proc/sys/fs/pipe-max-size, 1 MiB
        try:
            fcntl.fcntl(pipe, fcntl.F_SETPIPE_SZ, size)
            return
        except (AttributeError, OSError):  # not Linux, or above the limit: try less, else the default
            continue


class _Shard:
    """One shard's work on every upload, sum or aggregate, in a worker or in the party itself."""

    def __init__(self, init: dict) -> None:
        from crypto.bfv import PublicContext, SecretContext
        from crypto.bfv_parameters import BfvParameters

        fields = {k: v for k, v in init["params"].items() if k != "chunk_count"}
        params = BfvParameters(**{**fields, "coeff_mod_bit_sizes": tuple(fields["coeff_mod_bit_sizes"])})
        self._shard = range(init["first"], init["stop"])
        self._public = PublicContext(params)
        self._secret = (
            SecretContext.from_bytes(init["secret"], params, run_id=init["run_id"]) if init["secret"] else None
        )
        self._total = self._pending = self._slots = None

    def handle(self, request: dict) -> dict | None:
        """The reply to ``request``: ``result``, ``refused`` (a ``BfvError``) or ``error``; None where unanswered."""
        from crypto.bfv import BfvError, CiphertextSum

        op, reply, shard, secret = request["op"], {}, self._shard, self._secret
        try:
            if op == "slots":
                self._slots, reply["result"] = secret.shard_slots(
                    np.frombuffer(request["values"], dtype=_VALUE_TYPES[request["dtype"]]),
                    shard,
                    round_number=request["round"],
                )
            elif op == "encrypt":
                reply["result"] = secret.encrypt_slots(secret.with_checks(self._slots, shard, request["checks"]))
                self._slots = None
            elif op == "decrypt":
                sums = secret.decrypt_slots(request["chunks"], shard)
                products = secret.data_products(sums, shard, round_number=request["round"])
                reply["result"] = {"slots": sums.tobytes(), "products": products}
            elif op == "reset":
                self._total = CiphertextSum(self._public, shard=shard)
            elif op == "add":
                self._pending = self._total.staged(request["chunks"])
            elif op in ("commit", "discard"):  # unanswered (CryptoWorkers.add)
                if op == "commit":
                    self._total.keep(self._pending)
                self._pending = None
                return None
            elif op == "pack":
                reply["result"] = self._total.to_chunks()
        except BfvError as error:
            reply = {"refused": str(error)}
        except Exception as error:  # reported to the party, which stops with it in one line
            reply = {"error": f"{type(error).__name__}: {error}"}
        return reply


def _serve(receiving: Connection, sending: Connection) -> None:
    """A worker: its shard, until told to close or its parent goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it closes its workers
    shard = _Shard(msgpack.unpackb(receiving.recv_bytes()))
    while True:
        try:
            request = msgpack.unpackb(receiving.recv_bytes())
        except EOFError:
            return
        if request["op"] == "close":
            return
        reply = shard.handle(request)
        if reply is not None:
            sending.send_bytes(msgpack.packb(reply))


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
