"""One timed phase of the transfer benchmarks (bench and its sweep): a
warm-up batch, then timed batches of distinct items, each from its submit
until the producer saw every push done. Apart from both so that neither
imports the other.
"""

from __future__ import annotations

from .. import trace
from . import harness
from .harness import Worker
from .report import MiB


def _numeric_deltas(before: dict, after: dict, prefix: str = "") -> dict[str, float]:
    deltas: dict[str, float] = {}
    for key, value in after.items():
        name = f"{prefix}{key}"
        old = before.get(key) if isinstance(before, dict) else None
        if isinstance(value, dict):
            deltas.update(_numeric_deltas(old if isinstance(old, dict) else {}, value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            deltas[name] = value - (old if isinstance(old, (int, float)) else 0)
    return deltas


def run_phase(
    consumer: Worker,
    producer: Worker,
    address: str,
    name: str,
    nbytes: int,
    batch: int,
    batches: int,
) -> dict:
    """Runs one warm-up batch, then `batches` timed ones."""
    seconds = 0.0
    failures: list[str] = []
    # Each item's time from its batch's submit until the producer saw its
    # push done: with batches of one, an item's latency.
    latencies: list[float] = []
    stats_before = None
    timed: list[str] = []
    for b in range(-1, batches):
        if b == 0:
            stats_before = producer.call("stats", 30)
            # The warm-up's stamps are not the timed items'.
            for worker in (producer, consumer):
                worker.call("trace", 30)
        items = [
            {"transfer_id": f"bench-{name}-{b}-{i}", "mm_hash": f"bench-{name}-{b}-{i}", "nbytes": nbytes}
            for i in range(batch)
        ]
        timeout = 30 + batch * nbytes / (50 * MiB)
        out = producer.call("push", timeout + 30, items=items, consumer=address, timeout_s=timeout, fill="zeros")
        if b >= 0:
            timed += [it["mm_hash"] for it in items]
            seconds += out["t_done"] - out["t_submit"]
            latencies += [(t - out["t_submit"]) * 1e6 for t in out["done"].values()]
            failures += [f"{tid}: {why}" for tid, why in out["failed"].items()]
            failures += [f"{tid}: timed out" for tid in out["timed_out"]]
        consumer.call("drain", 60, mm_hashes=[it["mm_hash"] for it in items])
    deltas = _numeric_deltas(stats_before or {}, producer.call("stats", 30))
    rings = [worker.call("trace", 30) for worker in (producer, consumer)]
    trips = deltas.get("control_round_trips")
    count = batch * batches
    return {
        "item_bytes": nbytes,
        "batch": batch,
        "batches": batches,
        "seconds": seconds,
        "bytes_per_sec": count * nbytes / seconds if seconds > 0 else 0.0,
        "us_per_item": seconds / count * 1e6 if count else 0.0,
        "round_trips_per_batch": trips / batches if trips is not None and batches else None,
        "latency_us": {
            "samples": len(latencies),
            "p50": harness.percentile(latencies, 50),
            "p99": harness.percentile(latencies, 99),
        },
        "producer_stat_deltas": deltas,
        # Per hop of the timed items' path (ecmooncake.trace), when the
        # workers trace: the producer's and the shard's stamps together.
        "trace": {
            **trace.table([s for r in rings for s in r["stamps"]], timed),
            "dropped": sum(r["dropped"] for r in rings),
        },
        "failures": failures,
    }
