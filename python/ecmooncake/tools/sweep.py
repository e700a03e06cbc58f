"""``bench --sweep`` (and ``bench --plot``): throughput and latency against
item size, from 64 KiB to 256 MiB, for every data plane that runs on this
host, each beside its ceiling measured in the same run.

For each plane one consumer shard and one producer run in spawned processes,
as in :mod:`ecmooncake.tools.bench`, and for each size:

- a throughput phase: batches of distinct items, sized by :func:`plan` so
  that every size moves about the same bytes (the small sizes in batches of
  up to 256 items, the large ones a few items a batch);
- a latency phase: single-item pushes, each timed from its submit until the
  producer saw it done; p50 and p99 over the repetitions of :func:`plan`.

Ceilings, each sampled before and after what it bounds (the TCP ceiling
around the plane's phases, a copy ceiling around its size's) with the
workers' parallelism: for ``tcp`` the TCP data plane alone
(:class:`ceiling.TCPCeiling`, bulk transfers: one value for every size,
an upper bound for small items too, since smaller frames only cost more);
for ``shm`` the plane's own copy of the same batch in a process with the
workers' GOMAXPROCS (:class:`ceiling.HostCopyCeiling`), one per size. A ratio above
:data:`ceiling.RATIO_LIMIT` flags the summary (the ceiling was not one).

``mooncake`` is listed with the reason it was not measured: its data plane
needs a metadata server and a Mooncake engine per process, which this
sweep does not start yet.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import time
from dataclasses import dataclass

from . import ceiling as ceilings
from . import harness
from .phase import run_phase as _phase
from .harness import Worker
from .report import GB, KiB, MiB

SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 32 * MiB, 64 * MiB, 256 * MiB)
PLANES = ("tcp", "shm")
# What every size of the throughput phase moves, about, and at most per batch.
TOTAL_BYTES = 256 * MiB
BATCH_BYTES = 64 * MiB
MAX_BATCH = 256
MIN_BATCHES = 3
# Bytes of single-item pushes per size in the latency phase, within these
# repetition counts.
LATENCY_BYTES = 256 * MiB
MIN_REPS, MAX_REPS = 4, 32


@dataclass(frozen=True)
class Step:
    """One size of the sweep: its throughput batches and latency repetitions."""

    item_bytes: int
    batch: int
    batches: int
    reps: int

    @property
    def batch_bytes(self) -> int:
        return self.item_bytes * self.batch


def plan(sizes: tuple[int, ...] | list[int] = SIZES, total_bytes: int = TOTAL_BYTES) -> list[Step]:
    """The steps of a sweep over sizes, smallest first: each moves about
    total_bytes in its throughput phase (at least MIN_BATCHES batches of up
    to BATCH_BYTES and MAX_BATCH items) and LATENCY_BYTES in its latency
    phase (MIN_REPS..MAX_REPS single items)."""
    steps = []
    for n in sorted(set(sizes)):
        if n < 1:
            raise ValueError(f"item size {n} is not positive")
        batch = max(1, min(MAX_BATCH, BATCH_BYTES // n))
        batches = max(MIN_BATCHES, -(-total_bytes // (batch * n)))
        reps = max(MIN_REPS, min(MAX_REPS, LATENCY_BYTES // n))
        steps.append(Step(n, batch, batches, reps))
    return steps


def parse_sizes(text: str) -> list[int]:
    """'64K,1M,256M' -> bytes (K, M, G are powers of 1024)."""
    scale = {"K": KiB, "M": MiB, "G": 1 << 30}
    sizes = []
    for part in filter(None, (p.strip().upper().removesuffix("IB").removesuffix("B") for p in text.split(","))):
        unit = scale.get(part[-1], 1)
        number = part[:-1] if part[-1] in scale else part
        try:
            value = float(number)
        except ValueError:
            raise ValueError(f"item size {part!r}: want a number with K, M or G, as 64K or 256M") from None
        if value <= 0:
            raise ValueError(f"item size {part!r} is not positive")
        sizes.append(int(value * unit))
    if not sizes:
        raise ValueError("no item sizes given")
    return sizes


def unmeasured() -> dict[str, str]:
    """The data planes of this build the sweep does not measure, and why."""
    if importlib.util.find_spec("mooncake") is None:
        return {"mooncake": "no Mooncake wheel importable here"}
    return {"mooncake": "the wheel is importable, but the sweep does not start a metadata server and Mooncake engines yet"}


def _workers(plane: str, slab_bytes: int, settings: dict, tcp_conns: int) -> tuple[Worker, Worker, str]:
    ip = "127.0.0.1"
    port = harness.free_port_range(1, ip)
    shard = {"ec_ip": ip, "ec_port": port, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "transport": plane}
    consumer = Worker("consumer", f"consumer-{plane}", config=shard, slab_bytes=slab_bytes, settings=settings)
    producer = Worker("producer", f"producer-{plane}", config={"transport": plane, "tcp_conns": tcp_conns}, settings=settings)
    return consumer, producer, f"tcp://{ip}:{port}"


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"bench sweep: {text}", file=sys.stderr, flush=True)


def _measure_plane(plane: str, steps: list[Step], gomaxprocs: int, tcp_conns: int, ceiling_bytes: int, progress: bool) -> dict:
    slab_bytes = 2 * max(s.batch_bytes for s in steps) + 64 * MiB
    settings = {"log_level": "warn", "gomaxprocs": gomaxprocs}
    # The TCP ceiling (a GiB a sample) is sampled around the whole plane;
    # the copy ceilings (cheap) around their own size, so that load that
    # comes and goes between sizes cannot put a size above its ceiling.
    around_plane, around_step = [], {}
    if plane == "tcp":
        tcp = ceilings.TCPCeiling(gomaxprocs, tcp_conns, receivers=1, nbytes=ceiling_bytes)
        books = {s.item_bytes: tcp.book for s in steps}
        around_plane = [tcp.measure]
    else:
        copies = {s.item_bytes: ceilings.HostCopyCeiling(s.item_bytes, s.batch, gomaxprocs) for s in steps}
        books = {n: c.book for n, c in copies.items()}
        around_step = {n: c.measure for n, c in copies.items()}
    consumer, producer, address = _workers(plane, slab_bytes, settings, tcp_conns)
    points = []
    try:
        for worker in (consumer, producer):
            worker.wait_ready(120)
        _say(progress, f"{plane}: measuring the ceiling")
        for measure in around_plane:
            measure(ceilings.BEFORE)
        for s in steps:
            label = ceilings.size_text(s.item_bytes)
            _say(progress, f"{plane}: {s.batches} batches of {s.batch} x {label}, then {s.reps} single items")
            if s.item_bytes in around_step:
                around_step[s.item_bytes](ceilings.BEFORE)
            phase = _phase(consumer, producer, address, f"{plane}-{s.item_bytes}", s.item_bytes, s.batch, s.batches)
            single = _phase(consumer, producer, address, f"{plane}-{s.item_bytes}-1", s.item_bytes, 1, s.reps)
            if s.item_bytes in around_step:
                around_step[s.item_bytes](ceilings.AFTER)
            phase["latency_us"] = single["latency_us"]
            phase["failures"] += single["failures"]
            del phase["producer_stat_deltas"]
            points.append(phase)
        _say(progress, f"{plane}: measuring the ceiling again")
        for measure in around_plane:
            measure(ceilings.AFTER)
    finally:
        harness.stop_all([consumer, producer])
    for p in points:
        p["ceiling"] = books[p["item_bytes"]].as_dict()
    shared = plane == "tcp"
    return {
        "ceiling_name": books[steps[0].item_bytes].name,
        # tcp: one bulk ceiling for every size; shm: one per size.
        "ceiling_per_size": not shared,
        "points": points,
    }


def finish(summary: dict) -> dict:
    """Fills each point's GB/s and ceiling ratio and flags the summary when
    a ratio is above the limit (a ceiling that was not one)."""
    ratios = {}
    for plane, body in summary["planes"].items():
        for p in body["points"]:
            cap = p["ceiling"]["gb_per_s"] * GB
            p["gb_per_s"] = p["bytes_per_sec"] / GB
            p["ceiling_gb_per_s"] = cap / GB
            p["ceiling_ratio"] = p["bytes_per_sec"] / cap if cap > 0 else 0.0
            ratios[f"{plane} {ceilings.size_text(p['item_bytes'])} items"] = p["ceiling_ratio"]
    summary["ok"] = not any(p["failures"] for body in summary["planes"].values() for p in body["points"])
    return ceilings.mark(summary, ratios)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run(
    sizes: tuple[int, ...] | list[int] = SIZES,
    planes: tuple[str, ...] | list[str] = PLANES,
    progress: bool = True,
    gomaxprocs: int = 2,
    tcp_conns: int = 4,
    ceiling_bytes: int = ceilings.GiB,
    total_bytes: int = TOTAL_BYTES,
) -> dict:
    unknown = sorted(set(planes) - set(PLANES))
    if unknown:
        raise ValueError(f"the sweep measures {', '.join(PLANES)}; not {', '.join(unknown)}")
    steps = plan(sizes, total_bytes)
    started = time.time()
    load_before = os.getloadavg()
    summary = {
        "sweep": True,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "host": f"{_cpu_name()}, {os.cpu_count()} CPUs",
        "gomaxprocs": gomaxprocs,
        "tcp_conns": tcp_conns,
        "steps": [vars(s) | {"batch_bytes": s.batch_bytes} for s in steps],
        "planes": {p: _measure_plane(p, steps, gomaxprocs, tcp_conns, ceiling_bytes, progress) for p in planes},
        "unmeasured": unmeasured(),
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "seconds": time.time() - started,
    }
    return finish(summary)


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def format_summary(s: dict) -> str:
    from .report import summary_text

    load = s["load_average"]
    lines = [
        f"ecmooncake bench sweep: host memory, one consumer shard over loopback, {s['host']}, {s['date']} "
        f"(GOMAXPROCS {s['gomaxprocs']} per process, {s['tcp_conns']} TCP connections; load average "
        f"{load['before'][0]:.1f} before, {load['after'][0]:.1f} after; {s['seconds']:.0f} s)",
        "  plane  item        batch x n   GB/s   ceiling GB/s  ratio  latency p50 us  p99 us (of n)",
    ]
    for plane, body in s["planes"].items():
        for p in body["points"]:
            lat = p["latency_us"]
            lines.append(
                f"  {plane:<6} {ceilings.size_text(p['item_bytes']):>8} {p['batch']:>6} x {p['batches']:<4}"
                f"{p['gb_per_s']:>7.3f} {p['ceiling_gb_per_s']:>11.2f} {p['ceiling_ratio']:>7.2f}"
                f" {_us(lat['p50']):>14} {_us(lat['p99']):>8} ({lat['samples']})"
            )
            lines += [f"  failed: {f}" for f in p["failures"]]
        ceiling = body["points"][0]["ceiling"] if body["points"] else None
        if ceiling:
            per = "one per size, e.g. " if body["ceiling_per_size"] else ""
            lines.append(f"  {plane} ceiling: {per}{ceiling['text']}")
    lines += [f"  not measured: {plane}: {why}" for plane, why in s.get("unmeasured", {}).items()]
    return summary_text(s, lines, result_at=17)
