"""The transfer benchmark: host memory over loopback TCP, large and small items,
reported as ratios to the TCP ceiling measured in the same run.

One consumer shard and one producer run in spawned processes. Each batch is
one submit of distinct items; its time runs from the submit until the producer
has seen every push done. Between batches the consumer acquires and releases
the items so that their space can be reused; that is off the clock.

The ceiling (:class:`ceiling.TCPCeiling`) is the same layout with only the
data plane: its own writer and receiver, no reservations, in a sender and a
receiver process with the workers' GOMAXPROCS, over the producer's
``tcp_conns`` connections and frame size, sampled before and after the
timed phases.
"""

from __future__ import annotations

import argparse
import ipaddress
import secrets
import sys

from . import ceiling as ceilings
from .. import trace
from ..native import configure
from . import harness
from .cli import add_options, option_values
from .harness import Worker
from .phase import run_phase as _phase
from .report import GB, KiB, MiB, add_ceiling_arguments, add_output_arguments, ceiling_settings, report, summary_text


# What each plane adds to the consumer's and the producer's config:
# Mooncake's TransferEngine (the installed pip wheel, through the package's
# shim) with its own TCP protocol, in its P2P handshake mode (no metadata
# service), so that it moves the bytes over the same kind of sockets as the
# native plane and the ceiling.
PLANES = {
    "tcp": {"transport": "tcp"},
    "mooncake": {"transport": "mooncake", "mooncake_protocol": "tcp"},
    # The producer maps the shard's slab (same host only): its ratio is still
    # to the TCP ceiling, and its phases show the control plane's share
    # without a network write beside it.
    "shm": {"transport": "shm"},
}
TCP_PLANES = ("tcp", "mooncake")

# Stamps each worker's rings hold (ecmooncake.trace): a phase's timed
# items, about eight hops each, fit with room to spare.
TRACE_CAPACITY = 1 << 18


def planes_error(planes: tuple[str, ...]) -> str | None:
    """Why a list of planes cannot be measured, or None."""
    unknown = [p for p in planes if p not in PLANES]
    if unknown:
        return f"unknown plane {', '.join(unknown)}: choose among {', '.join(PLANES)}"
    if not planes:
        return f"no plane named: choose among {', '.join(PLANES)}"
    if len(set(planes)) != len(planes):
        return "a plane is named twice"
    return None


def _plane_workers(plane: str, ip: str, port: int, slab_bytes: int, settings: dict, tcp_conns: int) -> list[Worker]:
    extra = dict(PLANES[plane])
    if not ipaddress.ip_address(ip).is_loopback:
        # A shard beyond loopback needs a secret its producer shares (on
        # loopback both take the user's own); one for this run alone.
        extra["auth_secret"] = secrets.token_hex(32)
    consumer = Worker(
        "consumer",
        f"consumer-{plane}",
        config={"ec_ip": ip, "ec_port": port, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, **extra},
        slab_bytes=slab_bytes,
        settings=settings,
        trace=TRACE_CAPACITY,
    )
    producer_config = {**extra}
    if plane == "tcp":
        producer_config["tcp_conns"] = tcp_conns
    elif plane == "mooncake":
        producer_config["mooncake_host"] = ip
    producer = Worker("producer", f"producer-{plane}", config=producer_config, settings=settings, trace=TRACE_CAPACITY)
    return [consumer, producer]


