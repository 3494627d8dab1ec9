"""An audit transcript: every message a party received, exactly as it arrived.

It lets an auditor check what the server saw rather than trust what it claims to have seen
(the tests use it to show that no secret key ever reaches the server). Records are msgpack maps
``{"time", "sender", "payload"}`` appended one after another.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import BinaryIO, Iterator

import msgpack

__all__ = ["Transcript", "read_transcript"]


class Transcript:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO = path.open("ab")

    def record(self, sender: str, payload: bytes) -> None:
        self._file.write(msgpack.packb({"time": time.time(), "sender": sender, "payload": payload}, use_bin_type=True))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_transcript(path: Path) -> Iterator[dict]:
    with path.open("rb") as handle:
        yield from msgpack.Unpacker(handle, raw=False, max_buffer_size=2**31 - 1)
