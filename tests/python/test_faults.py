"""Processes killed in the middle of a transfer: the survivor must report a
clear failure within its deadline, nothing may hang, and the surviving
consumer's slab must empty again."""

from __future__ import annotations

import pytest

from conftest import wait_until
from ecmooncake.tools.harness import free_port_range
from ecmooncake.native import Producer, Scheduler

pytestmark = pytest.mark.usefixtures("library")

IP = "127.0.0.1"
MiB = 1 << 20
# Large enough that a write over loopback takes far longer than the few
# milliseconds between handing over the source and the kill.
BIG = 256 * MiB
SLAB = BIG + 64 * MiB
LEASE_S = 4


def consumer_config(port: int, rank: int, tp_size: int) -> dict:
    return {
        "ec_ip": IP,
        "ec_port": port,
        "tp_rank": rank,
        "tp_size": tp_size,
        "dp_rank": 0,
        "transport": "tcp",
        "lease_s": LEASE_S,
    }


def push(tid: str, mm_hash: str, port: int) -> dict:
    return {"transfer_id": tid, "mm_hash": mm_hash, "nbytes": BIG, "consumer": f"tcp://{IP}:{port}"}


def in_use(shard) -> int:
    return shard.call("stats", 10)["bytes_in_use"]


def test_consumer_killed_mid_write(workers):
    port = free_port_range(2, IP)
    shards = [
        workers("consumer", f"consumer-{rank}", config=consumer_config(port, rank, 2), slab_bytes=SLAB)
        for rank in range(2)
    ]
    producer = workers(
        "producer", "producer", config={"transport": "tcp", "control_timeout_s": 3, "push_wait_timeout_s": 10}
    )
    for worker in [*shards, producer]:
        worker.wait_ready(60)

    submitted = producer.call("submit", 30, pushes=[push("t-kill", "f" * 64, port)])
    assert not submitted[0].get("error"), submitted
    wait_until(lambda: all(in_use(s) >= BIG for s in shards), 20, what="reservations on both shards")
    producer.call("source", 30, mm_hash="f" * 64, nbytes=BIG, seed=3)
    shards[1].kill()

    outcome: dict[str, list] = {"done": [], "failed": [], "released": []}

    def settled():
        out = producer.call("poll", 10, timeout_ms=200)
        for key in outcome:
            outcome[key] += out.get(key) or []
        return outcome["failed"] or outcome["done"]

    wait_until(settled, 30, interval=0, what="the producer's verdict on the push")
    assert outcome["done"] == [], "a push cannot be done when a shard died before it was written"
    (failure,) = outcome["failed"]
    assert failure["transfer_id"] == "t-kill" and failure["reason"]
    # Polling is what lets the producer drop sources the library released.
    wait_until(lambda: settled() is not None and producer.call("held_sources", 10) == 0, 30, what="the source released")
    wait_until(lambda: in_use(shards[0]) == 0, LEASE_S + 20, what="the surviving shard's slab emptied")
    assert producer.alive and shards[0].alive


def test_producer_killed_mid_write(workers):
    port = free_port_range(1, IP)
    shard = workers("consumer", "consumer-0", config=consumer_config(port, 0, 1), slab_bytes=SLAB)
    producer = workers(
        "producer", "producer", config={"transport": "tcp", "control_timeout_s": 3, "push_wait_timeout_s": 10}
    )
    for worker in (shard, producer):
        worker.wait_ready(60)
    scheduler_config = {
        "ec_ip": IP,
        "ec_port": port,
        "tp_size": 1,
        "dp_rank": 0,
        "push_wait_timeout_s": 8,
        "load_timeout_s": 5,
    }
    with Scheduler(scheduler_config) as scheduler:
        out = scheduler.step({"expect": [{"request_id": "r", "items": [{"transfer_id": "t-orphan", "mm_hash": "e" * 64}]}]})
        assert not out.get("expect_errors"), out
        submitted = producer.call("submit", 30, pushes=[push("t-orphan", "e" * 64, port)])
        assert not submitted[0].get("error"), submitted
        wait_until(lambda: in_use(shard) >= BIG, 20, what="the reservation")
        producer.call("source", 30, mm_hash="e" * 64, nbytes=BIG, seed=4)
        producer.kill()

        verdict = scheduler.wait(["t-orphan"], 30_000)
        assert verdict["failed"] == ["t-orphan"], verdict
        assert scheduler.has("e" * 64) is False
        wait_until(lambda: in_use(shard) == 0, LEASE_S + 20, what="the slab emptied")
        (item,) = shard.call("acquire", 10, mm_hashes=["e" * 64])
        assert item["error"], "a half-written item must not be served"
    assert shard.alive


