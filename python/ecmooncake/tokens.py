"""Secrets for the command lines: read from a file or the environment.

A flag's value is visible to every user of the host in
``/proc/<pid>/cmdline`` (and in ``ps``), so the commands take tokens from a
file (``--*-token-file``) or an environment variable; a ``--*-token`` flag
still works, with a warning.
"""

from __future__ import annotations

import os
import stat
import sys


class TokenError(ValueError):
    """A token file that cannot be used, or two sources at once."""


def resolve(*, flag: str | None, file: str | None, env: str, what: str, flag_name: str, file_name: str) -> str | None:
    """The token from ``file``, else ``flag`` (with a warning), else ``$env``; None when none is set."""
    if flag is not None and file is not None:
        raise TokenError(f"{what}: give {flag_name} or {file_name}, not both")
    if file is not None:
        return read_file(file, what)
    if flag is not None:
        print(
            f"warning: {flag_name} is visible to every user of this host in /proc/{os.getpid()}/cmdline; "
            f"prefer {file_name} FILE or ${env}",
            file=sys.stderr,
            flush=True,
        )
        return flag or None
    return os.environ.get(env) or None


def read_file(path: str, what: str) -> str:
    """The file's content without its trailing newline; refuses an empty file."""
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            token = f.read().rstrip("\r\n")
    except OSError as exc:
        raise TokenError(f"{what}: cannot read the token file {path}: {exc.strerror}") from exc
    if not token:
        raise TokenError(f"{what}: the token file {path} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(
            f"warning: the token file {path} can be read by other users (mode {stat.S_IMODE(mode):o}); chmod 600 it",
            file=sys.stderr,
            flush=True,
        )
    return token
