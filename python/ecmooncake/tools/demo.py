"""The end-to-end demo: a sharded consumer, a producer and a consumer
scheduler, each where vLLM would put it, moving synthetic encoder outputs over
loopback and checking every byte.

Layout: one spawned process per consumer shard (TP rank), one spawned producer
process, and the scheduler in this process. Items go in windows that fit the
shards' slabs; for each window the producer submits every push at once, the
scheduler waits until each item is available on every shard, and then (off the
clock) each shard acquires, verifies and releases each item.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass

import numpy as np

from . import ceiling as ceilings
from ..native import Scheduler, configure
from . import harness
from .cli import add_options, option_values
from .harness import Worker, await_available, percentile
from .report import GB, MiB, add_ceiling_arguments, add_output_arguments, ceiling_settings, report, summary_text


@dataclass
class Item:
    index: int
    transfer_id: str
    mm_hash: str
    nbytes: int
    seed: int
    duplicate_of: int | None = None

    def wire(self) -> dict:
        return {
            "transfer_id": self.transfer_id,
            "mm_hash": self.mm_hash,
            "nbytes": self.nbytes,
            "seed": self.seed,
        }


def plan_items(count: int, min_bytes: int, max_bytes: int, dup_ratio: float, seed: int) -> list[Item]:
    """Synthetic encoder outputs; dup_ratio of them (rounded) repeat an earlier
    item's content (same mm_hash, size and bytes) under a new transfer_id."""
    rng = np.random.default_rng(seed)
    n_dups = min(max(count - 1, 0), round(dup_ratio * count))
    dup_at = set(rng.choice(np.arange(1, count), size=n_dups, replace=False).tolist()) if n_dups else set()
    items: list[Item] = []
    for i in range(count):
        transfer_id = f"demo-{seed}-{i}"
        if i in dup_at:
            original = items[int(rng.integers(0, len(items)))]
            while original.duplicate_of is not None:
                original = items[original.duplicate_of]
            items.append(
                Item(i, transfer_id, original.mm_hash, original.nbytes, original.seed, original.index)
            )
            continue
        item_seed = int(rng.integers(1, 2**62))
        nbytes = int(rng.integers(min_bytes, max_bytes + 1))
        mm_hash = hashlib.sha256(f"{seed}:{i}:{item_seed}:{nbytes}".encode()).hexdigest()
        items.append(Item(i, transfer_id, mm_hash, nbytes, item_seed))
    return items


def windows(items: list[Item], budget: int) -> list[list[Item]]:
    """Consecutive groups whose new bytes fit in budget (at least one item)."""
    groups: list[list[Item]] = []
    current: list[Item] = []
    hashes: set[str] = set()
    used = 0
    for item in items:
        extra = 0 if item.mm_hash in hashes else item.nbytes
        if current and used + extra > budget:
            groups.append(current)
            current, hashes, used = [], set(), 0
            extra = item.nbytes
        current.append(item)
        hashes.add(item.mm_hash)
        used += extra
    if current:
        groups.append(current)
    return groups


class Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.total = total
        self.enabled = enabled

    def update(self, done: int, nbytes: int, verified: int, failed: int) -> None:
        if self.enabled:
            print(
                f"demo: {done}/{self.total} items, {nbytes / MiB:.0f} MiB, "
                f"verified {verified}, failed {failed}",
                file=sys.stderr,
                flush=True,
            )


