"""The wire format: a message as a versioned msgpack map, and back, validated in full.

``encode`` writes ``{"v": PROTOCOL_VERSION, "type": <name>, <fields>}``, every text made printable and
short. ``decode`` accepts a message only if it is within the size limit, parses as msgpack within
bounds on its objects, has the right version, is of a type the receiving role accepts
(``messages.TO_SERVER`` and the other role sets), and has exactly the declared fields with the declared
types (integers are non-negative: they are rounds and counts). Anything else raises ``MessageError``
and the caller changes no state.
"""

from __future__ import annotations

import typing
from dataclasses import fields

import msgpack
import numpy as np

from consilium.protocol.wire.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message, MessageError

__all__ = ["MAX_TEXT_LENGTH", "decode", "encode", "float32_values"]

_MAX_ARRAY_ITEMS = 1 << 17
_MAX_MAP_ITEMS = 1 << 14
_MAX_OBJECTS = 1 << 20  # in all: a few hundred in an honest message, whose bulk travels as bytes
# Every text on the wire (a reason, a hospital's name) is at most this many printable characters, so
# that nothing a peer sends can flood a log or forge lines in it.
MAX_TEXT_LENGTH = 500


def encode(message: Message) -> bytes:
    body = {"v": PROTOCOL_VERSION, "type": message.TYPE}
    for field in fields(message):
        value = getattr(message, field.name)
        if type(value) is str:
            value = _printable(value)
        elif type(value) is tuple and value and type(value[0]) is str:  # names, or an answer's lines
            value = tuple(map(_printable, value))
        body[field.name] = value
    return msgpack.packb(body, use_bin_type=True)


def _printable(text: str) -> str:
    """Our own reasons may quote exceptions: newlines and other controls become spaces, the rest is cut."""
    cleaned = "".join(c if c.isprintable() else " " for c in text)
    return cleaned if len(cleaned) <= MAX_TEXT_LENGTH else cleaned[: MAX_TEXT_LENGTH - 3] + "..."


def decode(raw: bytes, *, accept: frozenset[type], max_bytes: int) -> Message:
    if len(raw) > max_bytes:
        raise MessageError(f"message of {len(raw)} bytes exceeds the limit of {max_bytes}")
    # Each container within what any message holds (a round's labels, a model's input statistics), all together within
    # _MAX_OBJECTS as they are made: no message expands into a billion small objects (nested empty maps took 70x).
    count = _ObjectCount()
    try:
        body = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_array_len=_MAX_ARRAY_ITEMS,
            max_map_len=_MAX_MAP_ITEMS,
            list_hook=count,
            object_hook=count,
        )
    except (ValueError, msgpack.UnpackException) as error:  # ValueError covers ExtraData, FormatError, bad UTF-8
        raise MessageError(f"not a msgpack message: {error}") from None
    if type(body) is not dict:
        raise MessageError("a message must be a map")
    if any(type(key) is not str for key in body):
        raise MessageError("a message's field names must be strings")
    version = body.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise MessageError(f"unsupported protocol version {_shown(version)} (this is version {PROTOCOL_VERSION})")
    name = body.get("type")
    cls = MESSAGE_TYPES.get(name) if type(name) is str else None
    if cls is None or cls not in accept:
        raise MessageError(f"unexpected message type {_shown(name)}")
    declared = {field.name: field for field in fields(cls)}
    given = set(body) - {"v", "type"}
    if given != set(declared):
        raise MessageError(f"{cls.TYPE}: expected fields {sorted(declared)}, got {_shown(sorted(given))}")
    hints = typing.get_type_hints(cls)
    values = {name: _conform(body[name], hints[name], f"{cls.TYPE}.{name}") for name in declared}
    return cls(**values)


class _ObjectCount:
    """Counts the items of each container as the decoder completes it; past ``_MAX_OBJECTS``, the message is refused."""

    total = 0

    def __call__(self, container):
        self.total += len(container) + 1
        if self.total > _MAX_OBJECTS:
            raise MessageError(f"a message holds more than {_MAX_OBJECTS:,} objects")
        return container


def _shown(value, limit: int = 60) -> str:
    """A peer-chosen value, quoted and cut short for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _conform(value, annotation, where: str):
    origin = typing.get_origin(annotation)
    if annotation is bool:
        if type(value) is not bool:
            raise MessageError(f"{where} must be a boolean")
        return value
    if annotation is int:
        if type(value) is not int or value < 0:
            raise MessageError(f"{where} must be a non-negative integer")
        return value
    if annotation in (str, bytes, dict):
        if type(value) is not annotation:
            raise MessageError(f"{where} must be {annotation.__name__}, not {type(value).__name__}")
        if annotation is str and (len(value) > MAX_TEXT_LENGTH or not value.isprintable()):
            raise MessageError(f"{where} must be at most {MAX_TEXT_LENGTH} printable characters")
        return value
    if origin is tuple:
        item = typing.get_args(annotation)[0]
        if type(value) is not list:
            raise MessageError(f"{where} must be a list")
        return tuple(_conform(v, item, f"{where}[]") for v in value)
    if origin is dict:
        key, item = typing.get_args(annotation)
        if type(value) is not dict:
            raise MessageError(f"{where} must be a map")
        return {_conform(k, key, f"{where} key"): _conform(v, item, f"{where}[]") for k, v in value.items()}
    raise TypeError(f"no wire rule for {annotation!r}")


def float32_values(payload: bytes, count: int, what: str) -> np.ndarray:
    """A float32 field (parameters, an optimizer state, a mean gradient) as ``count`` finite values, or MessageError."""
    values = np.frombuffer(payload, dtype="<f4") if len(payload) % 4 == 0 else np.empty(0, dtype="<f4")
    if values.size != count or not np.all(np.isfinite(values)):
        raise MessageError(f"{what} is not {count} finite float32 values")
    return values.copy()
