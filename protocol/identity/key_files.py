"""The small TOML files that hold keys and the roster: read with a one-line error, written private.

Values are TOML literal strings (keys in z85 or base64, names, addresses, digests never contain a
quote or a newline) and integers, so no escaping is ever needed.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from consilium.errors import ConsiliumError

__all__ = ["KeyFileError", "parse_toml", "read_bytes", "read_toml", "shown", "toml_table", "write_private"]


class KeyFileError(ConsiliumError, ValueError):
    """A key or roster file that is missing, unreadable or cannot be written."""


def read_toml(path: Path, *, hint: str) -> dict:
    return parse_toml(read_bytes(path, hint=hint), path)


def read_bytes(path: Path, *, hint: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise KeyFileError(f"no file {path} ({hint})") from None
    except OSError as error:
        raise KeyFileError(f"cannot read {path}: {error}") from None


def parse_toml(raw: bytes, path: Path) -> dict:
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise KeyFileError(f"cannot read {path}: {error}") from None
    except RecursionError:
        raise KeyFileError(f"cannot read {path}: nested too deeply") from None


def write_private(path: Path, text: str | bytes) -> None:
    """Create ``path`` readable and writable by its owner only; never replace an existing file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{path} exists already; choose an empty folder") from None
    except OSError as error:
        raise KeyFileError(f"cannot create {path}: {error}") from None
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(text.encode() if isinstance(text, str) else text)


def toml_table(values: dict[str, str | int]) -> str:
    return "".join(f"{key} = {_toml_value(value)}\n" for key, value in values.items())


def _toml_value(value: str | int) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or "'" in value or "\n" in value or "\r" in value:
        raise KeyFileError(f"cannot write {value!r} as a TOML literal string")
    return f"'{value}'"


def shown(value: object, limit: int = 60) -> str:
    """A value read from a file, quoted and cut short for a one-line error."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
