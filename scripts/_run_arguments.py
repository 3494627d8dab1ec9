"""The launchers' shared flags of a run: an image folder's reading, the party's hardware, and the run's
settings as argument groups, one per method of the flags it reads first (``orchestration.run_flags``)."""

from __future__ import annotations

import argparse

from consilium.orchestration.run_flags import COMMON_FLAGS, FLAG_READERS, METHOD_DEFAULTS, METHOD_FLAGS, shown
from consilium.training.methods.flags import Flag, image_size


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    """How an image folder's images are read: every party of a run reads them alike."""
    parser.add_argument(
        "--image-size", type=image_size, metavar="H,W", help="an image folder's images resized to this (or N: NxN)"
    )
    parser.add_argument(
        "--image-channels",
        type=int,
        choices=(1, 3),
        help="an image folder's images as 1 (grayscale) or 3 (RGB) channels (default: 3 if any has colour, else 1)",
    )


def add_hardware_arguments(parser: argparse.ArgumentParser) -> None:
    """The party's own hardware: where its models compute."""
    parser.add_argument(
        "--device",
        default="cpu",
        help="where per-example gradients and scores are computed: cpu, cuda or cuda:N (default: cpu); "
        "the rounding, noise and cryptography stay on the CPU",
    )


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The common run flags, then a group per method of the flags it reads first (``METHOD_FLAGS``)."""
    group = parser.add_argument_group("the run (the server announces these to the hospitals)")
    for flag in COMMON_FLAGS:
        if flag.kind is bool:
            group.add_argument(flag.name, action="store_true", help=flag.help)
        else:
            group.add_argument(flag.name, type=flag.kind, default=flag.default, help=flag.help + _default_shown(flag))
    added: set[str] = set()
    for method, flags in METHOD_FLAGS.items():
        new = [flag for flag in flags if flag.name not in added]
        if not new:
            continue
        group = parser.add_argument_group(_group_title(method, new))
        for flag in new:
            group.add_argument(flag.name, type=flag.kind, default=None, help=_help(flag.name))
            added.add(flag.name)


def _help(name: str) -> str:
    """A flag's help: what it means to each method that reads it, and its default there."""
    parts: dict[tuple[str, object], list[str]] = {}
    for method, flags in METHOD_FLAGS.items():
        for flag in flags:
            if flag.name == name:
                parts.setdefault((flag.help, flag.default), []).append(method)
    return "; ".join(
        f"{', '.join(methods)}: {text}" + ("" if default is None else f" (default: {shown(default)})")
        for (text, default), methods in parts.items()
    )


def _group_title(method: str, flags: list[Flag]) -> str:
    readers = {tuple(FLAG_READERS[flag.destination]) for flag in flags}
    if len(readers) == 1:
        return ", ".join(next(iter(readers)))
    return f"{method} (each flag names the methods that read it)"


def _default_shown(flag: Flag) -> str:
    if flag.name == "--rounds":  # every method has its own
        values: dict[object, list[str]] = {}
        for method, defaults in METHOD_DEFAULTS.items():
            values.setdefault(defaults.get("rounds"), []).append(method)
        return " (default: " + "; ".join(f"{value} for {', '.join(methods)}" for value, methods in values.items()) + ")"
    return "" if flag.default is None else f" (default: {shown(flag.default)})"
