"""A party's own code, named on its own command line: ``package.module:function`` or ``path/to/file.py:function``.

Code never travels between parties. An operator names a function of the code installed on their
own machine (a model with ``--model``, a data loader with ``--data``); a run configuration carries
at most the function's name, never code, and a name a server announces is never imported: only the
references a party's own operator gave are. The name is the reference with a file's folder left
out (``resnet_gn.py:build``), so that machines holding the file in different places agree on it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Callable

__all__ = ["check_name", "is_reference", "load_function", "reference_name"]

# What a name may look like, also one a server announces: a file's or a module's name and a function's, bounded.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}:[A-Za-z_][A-Za-z0-9_]{0,127}")


def is_reference(text: str | None) -> bool:
    """Whether ``text`` names a function of one's own code rather than something built in."""
    return text is not None and ":" in text


def reference_name(reference: str, *, flag: str, error: type[Exception]) -> str:
    """The name a run configuration may carry for ``reference``: a file's folder left out."""
    location, _, function = reference.rpartition(":")
    name = f"{Path(location).name if location.endswith('.py') else location}:{function}"
    if not _NAME.fullmatch(name):
        raise error(
            f"{flag} {reference!r}: expected package.module:function or path/to/file.py:function, "
            "with letters, digits, '_', '.' and '-' in the names"
        )
    return name


def check_name(name: object, *, error: type[Exception]) -> None:
    """``error`` unless ``name`` is one a run configuration may carry (checked before it is shown or used)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise error("a name of one's own code is module:function or file.py:function, at most 257 characters")


def load_function(reference: str, *, flag: str, error: type[Exception]) -> Callable:
    """The function ``reference`` names, loaded from this machine; ``error`` with a one-line reason where it cannot be."""
    reference_name(reference, flag=flag, error=error)
    location, _, function_name = reference.rpartition(":")
    module = _load_file(Path(location), flag, error) if location.endswith(".py") else _import(location, flag, error)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise error(f"{flag} {reference}: {location} has no function {function_name}")
    return function


def _load_file(path: Path, flag: str, error: type[Exception]):
    if not path.is_file():
        raise error(f"{flag}: no file {path}")
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]  # one module a file, whatever its name
    module_name = f"consilium_own_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}_{digest}"
    if module_name in sys.modules:  # loaded once a process, as an import would be
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise error(f"{flag}: {path} cannot be loaded as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so that its classes pickle and its dataclasses resolve
    try:
        spec.loader.exec_module(module)
    except Exception as failure:  # the operator's own code: any failure is theirs to fix, in one line
        del sys.modules[module_name]
        raise error(f"{flag}: {path} failed to load: {type(failure).__name__}: {failure}") from None
    return module


def _import(module_name: str, flag: str, error: type[Exception]):
    try:
        return importlib.import_module(module_name)
    except Exception as failure:  # ModuleNotFoundError, or the module's own failure
        raise error(f"{flag}: cannot import {module_name}: {type(failure).__name__}: {failure}") from None
