"""``python -m ecmooncake metadata-server``: a Mooncake-compatible metadata
store, for TransferEngines in HTTP metadata mode
(``mooncake_metadata: "http://host:port/metadata"``).

It serves ``GET/PUT/DELETE /metadata?key=K`` and ``GET /health`` from memory
until SIGINT or SIGTERM. The store is lost when it stops: engines that
published into it must be restarted then.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

TOKEN_ENV = "MC_METADATA_HTTP_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="port; 0 picks a free one (default %(default)s)")
    parser.add_argument(
        "--token",
        default=None,
        help=f"require 'Authorization: Bearer TOKEN' on /metadata (default: ${TOKEN_ENV}, "
        "which Mooncake's engines send too; unset means no token)",
    )


def main(args: argparse.Namespace) -> int:
    from .native import EcmError, MetadataServer

    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = MetadataServer(args.host, args.port, token=token)
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