def run(
    mb: float = 32,
    batch: int = 8,
    batches: int = 16,
    small_kb: float = 64,
    small_batch: int = 256,
    small_batches: int = 8,
    progress: bool = True,
    gomaxprocs: int = 2,
    tcp_conns: int = 4,
    ceiling_bytes: int = ceilings.GiB,
    planes: tuple[str, ...] = ("tcp",),
    host: str = "127.0.0.1",
) -> dict:
    why = planes_error(planes)
    if why:
        raise ValueError(why)
    large_bytes = int(mb * MiB)
    small_bytes = int(small_kb * KiB)
    slab_bytes = 2 * max(large_bytes * batch, small_bytes * small_batch) + 64 * MiB
    settings = {"log_level": "warn", "gomaxprocs": gomaxprocs}
    tcp = ceilings.TCPCeiling(gomaxprocs, tcp_conns, receivers=1, nbytes=ceiling_bytes, host=host)
    configure(**settings)
    if progress:
        print("bench: measuring the TCP ceiling", file=sys.stderr, flush=True)
    tcp.measure(ceilings.BEFORE)
    by_plane: dict[str, dict] = {}
    for plane in planes:
        port = harness.free_port_range(1, host)
        address = f"tcp://{host}:{port}" if ":" not in host else f"tcp://[{host}]:{port}"
        # One plane's processes at a time: the planes never share the CPUs.
        workers = _plane_workers(plane, host, port, slab_bytes, settings, tcp_conns)
        try:
            for worker in workers:
                worker.wait_ready(120)
            consumer, producer = workers
            phases = {}
            for label, nbytes, n, count in (
                ("large", large_bytes, batch, batches),
                ("small", small_bytes, small_batch, small_batches),
            ):
                if progress:
                    print(f"bench: {plane}: {count} batches of {n} x {nbytes} bytes", file=sys.stderr, flush=True)
                phases[label] = _phase(consumer, producer, address, f"{plane}-{label}", nbytes, n, count)
        finally:
            harness.stop_all(workers)
        by_plane[plane] = phases
    if progress:
        print("bench: measuring the TCP ceiling again", file=sys.stderr, flush=True)
    tcp.measure(ceilings.AFTER)

    book = tcp.book
    ceiling_bps = book.value()
    for phases in by_plane.values():
        small = phases["small"]
        # What a small item costs beyond moving its bytes at the ceiling's rate.
        small["overhead_us_per_item"] = small["us_per_item"] - (small_bytes / ceiling_bps * 1e6 if ceiling_bps else 0.0)
        for phase in phases.values():
            phase["ceiling_ratio"] = book.ratio(phase["bytes_per_sec"])
            phase["best_ceiling_ratio"] = book.ratio(phase["bytes_per_sec"], book.best()[0])
    first = by_plane[planes[0]]
    summary = {
        "ok": all(not p["failures"] for phases in by_plane.values() for p in phases.values()),
        "transport": planes[0],
        "host": host,
        "gomaxprocs": gomaxprocs,
        "tcp_conns": tcp_conns,
        "ceiling": book.as_dict(),
        # The first plane's phases, where a single-plane run always had them.
        "large": first["large"],
        "small": first["small"],
        "planes": by_plane,
    }
    return ceilings.mark(summary, ceiling_marks(by_plane))


def ceiling_marks(by_plane: dict[str, dict]) -> dict[str, float]:
    """The ratios held to the TCP ceiling: those of planes that move bytes
    over TCP sockets. shm's ratio to it is printed for reference; above 1
    it is no benchmark bug."""
    return {
        f"{plane} {label} items" if len(by_plane) > 1 else f"{label} items": p["ceiling_ratio"]
        for plane, phases in by_plane.items()
        if plane in TCP_PLANES
        for label, p in phases.items()
    }


def format_summary(s: dict) -> str:
    def trips(phase: dict) -> str:
        value = phase["round_trips_per_batch"]
        return "n/a" if value is None else f"{value:.1f}"

    ceiling = s["ceiling"]
    planes = s.get("planes") or {s["transport"]: {"large": s["large"], "small": s["small"]}}
    host = s.get("host", "127.0.0.1")
    where = "loopback" if host in ("127.0.0.1", "::1") else host
    lines = [
        f"ecmooncake bench: host memory, one consumer shard, {', '.join(planes)} over {where} "
        f"(GOMAXPROCS {s['gomaxprocs']} per process, {s['tcp_conns']} connections)",
        f"  ceiling        {ceiling['text']}",
    ]
    for plane, phases in planes.items():
        large, small = phases["large"], phases["small"]
        tag = f"{plane:<9}" if len(planes) > 1 else ""
        lines += [
            f"  {tag}{large['item_bytes'] // MiB} MiB items   {large['batches']} batches of {large['batch']}: "
            f"{large['bytes_per_sec'] / GB:.2f} GB/s = {large['ceiling_ratio']:.2f} of the ceiling "
            f"({large['best_ceiling_ratio']:.2f} of its best); {trips(large)} control round trips per batch",
            f"  {tag}{small['item_bytes'] // KiB} KiB items   {small['batches']} batches of {small['batch']}: "
            f"{small['us_per_item']:.1f} us per item ({small['overhead_us_per_item']:.1f} us above the ceiling's "
            f"data time), {small['bytes_per_sec'] / GB:.3f} GB/s; {trips(small)} control round trips per batch",
        ]
        for phase in (large, small):
            lines += [f"  failed: {plane}: {f}" for f in phase["failures"]]
        lines += trace_lines(plane, phases, (ceiling.get("gb_per_s") or 0) * GB)
    return summary_text(s, lines, result_at=17)


