"""What the tools' command lines share: options given as a table."""

from __future__ import annotations

import argparse
from typing import Any


def add_options(parser: argparse.ArgumentParser, *options: tuple[str, Any, str]) -> None:
    """One option per (flag, default, help): its type is the default's (so
    a float option's default is written 1.0), its help ends with the
    default."""
    for flag, default, text in options:
        parser.add_argument(flag, type=type(default), default=default, help=f"{text} (default %(default)s)")


def option_values(args: argparse.Namespace, options: tuple[tuple[str, Any, str], ...]) -> dict[str, Any]:
    """The parsed values of options (as given to :func:`add_options`), by
    their names as keywords: --small-kb is small_kb."""
    names = [flag.removeprefix("--").replace("-", "_") for flag, _, _ in options]
    return {name: getattr(args, name) for name in names}