def test_push_to_a_silent_consumer_fails_in_time():
    port = free_port_range(1, IP)
    with Producer({"transport": "tcp", "control_timeout_s": 1, "push_wait_timeout_s": 3}) as producer:
        (item,) = producer.submit([{"transfer_id": "t-void", "mm_hash": "v" * 64, "nbytes": 4096, "consumer": f"tcp://{IP}:{port}"}])
        assert not item.get("error"), item
        failed = []

        def reported():
            failed.extend(producer.poll(200).get("failed") or [])
            return failed

        wait_until(reported, 15, interval=0, what="the failure of a push to nobody")
        assert failed[0]["transfer_id"] == "t-void" and failed[0]["reason"]


def test_a_killed_producers_grant_is_taken_over_by_the_same_transfer(workers):
    """An encoder killed after its reserve and before its write: the proxy
    sends the item, under the same transfer id, to a second encoder. The
    shard heard the first one's connection end, so the second push takes
    the dead grant over and lands bit-exact, long before the lease (five
    minutes here) would have ended the grant; before, it was refused
    in_progress and the request waited out its push deadline."""
    port = free_port_range(1, IP)
    shard = workers("consumer", "consumer-takeover", config={**consumer_config(port, 0, 1), "lease_s": 300}, slab_bytes=64 * MiB)
    producer_config = {"transport": "tcp", "control_timeout_s": 5, "push_wait_timeout_s": 30}
    first = workers("producer", "producer-killed", config=producer_config)
    second = workers("producer", "producer-second", config=producer_config)
    for worker in (shard, first, second):
        worker.wait_ready(60)
    it = {"transfer_id": "t-taken", "mm_hash": "d" * 64, "nbytes": 3 * MiB + 5, "seed": 9}
    scheduler_config = {"ec_ip": IP, "ec_port": port, "tp_size": 1, "dp_rank": 0, "push_wait_timeout_s": 30, "load_timeout_s": 5}
    with Scheduler(scheduler_config) as scheduler:
        out = scheduler.step({"expect": [{"request_id": "r", "items": [{"transfer_id": it["transfer_id"], "mm_hash": it["mm_hash"]}]}]})
        assert not out.get("expect_errors"), out
        submitted = first.call("submit", 30, pushes=[{**push(it["transfer_id"], it["mm_hash"], port), "nbytes": it["nbytes"]}])
        assert not submitted[0].get("error"), submitted
        wait_until(lambda: in_use(shard) >= it["nbytes"], 20, what="the first producer's reservation")
        first.kill()
        # The connection's end reaches the shard on its own goroutine.
        wait_until(lambda: shard.call("stats", 10)["table"]["Orphaned"] == 1, 20, what="the shard hearing the connection end")

        pushed = second.call("push", 90, items=[it], consumer=f"tcp://{IP}:{port}", timeout_s=60)
        assert pushed["failed"] == {} and list(pushed["done"]) == [it["transfer_id"]], pushed
        waited = scheduler.wait([it["transfer_id"]], 20_000)
        assert waited["available"] == [it["transfer_id"]], waited
        (verdict,) = shard.call("verify", 60, items=[it])
        assert verdict["ok"], verdict
        assert shard.call("stats", 10)["table"]["TakenOver"] == 1
