"""``python -m ecmooncake metadata-server``: a Mooncake-compatible metadata
store, for TransferEngines in HTTP metadata mode
(``mooncake_metadata: "http://host:port/metadata"``).

It serves ``GET/PUT/DELETE /metadata?key=K`` and ``GET /health`` from memory
until SIGINT or SIGTERM. The store is lost when it stops: engines that
published into it must be restarted then.
"""

from __future__ import annotations

import argparse
import sys

from .cli import add_options, option_values
from .serve import add_token_arguments, refuses_bad_tokens, run_until_signal, token_from

TOKEN_ENV = "MC_METADATA_HTTP_TOKEN"

# The store's bounds, passed to MetadataServer under their own names; 0
# leaves the library's default.
LIMITS = (
    ("--max-keys", 0, "most keys the store keeps; 0 means 65536"),
    ("--max-value-bytes", 0, "largest value; a larger PUT gets 413; 0 means 16 MiB"),
    ("--max-total-bytes", 0, "most bytes of keys and values together; a PUT past it (or past --max-keys) gets 507; "
     "0 means 256 MiB"),
    ("--max-conns", 0, "most connections served at once; at the cap an idle connection that sent no request with "
     "the token makes room for a new one; 0 means 1024"),
    ("--max-conns-per-peer", 0, "most connections of one peer address; 0 means 256"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default %(default)s: this host only; engines on other hosts need "
        "an address they reach, and then a token)",
    )
    add_options(parser, ("--port", 8080, "port; 0 picks a free one"))
    # No --token: a flag's value is visible to every user of the host.
    add_token_arguments(parser, name="token", env=TOKEN_ENV, what="the token", flag=False, file_help=(
        f"require 'Authorization: Bearer TOKEN' on /metadata, TOKEN read from FILE (default: ${TOKEN_ENV}, "
        "which Mooncake's engines send too); the store does not start without a token unless --open"))
    # Taken only to refuse it by name: argparse would otherwise read
    # --token as an abbreviation of --token-file.
    parser.add_argument("--token", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--open",
        action="store_true",
        help="serve without a token: whoever reaches the port can rewrite the segment descriptors engines "
        "connect to (logged loudly)",
    )
    add_options(parser, *LIMITS)


@refuses_bad_tokens("metadata-server")
def main(args: argparse.Namespace) -> int:
    from ..errors import EcmError
    from ..native import MetadataServer

    if args.token is not None:
        print(
            f"metadata-server: --token is refused: a command line is visible to every user of the host; "
            f"use --token-file FILE (chmod 600) or ${TOKEN_ENV}",
            file=sys.stderr,
        )
        return 2
    token = token_from(args, name="token", env=TOKEN_ENV, what="metadata token")
    limits = option_values(args, LIMITS)
    try:
        server = MetadataServer(args.host, args.port, token=token, open=args.open, **limits)
    except EcmError as exc:
        print(f"metadata-server: {exc}", file=sys.stderr)
        return 1
    # The first line of stdout is the URL, for scripts that start the
    # server on port 0 and need to know where it went.
    banner = f"mooncake metadata store listening on {server.address}; engines use mooncake_metadata {server.url!r}; Ctrl-C stops it"
    return run_until_signal(server, (server.url, sys.stdout), (banner, sys.stderr))
