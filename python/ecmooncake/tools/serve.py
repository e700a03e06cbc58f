"""What the commands that run a library server in the foreground share
(``proxy``, ``register``, ``metadata-server``): their token options, read
through :mod:`ecmooncake.tokens`, and the wait for SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import threading
from typing import Any, Callable, TextIO

from ..tokens import TokenError, resolve


def add_token_arguments(
    parser: argparse.ArgumentParser, *, name: str, env: str, file_help: str, what: str, flag: bool = True
) -> None:
    """``--NAME-file FILE`` and, unless ``flag`` is false, ``--NAME TOKEN``;
    see :func:`token_from`."""
    parser.add_argument(f"--{name}-file", default=None, metavar="FILE", help=file_help)
    if not flag:
        return
    parser.add_argument(
        f"--{name}",
        default=None,
        metavar="TOKEN",
        help=f"{what} itself; visible to every user of the host in /proc/<pid>/cmdline, so prefer "
        f"--{name}-file or ${env}",
    )


def token_from(args: argparse.Namespace, *, name: str, env: str, what: str) -> str | None:
    """The token of the options :func:`add_token_arguments` added, else ``$env``."""
    dest = name.replace("-", "_")
    return resolve(
        flag=getattr(args, dest, None),
        file=getattr(args, dest + "_file"),
        env=env,
        what=what,
        flag_name=f"--{name}",
        file_name=f"--{name}-file",
    )


def refuses_bad_tokens(command: str) -> Callable:
    """Turns a TokenError out of the decorated ``main(args)`` into one line
    on stderr and exit status 2."""

    def wrap(main: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @functools.wraps(main)
        def run(args: argparse.Namespace) -> int:
            try:
                return main(args)
            except TokenError as exc:
                print(f"{command}: {exc}", file=sys.stderr)
                return 2

        return run

    return wrap


def run_until_signal(handle: Any, *lines: tuple[str, TextIO]) -> int:
    """Prints each (text, stream), serves until SIGINT or SIGTERM, then
    closes handle and puts the previous signal handlers back."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for text, stream in lines:
            print(text, file=stream, flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        handle.close()
    return 0