def run(
    items: int = 48,
    min_mb: float = 1.0,
    max_mb: float = 64.0,
    dup_ratio: float = 0.15,
    seed: int = 1,
    tp_size: int = 2,
    slab_mb: float | None = None,
    timeout_s: float | None = None,
    progress: bool = True,
    gomaxprocs: int = 2,
    tcp_conns: int = 4,
    ceiling_bytes: int = ceilings.GiB,
) -> dict:
    """Runs the demo and returns its summary (see :func:`format_summary`).

    Its ceiling is the same layout without ecmooncake: one sender and a
    receiver process per shard, GOMAXPROCS as the workers, tcp_conns
    connections to each receiver, sampled before and after the transfer."""
    min_bytes = max(1, int(min_mb * MiB))
    max_bytes = max(min_bytes, int(max_mb * MiB))
    slab_bytes = int(slab_mb * MiB) if slab_mb else min(max(8 * max_bytes, 64 * MiB), 512 * MiB)
    if slab_bytes < 2 * max_bytes:
        raise ValueError(f"slab of {slab_bytes} bytes cannot hold two {max_bytes}-byte items")
    plan = plan_items(items, min_bytes, max_bytes, dup_ratio, seed)
    groups = windows(plan, slab_bytes // 2)

    ip = "127.0.0.1"
    port = harness.free_port_range(tp_size, ip)
    consumer_address = f"tcp://{ip}:{port}"
    settings = {"log_level": "warn", "gomaxprocs": gomaxprocs}
    tcp = ceilings.TCPCeiling(gomaxprocs, tp_size * tcp_conns, receivers=tp_size, nbytes=ceiling_bytes)
    workers: list[Worker] = []
    try:
        for rank in range(tp_size):
            config = {
                "ec_ip": ip,
                "ec_port": port,
                "tp_rank": rank,
                "tp_size": tp_size,
                "dp_rank": 0,
                "transport": "tcp",
                "lease_s": 300,
            }
            workers.append(
                Worker("consumer", f"consumer-{rank}", config=config, slab_bytes=slab_bytes, settings=settings)
            )
        producer = Worker(
            "producer",
            "producer",
            config={"transport": "tcp", "tcp_conns": tcp_conns, "control_timeout_s": 30, "push_wait_timeout_s": 60},
            settings=settings,
        )
        workers.append(producer)
        shards = workers[:tp_size]
        for worker in workers:
            worker.wait_ready(120)

        configure(**settings)
        tcp.measure(ceilings.BEFORE)
        scheduler_config = {
            "ec_ip": ip,
            "ec_port": port,
            "tp_size": tp_size,
            "dp_rank": 0,
            "push_wait_timeout_s": 60,
            "load_timeout_s": 30,
        }
        with Scheduler(scheduler_config) as scheduler:
            result = _drive(plan, groups, scheduler, shards, producer, consumer_address, timeout_s, progress)
            result["producer_stats"] = producer.call("stats", 30)
        tcp.measure(ceilings.AFTER)
    finally:
        harness.stop_all(workers)

    return _summarize(plan, result, tcp.book, tp_size)


def _drive(plan, groups, scheduler, shards, producer, consumer_address, timeout_s, progress_on) -> dict:
    """Moves each window and then, off the clock, plays the engine's part:
    load each available hash, verify it on every shard, report it loaded,
    free it (it stays resident on the shards) and finish the requests."""
    progress = Progress(len(plan), progress_on)
    latencies: dict[int, float] = {}
    failed: dict[int, str] = {}
    verified: set[int] = set()
    mismatched: dict[int, str] = {}
    transfer_seconds = 0.0
    done = 0
    done_bytes = 0
    for group in groups:
        by_tid = {item.transfer_id: item for item in group}
        new_bytes = sum({it.mm_hash: it.nbytes for it in group}.values())
        deadline_s = timeout_s or (30.0 + new_bytes / (50 * MiB))
        expected = scheduler.step(
            {
                "expect": [
                    {"request_id": _request(it), "items": [{"transfer_id": it.transfer_id, "mm_hash": it.mm_hash}]}
                    for it in group
                ]
            }
        )
        for it in group:
            reason = (expected.get("expect_errors") or {}).get(_request(it))
            if reason:
                failed[it.index] = f"scheduler refused the request: {reason}"
        producer.send("push", items=[it.wire() for it in group], consumer=consumer_address, timeout_s=deadline_s)
        accepted = [it.transfer_id for it in group if it.index not in failed]
        available, unavailable = await_available(scheduler, accepted, deadline_s + 5)
        pushed = producer.result(deadline_s + 30)

        t_submit = pushed["t_submit"]
        for tid, reason in list(pushed["failed"].items()) + [(t, "push timed out") for t in pushed["timed_out"]]:
            failed.setdefault(by_tid[tid].index, f"producer: {reason}")
        for tid, reason in unavailable.items():
            failed.setdefault(by_tid[tid].index, f"scheduler: {reason}")
        for tid, t_avail in available.items():
            latencies[by_tid[tid].index] = t_avail - t_submit
        if available:
            transfer_seconds += max(available.values()) - t_submit

        ready = [it for it in group if it.index not in failed]
        hashes = list(dict.fromkeys(it.mm_hash for it in ready))
        loads = scheduler.step({"load": hashes}).get("load") or []
        loading = {lo["mm_hash"]: lo["transfer_id"] for lo in loads if not lo.get("error")}
        for lo in loads:
            if lo.get("error"):
                for it in ready:
                    if it.mm_hash == lo["mm_hash"]:
                        failed.setdefault(it.index, f"scheduler load: {lo['error']}")
        to_check = [it for it in ready if it.mm_hash in loading]
        for shard in shards:
            shard.send("verify", items=[it.wire() for it in to_check])
        results = [shard.result(60 + sum(it.nbytes for it in to_check) / (20 * MiB)) for shard in shards]
        bad_hashes = set()
        for position, item in enumerate(to_check):
            errors = [f"{shard.name}: {r[position]['error']}" for shard, r in zip(shards, results) if not r[position]["ok"]]
            if errors:
                mismatched[item.index] = "; ".join(errors)
                bad_hashes.add(item.mm_hash)
            else:
                verified.add(item.index)
        scheduler.step(
            {
                "loaded": [
                    {"transfer_id": tid, "ok": h not in bad_hashes, "reason": "bytes differ" if h in bad_hashes else ""}
                    for h, tid in loading.items()
                ],
                "freed": list(loading),
                "finished": [_request(it) for it in group],
            }
        )

        done += len(group)
        done_bytes += sum(it.nbytes for it in group)
        progress.update(done, done_bytes, len(verified), len(failed) + len(mismatched))
    return {
        "latencies": latencies,
        "failed": failed,
        "verified": verified,
        "mismatched": mismatched,
        "transfer_seconds": transfer_seconds,
    }


def _request(item: Item) -> str:
    # One request per item, as if each image came in its own chat request.
    return f"req-{item.transfer_id}"


def _summarize(plan: list[Item], result: dict, ceiling: ceilings.Ceiling, tp_size: int) -> dict:
    seconds = result["transfer_seconds"]
    latencies_ms = [v * 1e3 for v in result["latencies"].values()]
    payload_bytes = sum(it.nbytes for it in plan)
    unique_bytes = sum(it.nbytes for it in plan if it.duplicate_of is None)
    delivered = payload_bytes * tp_size
    wire = unique_bytes * tp_size
    rate = (lambda n: n / seconds) if seconds > 0 else (lambda n: 0.0)
    failures = {str(i): reason for i, reason in sorted(result["failed"].items())}
    failures.update({str(i): reason for i, reason in sorted(result["mismatched"].items())})
    ok = not result["failed"] and not result["mismatched"] and len(result["verified"]) == len(plan)
    summary = {
        "ok": ok,
        "items": len(plan),
        "duplicates": sum(1 for it in plan if it.duplicate_of is not None),
        "shards": tp_size,
        "transport": "tcp",
        "bytes": payload_bytes,
        "unique_bytes": unique_bytes,
        "seconds": seconds,
        "items_per_s": rate(len(plan)),
        "gb_per_s": rate(delivered) / GB,
        "wire_gb_per_s": rate(wire) / GB,
        "latency_ms": {"p50": percentile(latencies_ms, 50), "p99": percentile(latencies_ms, 99)},
        "verified": len(result["verified"]),
        "failed": len(result["failed"]),
        "mismatched": len(result["mismatched"]),
        "failures": failures,
        "ceiling": ceiling.as_dict(),
        "ceiling_ratio": ceiling.ratio(rate(wire)),
        "best_ceiling_ratio": ceiling.ratio(rate(wire), ceiling.best()[0]),
        "producer_stats": result.get("producer_stats"),
    }
    return ceilings.mark(summary, {"wire throughput": summary["ceiling_ratio"]})


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} ms"


