"""``python -m ecmooncake proxy`` (also the ``ecmooncake-proxy`` script) runs
the EPD proxy in this process until SIGINT or SIGTERM; ``python -m
ecmooncake register`` keeps an instance registered with proxies, as a
sidecar next to ``vllm serve``. Python owns the signals: the library never
installs a handler.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..proxy import Proxy, Registrar
from .cli import add_options
from .serve import add_token_arguments, refuses_bad_tokens, run_until_signal, token_from

# The register token: the proxy requires it on /v1/ecm/register and
# /v1/ecm/deregister, and the register sidecar sends it.
REGISTER_TOKEN_ENV = "ECMOONCAKE_REGISTER_TOKEN"


def add_proxy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--encode", nargs="*", default=[], metavar="URL", help="encoder instances (http://host:port)")
    p.add_argument(
        "--pd",
        nargs="*",
        default=[],
        metavar="URL",
        help="prefill/decode instances; a URL may carry its consumer layout in the fragment: "
        "http://h:8100#ec=tcp://h:14579&tp_size=2&dp_size=2 (ec defaults to tcp://<host>:--ec-port)",
    )
    p.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill instances (the consumers) of a split P/D deployment")
    p.add_argument("--decode", nargs="*", default=[], metavar="URL", help="decode instances of a split P/D deployment")
    add_options(
        p,
        ("--retries", 2, "re-encode and resend a request whose consumer failed before the first byte, up to N times"),
        ("--host", "0.0.0.0", "address to listen on"), ("--port", 8000, "port to listen on"),
        ("--metrics-port", 0, "also serve /metrics on this port (it is always on the main port); 0: only there"),
        ("--ec-port", 14579, "consumers' ec_port for --pd/--prefill URLs without ec="),
        ("--encode-timeout", 60.0, "seconds allowed per encoder call"),
        ("--request-timeout", 600.0, "seconds allowed per request, end to end"),
        ("--health-interval", 2.0, "seconds between /health checks of each backend"),
        ("--health-timeout", 0.0, "seconds one /health check may take before it counts as a failure; 0 means "
         "--health-interval, at most 5 s (a loaded host wants it well above its scheduling jitter)"),
        ("--fail-threshold", 3, "consecutive failures that drop a backend"),
        ("--upstream-idle-timeout", 4.0, "seconds a backend connection may sit idle before the proxy closes it; keep it "
         "below the backends' own keep-alive (vLLM: 5 s)"),
        ("--max-body-bytes", 256 << 20, "largest request body, in bytes; a larger one is answered 413"),
        ("--max-bodies-in-flight", 8, "the proxy holds at most --max-body-bytes × this many bytes of request bodies at "
         "once, all requests together; a body that would take it over is answered 503 with Retry-After"),
        ("--max-body-bytes-per-client", 0, "the most of that budget the requests of one client (peer address) hold at "
         "once; past it, 503 with Retry-After; 0: half the budget, never less than --max-body-bytes"),
        ("--affinity-entries", 1 << 16, "media items whose PD the proxy remembers, to send a repeated image back to the "
         "PD that holds its encoder output; 0 turns routing by affinity off"),
        ("--affinity-ttl", 300.0, "seconds a remembered item counts"),
        ("--affinity-slack", 2, "requests in flight the PD holding a request's images may have beyond the least "
         "loaded PD and still be picked"),
    )
    p.add_argument("--no-register", action="store_true", help="refuse POST /v1/ecm/register even with a register token (static lists only)")
    add_token_arguments(p, name="register-token", env=REGISTER_TOKEN_ENV, what="the register token", file_help=(
        f"file holding the bearer token that register and deregister calls must carry (default: ${REGISTER_TOKEN_ENV}; "
        "with neither, registration is off)"))
    add_options(p, ("--admin-port", 0, "serve /v1/ecm/register, /deregister and /backends on this port only, so that "
                     "--port can be exposed alone; 0: on --port"))
    p.add_argument("--admin-host", default="", help="address of the admin port (default: --host)")
    p.add_argument("--no-affinity-reuse", action="store_true",
                   help="encode every image even when the picked PD already holds it (by default such an image goes "
                   "to that PD as media under the identifier its encoder gave it, and is not encoded again)")
    p.add_argument("--store-reuse", action="store_true",
                   help="send an image encoded before to a picked PD that does not hold it (its holder is too busy, or "
                   "gone) as an item that PD gets from Mooncake Store, with no encoder call (needs the PD's and the "
                   "encoders' store setting, and vLLM >= 0.30 on the PD; off by default)")
    p.add_argument("--client-media-keys", default="namespace", choices=["namespace", "refuse", "trust"],
                   help="what becomes of a cache key a client names for a media part (its \"uuid\"): namespace keeps "
                   "equal keys of different tenants apart (default; a request with a key and no tenant is refused), "
                   "refuse answers 400, trust passes keys unchanged (one tenant only)")
    p.add_argument("--tenant-header", default="", metavar="NAME",
                   help="request header naming the tenant, set by an authenticating gateway in front of the proxy "
                   "(default: the tenant is a digest of the request's Authorization header)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warn", "error"])


def register_token(args: argparse.Namespace) -> str | None:
    """The proxy's register token, from --register-token-file, --register-token or the environment."""
    return token_from(args, name="register-token", env=REGISTER_TOKEN_ENV, what="register token")


