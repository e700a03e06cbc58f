"""Two GPUs of one host: a consumer sharded over both (TP=2, one shard per
GPU) receiving the same items from one producer on cuda:0.

Skips unless two CUDA devices are present. The single-consumer pairs
(cuda:0 -> cuda:0 and cuda:0 -> cuda:1) are in test_gpu_transfer.py; this
file adds what only a sharded consumer shows: an item is available to the
consumer's scheduler only when both shards hold it.
"""

from __future__ import annotations

import zlib

import pytest

from ecmooncake import Scheduler
from ecmooncake.tools import harness

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

MiB = 1 << 20
SETTINGS = {"log_level": "warn"}
SLAB = 1024 * MiB


def _item(tag, i, mib, mm_hash=None):
    return {
        "transfer_id": f"{tag}-t{i}",
        "mm_hash": mm_hash or f"{tag}-h{i}",
        "nbytes": int(mib * MiB) // 2 * 2,
        "seed": zlib.crc32(f"{tag}/{i}".encode()) % 100000,
    }


def _sharded(workers, plane):
    ip = "127.0.0.1"
    port = harness.free_port_range(2, ip)
    shards = [
        workers(
            "gpu_consumer", f"shard-{r}",
            config={"ec_ip": ip, "ec_port": port, "tp_rank": r, "tp_size": 2, "dp_rank": 0, "transport": "tcp"},
            slab_bytes=SLAB, device=f"cuda:{r}", settings=SETTINGS,
        )
        for r in range(2)
    ]
    routing = {} if plane == "cuda_ipc" else {"local_transport": "none"}
    producer = workers("gpu_producer", "producer", config=routing, device="cuda:0", settings=SETTINGS)
    for w in [*shards, producer]:
        w.wait_ready(180)
    sched = Scheduler({"ec_ip": ip, "ec_port": port, "tp_size": 2, "push_wait_timeout_s": 20})
    return shards, producer, sched, f"tcp://{ip}:{port}"


def _expect(sched, request, items):
    out = sched.step({"expect": [{"request_id": request, "items": [
        {"transfer_id": it["transfer_id"], "mm_hash": it["mm_hash"]} for it in items]}]})
    assert not out.get("expect_errors"), out


@pytest.mark.parametrize("plane", ["cuda_ipc", "tcp"])
def test_sharded_consumer_on_two_gpus(library, workers, plane):
    shards, producer, sched, address = _sharded(workers, plane)
    try:
        items = [_item("s", i, mib) for i, mib in enumerate([1, 19, 67, 128, 4])]
        items.append({**items[1], "transfer_id": "s-t1-again"})
        _expect(sched, "req", items)
        result = producer.call("push", 300, items=items, consumer=address, timeout_s=120)
        assert not result["failed"], result["failed"]
        assert not result["timed_out"], result["timed_out"]
        got = sched.wait([it["transfer_id"] for it in items], timeout_ms=60_000)
        assert sorted(got["available"]) == sorted(it["transfer_id"] for it in items), got
        unique = list({it["mm_hash"]: it for it in items}.values())
        for shard in shards:
            bad = [r for r in shard.call("verify", 300, items=unique) if not r["ok"]]
            assert not bad, bad
            # Frames for TCP; producers attached for cuda_ipc, whose
            # one-sided writes never pass through the receiver.
            planes = shard.call("stats", 30).get("data_planes") or {}
            frames = {k: v.get("Frames", 0) or v.get("Attached", 0) for k, v in planes.items()}
            assert frames.get(plane, 0) > 0, f"{plane} carried nothing to this shard: {frames}"
    finally:
        sched.close()


def test_item_is_not_available_until_both_shards_hold_it(library, workers):
    shards, producer, sched, address = _sharded(workers, "cuda_ipc")
    try:
        first = [_item("both", 0, 32)]
        _expect(sched, "req-1", first)
        assert not producer.call("push", 300, items=first, consumer=address, timeout_s=60)["failed"]
        assert sched.wait(["both-t0"], timeout_ms=60_000)["available"] == ["both-t0"]

        # Shard 1 goes away: the next item lands on shard 0 only, and the
        # scheduler must not call it available.
        shards[1].kill()
        lone = [_item("lone", 0, 32)]
        _expect(sched, "req-2", lone)
        pushed = producer.call("push", 300, items=lone, consumer=address, timeout_s=20)
        assert pushed["failed"] or pushed["timed_out"], pushed
        got = sched.wait(["lone-t0"], timeout_ms=60_000)
        assert not got["available"], got
        assert got["failed"] == ["lone-t0"], got
        assert not sched.has(lone[0]["mm_hash"])
    finally:
        sched.close()