def format_summary(s: dict) -> str:
    lat = s["latency_ms"]
    ceiling = s["ceiling"]
    lines = [
        f"ecmooncake demo: {s['items']} items ({s['duplicates']} repeat an earlier mm_hash), "
        f"{s['shards']} consumer shards, {s['transport']} over loopback",
        f"  payload     {s['bytes'] / GB:.2f} GB per shard ({s['unique_bytes'] / GB:.2f} GB distinct)",
        f"  throughput  {s['items_per_s']:.1f} items/s, {s['wire_gb_per_s']:.2f} GB/s on the wire (each distinct "
        f"item to every shard), {s['gb_per_s']:.2f} GB/s served, in {s['seconds']:.2f} s of transfer",
        f"  latency     p50 {_ms(lat['p50'])}, p99 {_ms(lat['p99'])} (submit to available on every shard)",
        f"  verified    {s['verified']}/{s['items']} items, every byte on every shard "
        f"({s['failed']} failed, {s['mismatched']} mismatched)",
        f"  ceiling     {ceiling['text']}",
        f"              the wire throughput is {s['ceiling_ratio']:.2f} of it ({s['best_ceiling_ratio']:.2f} of its best)",
    ]
    for index, reason in s["failures"].items():
        lines.append(f"  item {index}: {reason}")
    return summary_text(s, lines, result_at=14)


# The items of the run: options, and run()'s keywords (with --slab-mb).
ITEM_OPTIONS = (
    ("--items", 48, "number of items"), ("--min-mb", 1.0, "smallest item, MiB"), ("--max-mb", 64.0, "largest item, MiB"),
    ("--dup-ratio", 0.15, "share of items that repeat an earlier item's mm_hash"), ("--seed", 1, "seed of sizes and contents"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, *ITEM_OPTIONS)
    parser.add_argument("--slab-mb", type=float, default=None, help="receive slab per shard, MiB (default: sized from --max-mb)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed per window of items (default: from its size)")
    add_ceiling_arguments(parser, conns_help="producer connections to each shard, the ceiling's too")
    add_output_arguments(parser, plot=False)


def main(args: argparse.Namespace) -> int:
    sizes = option_values(args, ITEM_OPTIONS) | {"slab_mb": args.slab_mb}
    return report(
        "demo",
        lambda: run(**sizes, timeout_s=args.timeout, progress=not args.quiet, **ceiling_settings(args)),
        format_summary,
        args.json,
    )
