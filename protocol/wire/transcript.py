"""An audit transcript: a record of every message a party received, as it arrived.

It lets an auditor check what the server saw rather than trust what it claims to have seen. By
default each record keeps the message's size and SHA-256 digest, which a hospital can match
against its own log of what it sent, but not the message: a transcript of ciphertexts and sealed
boxes would, together with any one hospital's key leaked later, open every update. ``payloads=True``
keeps the messages themselves (the tests use it to show that no secret key ever reaches the server),
and ``read_messages`` decodes them; guard such a file like the hospitals' keys. Records are msgpack maps
``{"time", "sender", "bytes", "sha256"[, "payload"]}`` appended one after another, in a file only
its owner can read. A resumed server appends to its transcript; a last record cut short when the
server was killed is dropped first, so that the records after it stay readable. Anything else
unreadable is refused (``TranscriptError``): an audit record is never cut to make room.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Iterator

import msgpack

from consilium.errors import ConsiliumError
from consilium.protocol.wire.messages import Message, MessageError
from consilium.protocol.wire.codec import decode

__all__ = ["Transcript", "TranscriptError", "read_messages", "read_transcript"]

log = logging.getLogger("consilium.transcript")


class Transcript:
    def __init__(self, path: Path, *, payloads: bool = False, max_payload_bytes: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            # A record is at most a payload and its small header; a longer unreadable tail is damage.
            payload_room = (max_payload_bytes or 2**31) if payloads else 0
            _drop_torn_last_record(path, longest_record=payload_room + 1024)
        self._descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.chmod(path, 0o600)  # also when the file existed, whatever the umask made it
        self._payloads = payloads
        self._max_payload_bytes = max_payload_bytes
        self.lost = 0  # records the system refused to write (a full disk): counted and reported, never fatal

    def record(self, sender: str, payload: bytes) -> None:
        entry = {
            "time": time.time(),
            "sender": sender,
            "bytes": len(payload),
            "sha256": hashlib.sha256(payload).digest(),
        }
        if self._payloads and (self._max_payload_bytes is None or len(payload) <= self._max_payload_bytes):
            entry["payload"] = payload  # an oversized message is refused unread: its digest is enough
        record = msgpack.packb(entry, use_bin_type=True)
        end = os.lseek(self._descriptor, 0, os.SEEK_END)
        try:
            if os.write(self._descriptor, record) != len(record):
                raise OSError("a short write (is the disk full?)")
        except OSError as error:
            with contextlib.suppress(OSError):  # a record half written would make every later one unreadable
                os.ftruncate(self._descriptor, end)
            self.lost += 1
            if self.lost == 1 or self.lost % 1000 == 0:
                log.warning("the transcript lost %d records so far: %s", self.lost, error)

    def close(self) -> None:
        os.close(self._descriptor)


def read_transcript(path: Path) -> Iterator[dict]:
    with path.open("rb") as handle:
        yield from msgpack.Unpacker(handle, raw=False, max_buffer_size=2**31 - 1)


def read_messages(path: Path, *, accept: frozenset[type]) -> Iterator[tuple[str, Message | None, bytes]]:
    """``(sender, message, payload)`` of every record that kept its payload, decoded as one of ``accept``.

    ``message`` is None for a payload that is no such message: the party refused it when it came (a
    party records a message before it decodes it), but its bytes still reached the party. A record
    without its payload (kept by digest alone, or too large to keep) is left out.
    """
    for record in read_transcript(path):
        if "payload" in record:
            payload = record["payload"]
            try:
                message = decode(payload, accept=accept, max_bytes=len(payload))
            except MessageError:
                message = None
            yield record["sender"], message, payload


class TranscriptError(ConsiliumError, RuntimeError):
    """A transcript that is damaged other than by a last record cut short."""


def _drop_torn_last_record(path: Path, *, longest_record: int) -> None:
    size = path.stat().st_size
    with path.open("rb") as handle:
        unpacker = msgpack.Unpacker(handle, raw=False, max_buffer_size=2**31 - 1)
        complete = 0
        try:
            for _ in unpacker:
                complete = unpacker.tell()
        except (ValueError, msgpack.UnpackException):
            raise TranscriptError(f"the transcript {path} is unreadable after byte {complete}; move it aside") from None
    if size - complete > longest_record:
        raise TranscriptError(f"the transcript {path} is unreadable after byte {complete}; move it aside")
    if complete < size:
        os.truncate(path, complete)