def settings_of(args: argparse.Namespace, same: str, **renamed: str) -> dict[str, Any]:
    """{name: args.name} for each name in same (space-separated), and
    {key: args.attr} for each key=attr of renamed."""
    return {**{name: getattr(args, name) for name in same.split()}, **{k: getattr(args, a) for k, a in renamed.items()}}


def proxy_config(args: argparse.Namespace, token: str | None = None) -> dict[str, Any]:
    same = "host port metrics_port encode pd prefill decode retries ec_port fail_threshold admin_port admin_host"
    same += " max_body_bytes max_bodies_in_flight max_body_bytes_per_client client_media_keys tenant_header"
    return settings_of(
        args,
        same,
        encode_timeout_s="encode_timeout",
        request_timeout_s="request_timeout",
        health_interval_s="health_interval",
        health_timeout_s="health_timeout",
        upstream_idle_timeout_s="upstream_idle_timeout",
        affinity_entries="affinity_entries",
        affinity_ttl_s="affinity_ttl",
        affinity_slack="affinity_slack",
    ) | {"affinity_reuse": not args.no_affinity_reuse, "store_reuse": args.store_reuse, "allow_register": not args.no_register, "register_token": token or ""}


def add_register_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--proxy", nargs="+", required=True, metavar="URL", help="proxies to register with (http://host:port)")
    p.add_argument("--role", default="pd", choices=["pd", "prefill", "decode", "encode"])
    p.add_argument("--url", required=True, help="this instance's base URL, as the proxy reaches it (http://host:port)")
    p.add_argument("--consumer", default="", help="control endpoint of the first consumer shard, tcp://<ec_ip>:<ec_port> (pd, prefill)")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--host-id", default="", help="machine identity shown by the proxy (default: none)")
    p.add_argument("--ttl", type=float, default=10, help="seconds the proxy keeps the entry without a heartbeat (default %(default)s)")
    add_token_arguments(p, name="token", env=REGISTER_TOKEN_ENV, what="the register token",
                        file_help=f"file holding the proxies' register token (default: ${REGISTER_TOKEN_ENV})")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warn", "error"])


def register_config(args: argparse.Namespace, token: str | None = None) -> dict[str, Any]:
    return settings_of(args, "role url consumer tp_size dp_size", proxies="proxy", host="host_id", ttl_s="ttl") | {
        "token": token or ""
    }


@refuses_bad_tokens("proxy")
def proxy_main(args: argparse.Namespace) -> int:
    from ..errors import EcmInvalid
    from ..native import configure

    token = register_token(args)

    configure(log_level=args.log_level)
    try:
        proxy = Proxy(proxy_config(args, token))
    except EcmInvalid as exc:
        print(f"proxy: {exc}", file=sys.stderr)
        return 2
    stats = proxy.stats()
    banner = f"ecmooncake proxy listening on http://{stats['addr']}"
    if stats.get("metrics_addr"):
        banner += f" (metrics also on http://{stats['metrics_addr']}/metrics)"
    if not token or args.no_register:
        banner += "; registration off"
    elif stats.get("admin_addr"):
        banner += f"; registration on the admin port http://{stats['admin_addr']}"
    else:
        banner += "; registration on (bearer token)"
    return run_until_signal(proxy, (banner, sys.stdout))


@refuses_bad_tokens("register")
def register_main(args: argparse.Namespace) -> int:
    from ..native import configure

    token = token_from(args, name="token", env=REGISTER_TOKEN_ENV, what="register token")
    if not token:
        print(
            f"register: warning: no register token (--token-file or ${REGISTER_TOKEN_ENV}); a proxy refuses registrations without one",
            file=sys.stderr,
            flush=True,
        )
    configure(log_level=args.log_level)
    reg = Registrar(register_config(args, token))
    return run_until_signal(reg, (f"registering {args.role} {args.url} with {', '.join(args.proxy)}", sys.stdout))


def console_main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ecmooncake-proxy`` script."""
    parser = argparse.ArgumentParser(
        prog="ecmooncake-proxy",
        description="EPD proxy: an OpenAI-compatible front that sends media to encoder instances "
        "and the rewritten request to prefill/decode instances.",
    )
    add_proxy_arguments(parser)
    return proxy_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(console_main())
