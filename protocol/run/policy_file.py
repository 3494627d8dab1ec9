"""A policy file: TOML that a site's own operator writes and the server never sees, read whole or refused.

Both a hospital's policy (``protocol.run.site_policy``) and a tallier's (``tallier.tallier_policy``)
are read here: a file that cannot be read as TOML is refused with one line (``PolicyError``), and so
is an unknown key or a missing one, so that a misspelt cap is never silently absent.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from consilium.errors import ConsiliumError

__all__ = ["PolicyError", "listed", "read_policy"]


class PolicyError(ConsiliumError, ValueError):
    """A policy file that cannot be used: unreadable, a key unknown or missing, a value out of range."""


def read_policy(path: Path, keys: frozenset[str]) -> dict:
    """The values of ``path``, which holds exactly ``keys``."""
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise PolicyError(f"policy file {path}: {error}") from None
    if unknown := sorted(set(values) - keys):
        raise PolicyError(f"policy file {path}: unknown key {', '.join(unknown)} (known: {', '.join(sorted(keys))})")
    if missing := sorted(keys - set(values)):
        raise PolicyError(f"policy file {path}: missing {', '.join(missing)}")
    return values


def listed(path: Path, values: dict, key: str, known: tuple[str, ...]) -> tuple[str, ...]:
    """``values[key]``: a non-empty list of names among ``known`` (``key`` is a plural: "methods")."""
    names = values[key]
    if not isinstance(names, list) or not names:
        raise PolicyError(f"policy file {path}: {key} must be a list of at least one of {', '.join(known)}")
    if strangers := sorted(str(name) for name in names if name not in known):
        raise PolicyError(
            f"policy file {path}: unknown {key.removesuffix('s')} {', '.join(strangers)}; known: {', '.join(known)}"
        )
    return tuple(names)
