"""SEAL's work on every core: worker processes, each encrypting, decrypting or adding its own shard of the ciphertexts.

SEAL's calls through TenSEAL hold Python's GIL (measured on 2 cores: two threads encrypting at once
took as long as one after the other), so a party's cores are used by processes. ``CryptoWorkers``
starts ``count`` of them (``python -m crypto.workers``), each given the run's BFV parameters and,
at a hospital, the run's secret key, over a pipe: the key never touches a disk, an argument list or
the environment. The ciphertexts of an upload are split into ``count`` contiguous shards; worker
``j`` encrypts, decrypts or adds shard ``j``, and the parent joins the results. Everything else
(the slots and their check slots, the check of a decrypted sum) stays in the parent: the wire
bytes are exactly those of one process.

A server's sum is kept by the workers, each for its shard. Adding is all or nothing, as in one
process: every worker first validates and adds its shard into a pending total, and only when all
succeeded does each keep it; otherwise each drops it and the first worker's reason is raised.

Messages between the parent and its workers are msgpack maps over pipes, each answered within
``timeout_s``; a worker that ends or does not answer raises ``WorkerError``, never a hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait

import msgpack
import numpy as np

__all__ = ["CryptoWorkers", "WorkerError", "available_cores"]

_TIMEOUT_S = 600.0
_PIPE_BYTES = 1 << 22
_START_TIMEOUT_S = 120.0
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
    """``count`` worker processes for the ciphertexts of one run's parameters (``params``, their ``to_dict``)."""

    def __init__(self, params: dict, count: int, *, secret: bytes | None = None, run_id: str = "") -> None:
        chunks = params["chunk_count"]
        self.shards = [range(s[0], s[-1] + 1) for s in np.array_split(np.arange(chunks), min(count, chunks))]
        self._processes: list[subprocess.Popen] = []
        self._connections: list[tuple[Connection, Connection]] = []
        try:
            for shard in self.shards:
                self._start(params, shard, secret, run_id)
            self._ask_each([{"op": "ready"}] * len(self.shards), timeout_s=_START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def encrypt(self, slots: np.ndarray, degree: int) -> list[bytes]:
        """The packed seeded upload of ``slots`` (``degree`` slots a ciphertext), shard by shard."""
        slots = np.ascontiguousarray(slots, dtype="<i8")
        requests = [
            {"op": "encrypt", "slots": slots[s.start * degree : s.stop * degree].tobytes()} for s in self.shards
        ]
        return [chunk for reply in self._ask_each(requests) for chunk in reply]

    def decrypt(self, chunks: list[bytes]) -> np.ndarray:
        """The slots of an aggregate, each shard decrypted and decoded by its worker."""
        requests = [{"op": "decrypt", "chunks": list(chunks[s.start : s.stop])} for s in self._checked(chunks)]
        return np.concatenate([np.frombuffer(reply, dtype="<i8") for reply in self._ask_each(requests)])

    def reset_sum(self) -> None:
        self._ask_each([{"op": "reset"}] * len(self.shards))

    def add(self, chunks: list[bytes]) -> None:
        """Add an upload to the workers' sum, all or nothing (``BfvError`` from crypto.bfv where it is refused)."""
        requests = [{"op": "add", "chunks": list(chunks[s.start : s.stop])} for s in self._checked(chunks)]
        replies = self._ask_each(requests, raising=False)
        refused = [reply for reply in replies if isinstance(reply, dict) and "refused" in reply]
        self._ask_each([{"op": "discard" if refused else "commit"}] * len(self.shards))
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

    def _start(self, params: dict, shard: range, secret: bytes | None, run_id: str) -> None:
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
        sending.send_bytes(
            msgpack.packb(
                {
                    "op": "init",
                    "params": params,
                    "first": shard.start,
                    "stop": shard.stop,
                    "secret": secret,
                    "run_id": run_id,
                }
            )
        )

    def _ask_each(self, requests: list[dict], *, timeout_s: float = _TIMEOUT_S, raising: bool = True) -> list:
        """Send request ``j`` to worker ``j``, then gather every reply, each within ``timeout_s``."""
        if not self._processes:
            raise WorkerError("the crypto workers are closed")
        for (_, sending), request in zip(self._connections, requests):
            try:
                sending.send_bytes(msgpack.packb(request))
            except OSError as error:
                raise WorkerError(f"a crypto worker stopped: {error}") from None
        deadline, replies = time.monotonic() + timeout_s, {}
        waiting = {receiving: index for index, (receiving, _) in enumerate(self._connections)}
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
        ordered = [replies[index] for index in range(len(self._connections))]
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


def _serve(receiving: Connection, sending: Connection) -> None:
    """A worker: its shard of every upload, sum or aggregate, until told to close or its parent goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it closes its workers
    from crypto.bfv import BfvError, CiphertextSum, PublicContext, SecretContext
    from crypto.bfv_parameters import BfvParameters

    init = msgpack.unpackb(receiving.recv_bytes())
    fields = {k: v for k, v in init["params"].items() if k != "chunk_count"}
    params = BfvParameters(**{**fields, "coeff_mod_bit_sizes": tuple(fields["coeff_mod_bit_sizes"])})
    shard = range(init["first"], init["stop"])
    public = PublicContext(params)
    secret = SecretContext.from_bytes(init["secret"], params, run_id=init["run_id"]) if init["secret"] else None
    total = pending = None
    while True:
        try:
            request = msgpack.unpackb(receiving.recv_bytes())
        except EOFError:
            return
        op, reply = request["op"], {}
        try:
            if op == "close":
                return
            if op == "encrypt":
                reply["result"] = secret.encrypt_slots(np.frombuffer(request["slots"], dtype="<i8"))
            elif op == "decrypt":
                reply["result"] = secret.decrypt_slots(request["chunks"], shard).tobytes()
            elif op == "reset":
                total = CiphertextSum(public, shard=shard)
            elif op == "add":
                pending = total.staged(request["chunks"])
            elif op in ("commit", "discard"):
                if op == "commit":
                    total.keep(pending)
                pending = None
            elif op == "pack":
                reply["result"] = total.to_chunks()
        except BfvError as error:
            reply = {"refused": str(error)}
        except Exception as error:  # reported to the parent, which stops with it in one line
            reply = {"error": f"{type(error).__name__}: {error}"}
        sending.send_bytes(msgpack.packb(reply))


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
