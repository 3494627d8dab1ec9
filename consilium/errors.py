"""The one base of every error a launcher reports in one line: bad input, a refused run, a peer that
misbehaves, a missing file. Each package's errors derive from it and from the built-in error they are
(a ``ValueError``, a ``RuntimeError``), so that a launcher catches them all without importing every
module that raises one. Nothing else lives here: every package may import it."""

__all__ = ["ConsiliumError"]


class ConsiliumError(Exception):
    """An error a party reports in one line, never a bug."""
