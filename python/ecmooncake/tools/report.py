"""What the measuring tools share on the command line: the options of the
ceiling they divide by, the output options, and :func:`report`, which runs
a measurement and prints (or writes, or draws) its summary."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from . import ceiling as ceilings
from ..errors import EcmError
from .worker import WorkerError

KiB = 1 << 10
MiB = 1 << 20
GB = 1e9


def add_ceiling_arguments(
    parser: argparse.ArgumentParser,
    *,
    gomaxprocs_help: str = "GOMAXPROCS of every process, the ceiling's too",
    conns_help: str,
    ceiling_help: str = "MiB per ceiling sample",
) -> None:
    """``--gomaxprocs``, ``--tcp-conns`` and ``--ceiling-mb``; see :func:`ceiling_settings`."""
    parser.add_argument("--gomaxprocs", type=int, default=2, help=gomaxprocs_help + " (default %(default)s)")
    parser.add_argument("--tcp-conns", type=int, default=4, help=conns_help + " (default %(default)s)")
    parser.add_argument("--ceiling-mb", type=float, default=1024, help=ceiling_help + " (default %(default)s)")


def ceiling_settings(args: argparse.Namespace) -> dict[str, int]:
    """The run() keywords of the options :func:`add_ceiling_arguments` added."""
    return {"gomaxprocs": args.gomaxprocs, "tcp_conns": args.tcp_conns, "ceiling_bytes": int(args.ceiling_mb * MiB)}


PLOT_HELP = "also draw throughput against item size, with the ceilings, into this PNG (needs matplotlib)"


def add_output_arguments(parser: argparse.ArgumentParser, *, plot: bool, plot_help: str = PLOT_HELP) -> None:
    """``--json``, ``--quiet`` and, where the summary can be drawn, ``--plot``."""
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    if plot:
        add_plot_argument(parser, plot_help)


def add_plot_argument(parser: argparse.ArgumentParser, help: str = PLOT_HELP) -> None:
    parser.add_argument("--plot", metavar="FILE.png" if help == PLOT_HELP else "DIR_OR_FILE", help=help)


def summary_text(summary: dict, lines: list[str], result_at: int, failed: str = "FAILED") -> str:
    """A summary's lines and its result (in column result_at), between the
    ceiling's warnings: first and last, so that the head or the tail of a
    log shows them."""
    warnings = ceilings.warning_lines(summary)
    result = "  result".ljust(result_at) + ("OK" if summary["ok"] else failed)
    return "\n".join(warnings + lines + [result] + warnings)


def plot_ready(name: str) -> bool:
    """Whether a summary can be drawn here; says what to install when not."""
    from . import plot

    try:
        plot.require()
    except plot.PlotUnavailable as exc:
        print(f"ecmooncake {name}: {exc}", file=sys.stderr)
        return False
    return True


def report(
    name: str,
    run: Callable[[], dict],
    format_summary: Callable[[dict], str],
    as_json: bool = False,
    plot_path: str | None = None,
    json_path: str | None = None,
) -> int:
    """Runs a tool's measurement and prints its summary, as text or JSON;
    writes it as JSON to json_path and draws it into plot_path when given.

    Exit status: 0 when the summary says ok, 1 when it does not, 2 when the
    run could not start or finish (the reason goes to stderr).
    """
    if plot_path and not plot_ready(name):
        return 2
    try:
        summary = run()
    except (EcmError, WorkerError, OSError, ValueError) as exc:
        print(f"ecmooncake {name}: {exc}", file=sys.stderr)
        return 2
    if json_path:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
    print(json.dumps(summary, indent=2, sort_keys=True) if as_json else format_summary(summary))
    if plot_path:
        from . import plot

        for path in plot.write_all(summary, plot_path):
            print(f"ecmooncake {name}: plot written to {path}", file=sys.stderr)
    return 0 if summary["ok"] else 1
