"""``python -m ecmooncake metadata-server``: a Mooncake-compatible metadata
store, for TransferEngines in HTTP metadata mode
(``mooncake_metadata: "http://host:port/metadata"``).

It serves ``GET/PUT/DELETE /metadata?key=K`` and ``GET /health`` from memory
until SIGINT or SIGTERM. The store is lost when it stops: engines that
published into it must be restarted then.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from .tokens import TokenError, resolve

TOKEN_ENV = "MC_METADATA_HTTP_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default %(default)s: this host only; engines on other hosts need "
        "an address they reach, and then a token)",
    )
    parser.add_argument("--port", type=int, default=8080, help="port; 0 picks a free one (default %(default)s)")
    parser.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help=f"require 'Authorization: Bearer TOKEN' on /metadata, TOKEN read from FILE (default: ${TOKEN_ENV}, "
        "which Mooncake's engines send too; unset means no token)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="the token itself; visible to every user of the host in /proc/<pid>/cmdline, so prefer "
        f"--token-file or ${TOKEN_ENV}",
    )
    parser.add_argument("--max-keys", type=int, default=0, help="most keys the store keeps (default 65536)")
    parser.add_argument(
        "--max-value-bytes", type=int, default=0, help="largest value; a larger PUT gets 413 (default 16 MiB)"
    )
    parser.add_argument(
        "--max-total-bytes",
        type=int,
        default=0,
        help="most bytes of keys and values together; a PUT past it (or past --max-keys) gets 507 (default 256 MiB)",
    )


def main(args: argparse.Namespace) -> int:
    from .native import EcmError, MetadataServer

    try:
        token = resolve(
            flag=args.token, file=args.token_file, env=TOKEN_ENV, what="metadata token",
            flag_name="--token", file_name="--token-file",
        )
    except TokenError as exc:
        print(f"metadata-server: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    limits = {"max_keys": args.max_keys, "max_value_bytes": args.max_value_bytes, "max_total_bytes": args.max_total_bytes}
    try:
        server = MetadataServer(args.host, args.port, token=token, **limits)
    except EcmError as exc:
        print(f"metadata-server: {exc}", file=sys.stderr)
        return 1
    with server:
        # The first line of stdout is the URL, for scripts that start the
        # server on port 0 and need to know where it went.
        print(server.url, flush=True)
        print(
            f"mooncake metadata store listening on {server.address}; engines use "
            f"mooncake_metadata {server.url!r}; Ctrl-C stops it",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(0.5):
            pass
    return 0
