"""Readiness events on the 2-core machine: batches of 8 items over a host
data plane (shm by default), from a producer process to a consumer shard
process, with the scheduler in this process, as gpubench's serial phases
run them on a GPU host, with the CPU workers of bench. Prints the
ready path's phases as the library times them, event_delivery (the
shard's readiness event to the scheduler, mean per item) among them, and
the time from submit until every item is available at the scheduler.

    PYTHONPATH=python ECMOONCAKE_LIBRARY=python/ecmooncake/libecmooncake.so \\
        python3 build/bench_events.py --plane shm --mib 4 --batch 8 --rounds 32
"""

from __future__ import annotations

import argparse
import json
import sys

from ecmooncake.native import Scheduler, configure
from ecmooncake.tools import harness
from ecmooncake.tools.gpubench import _expect, _finish, _phase_means, _phase_totals
from ecmooncake.tools.harness import Worker, await_available
from ecmooncake.tools.report import MiB


def phase(sched: Scheduler, consumer: Worker, producer: Worker, address: str, name: str, nbytes: int, batch: int,
          rounds: int, spin: bool = True) -> dict:
    """One warm-up batch, then `rounds` timed ones, one at a time, each
    from its submit until the scheduler has every item available."""
    seconds, failures, totals = 0.0, [], {}
    for r in range(-1, rounds):
        if r == 0:
            totals = _phase_totals(producer, sched)
        items = [{"transfer_id": f"{name}-{r}-{i}", "mm_hash": f"{name}-{r}-{i}", "nbytes": nbytes} for i in range(batch)]
        tids = [it["transfer_id"] for it in items]
        _expect(sched, tids)
        timeout = 30 + batch * nbytes / (50 * MiB)
        producer.send("push", items=items, consumer=address, timeout_s=timeout, fill="zeros")
        available, unavailable = await_available(sched, tids, timeout + 5, spin=spin)
        pushed = producer.result(timeout + 30)
        if r >= 0:
            if available:
                seconds += max(available.values()) - pushed["t_submit"]
            failures += [f"{t}: {why}" for t, why in pushed["failed"].items()]
            failures += [f"{t}: {why}" for t, why in unavailable.items()]
        _finish(sched, consumer, tids, available)
    return {"us_per_batch": seconds / rounds * 1e6, "ready_path_us": _phase_means(totals, _phase_totals(producer, sched)),
            "failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plane", default="shm", help="host data plane: shm or tcp (default shm)")
    ap.add_argument("--mib", type=int, default=4, help="item size, MiB (default 4)")
    ap.add_argument("--batch", type=int, default=8, help="items per batch (default 8)")
    ap.add_argument("--rounds", type=int, default=32, help="timed batches, one at a time (default 32)")
    ap.add_argument("--gomaxprocs", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print the phase as JSON")
    ap.add_argument("--available-by", choices=("poll", "wait"), default="poll",
                    help="watch for availability as vLLM's engine loop does (poll, default) or blocked in the library's wait")
    a = ap.parse_args()
    settings = {"log_level": "warn", "gomaxprocs": a.gomaxprocs}
    ip = "127.0.0.1"
    port = harness.free_port_range(1, ip)
    shard = {"ec_ip": ip, "ec_port": port, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "transport": a.plane}
    slab = 4 * a.mib * a.batch * MiB + 64 * MiB
    consumer = Worker("consumer", f"consumer-{a.plane}", config=shard, slab_bytes=slab, settings=settings)
    producer = Worker("producer", f"producer-{a.plane}", config={"transport": a.plane}, settings=settings)
    try:
        for w in (consumer, producer):
            w.wait_ready(120)
        configure(**settings)
        with Scheduler({"ec_ip": ip, "ec_port": port, "tp_size": 1, "dp_rank": 0}) as sched:
            out = phase(sched, consumer, producer, f"tcp://{ip}:{port}", f"{a.plane}-{a.mib}m", a.mib * MiB, a.batch, a.rounds,
                        spin=a.available_by == "poll")
            out["events"] = sched.stats().get("events")
    finally:
        harness.stop_all([consumer, producer])
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{a.rounds} batches of {a.batch} x {a.mib} MiB over {a.plane}: "
              f"{out['us_per_batch']:.0f} us per batch from submit to available")
        for k, v in out["ready_path_us"].items():
            print(f"  {k:18s} {v['us']:9.1f} us  ({v['count']} samples)")
        ev = out["events"] or {}
        print(f"  events received {ev.get('Received')}, in messages {ev.get('Messages', '-')}")
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