def trace_lines(plane: str, phases: dict, ceiling_bps: float) -> list[str]:
    """Each phase's per-hop table, under the time its items' bytes take at
    the ceiling's rate (the floor of the same run)."""
    lines = []
    for label, phase in phases.items():
        t = phase.get("trace")
        if not t or not t.get("rows"):
            continue
        data_us = phase["item_bytes"] * phase["batch"] / ceiling_bps * 1e6 if ceiling_bps else 0.0
        size = f"{phase['item_bytes'] // MiB} MiB" if phase["item_bytes"] >= MiB else f"{phase['item_bytes'] // KiB} KiB"
        dropped = f"; {t['dropped']} stamps overwritten" if t.get("dropped") else ""
        lines.append(
            f"  {plane} {label} ({size} x {phase['batch']}): per-hop trace of {t['items']} items, us "
            f"(a batch's bytes take {data_us:.1f} us at the ceiling's rate{dropped})"
        )
        lines += trace.format_table(t, indent="    ")
    return lines


# The sizes of the large and small phases: options, and run()'s keywords.
SIZE_OPTIONS = (
    ("--mb", 32.0, "large item size, MiB"), ("--batch", 8, "large items per batch"), ("--batches", 16, "timed large batches"),
    ("--small-kb", 64.0, "small item size, KiB"), ("--small-batch", 256, "small items per batch"),
    ("--small-batches", 8, "timed small batches"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from . import sweep

    add_options(parser, *SIZE_OPTIONS)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="instead, measure throughput and latency against item size for every data plane here, each beside "
        "its ceiling (--plot implies it)",
    )
    parser.add_argument(
        "--sizes",
        default=",".join(ceilings.size_text(n).replace(" ", "").removesuffix("iB") for n in sweep.SIZES),
        help="item sizes of the sweep, K/M/G (default %(default)s)",
    )
    parser.add_argument(
        "--planes",
        default=None,
        help="data planes to measure, comma-separated, one after the other against the same ceiling: "
        "tcp (the native plane), mooncake (Mooncake's engine with its tcp protocol; needs the wheel, "
        "and a network namespace, since the engine advertises the first interface that is not loopback), "
        "shm (the shard's slab mapped by the producer, same host only; still against the TCP ceiling) "
        f"(default tcp; for the sweep {','.join(sweep.PLANES)})",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address the shard, the engines and the ceiling use (default %(default)s)"
    )
    parser.add_argument(
        "--sweep-mb", type=float, default=sweep.TOTAL_BYTES / MiB, help="MiB each size of the sweep moves (default %(default)s)"
    )
    add_ceiling_arguments(parser, conns_help="producer connections to the shard, the ceiling's too")
    add_output_arguments(
        parser,
        plot=True,
        plot_help="run the sweep (--sweep) and draw it: throughput and latency against item size, with the "
        "ceilings; a directory gets bench-throughput.png and bench-latency.png, a FILE.png that name and "
        "FILE-latency.png (needs matplotlib)",
    )


def main(args: argparse.Namespace) -> int:
    from . import sweep

    if args.sweep or args.plot:
        try:
            sizes = sweep.parse_sizes(args.sizes)
            planes = [p.strip() for p in (args.planes or ",".join(sweep.PLANES)).split(",") if p.strip()]
        except ValueError as exc:
            print(f"ecmooncake bench: {exc}", file=sys.stderr)
            return 2
        return report(
            "bench",
            lambda: sweep.run(
                sizes, planes, progress=not args.quiet, total_bytes=int(args.sweep_mb * MiB), **ceiling_settings(args)
            ),
            sweep.format_summary,
            args.json,
            plot_path=args.plot,
        )
    sizes = option_values(args, SIZE_OPTIONS)
    planes = tuple(p.strip() for p in (args.planes or "tcp").split(",") if p.strip())
    why = planes_error(planes)
    if why:
        print(f"ecmooncake bench: --planes {args.planes!r}: {why}", file=sys.stderr)
        return 2
    return report(
        "bench",
        lambda: run(**sizes, progress=not args.quiet, planes=planes, host=args.host, **ceiling_settings(args)),
        format_summary,
        args.json,
        plot_path=args.plot,
    )
