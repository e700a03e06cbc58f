"""GPU memory end to end: a producer process and a consumer process on GPUs,
through the package's public API (no vLLM), over each data plane in turn.

Runs on a host with a GPU, (cuda:0, cuda:0) always and (cuda:0, cuda:1)
where there are two; skips elsewhere. Every item is bf16 random data of an
encoder output's size, and every received byte is compared on the GPU with
what was sent.
"""

from __future__ import annotations

import zlib

import pytest

from ecmooncake.tools import harness

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here", allow_module_level=True)

MiB = 1 << 20
PAIRS = [("cuda:0", "cuda:0")] + ([("cuda:0", "cuda:1")] if torch.cuda.device_count() > 1 else [])
SETTINGS = {"log_level": "warn"}
SLAB = 1536 * MiB


def _start(workers, pair, plane, producers=1):
    """A consumer shard on pair[1] and producers on pair[0] that use `plane`."""
    producer_dev, consumer_dev = pair
    ip = "127.0.0.1"
    port = harness.free_port_range(1, ip)
    config = {"ec_ip": ip, "ec_port": port, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "transport": "tcp"}
    consumer = workers("gpu_consumer", "consumer", config=config, slab_bytes=SLAB, device=consumer_dev, settings=SETTINGS)
    routing = {} if plane == "cuda_ipc" else {"local_transport": "none"}
    prods = [
        workers("gpu_producer", f"producer-{i}", config=routing, device=producer_dev, settings=SETTINGS)
        for i in range(producers)
    ]
    for w in [consumer, *prods]:
        w.wait_ready(180)
    return consumer, prods, f"tcp://{ip}:{port}"


def _item(tag, i, mib, seed=None, mm_hash=None):
    return {
        "transfer_id": f"{tag}-t{i}",
        "mm_hash": mm_hash or f"{tag}-h{i}",
        "nbytes": int(mib * MiB) // 2 * 2,
        "seed": seed if seed is not None else zlib.crc32(f"{tag}/{i}".encode()) % 100000,
    }


def _check_pushed(result):
    assert not result["failed"], result["failed"]
    assert not result["timed_out"], result["timed_out"]
    assert result["held_sources"] == 0, "every source is released once its writes are done"


def _verify(consumer, items):
    unique = list({it["mm_hash"]: it for it in items}.values())
    results = consumer.call("verify", 300, items=unique)
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad
    return len(unique)


def _planes(consumer):
    """What each data plane carried: frames for TCP, producers attached for
    cuda_ipc (one-sided: its writes never pass through the receiver)."""
    planes = consumer.call("stats", 30).get("data_planes") or {}
    return {k: v.get("Frames", 0) or v.get("Attached", 0) for k, v in planes.items()}


@pytest.mark.parametrize("plane", ["cuda_ipc", "tcp"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_batches_duplicates_and_concurrent_pushes(library, workers, pair, plane):
    consumer, (a, b), address = _start(workers, pair, plane, producers=2)
    # Encoder-output sizes from 1 MiB to 128 MiB (Qwen2.5-VL-7B at 1080p is
    # about 19 MB, Qwen3-VL-8B about 67 MB); a repeats an mm_hash inside its
    # batch, and b pushes one of a's hashes at the same time.
    batch_a = [_item("a", 0, 1), _item("a", 1, 19), _item("a", 2, 67), _item("a", 3, 128), _item("a", 4, 4)]
    batch_a.append({**batch_a[1], "transfer_id": "a-t1-again"})
    batch_b = [_item("b", 0, 33), _item("b", 1, 8), _item("b", 2, 2.5)]
    batch_b.append({**batch_a[2], "transfer_id": "b-shares-a2"})
    a.send("push", items=batch_a, consumer=address, timeout_s=120)
    b.send("push", items=batch_b, consumer=address, timeout_s=120)
    _check_pushed(a.result(180))
    _check_pushed(b.result(180))
    assert _verify(consumer, batch_a + batch_b) == 8

    # A second round reuses connections (and, for cuda_ipc, the mapping).
    again = [_item("c", i, mib) for i, mib in enumerate([16, 1, 64])]
    _check_pushed(a.call("push", 180, items=again, consumer=address, timeout_s=120))
    _verify(consumer, again)

    frames = _planes(consumer)
    other = "tcp" if plane == "cuda_ipc" else "cuda_ipc"
    assert frames.get(plane, 0) > 0, f"{plane} carried nothing: {frames}"
    assert frames.get(other, 0) == 0, f"{other} carried what it should not have: {frames}"


@pytest.mark.parametrize("plane", ["cuda_ipc", "tcp"])
def test_source_is_read_only_after_the_kernel_that_writes_it(library, workers, plane):
    consumer, (producer,), address = _start(workers, PAIRS[0], plane)
    items = [_item("race", i, mib) for i, mib in enumerate([32, 4])]
    # About a tenth of a second of a sleeping kernel before the outputs are
    # written; a library that did not wait would send the zeros before it.
    result = producer.call("push_after_kernel", 180, items=items, consumer=address, timeout_s=120, sleep_cycles=200_000_000)
    _check_pushed(result)
    assert result["pending_at_handover"], "the kernel had finished before the hand-over: the test proved nothing"
    _verify(consumer, items)


def test_consumer_restart_invalidates_the_mapping(library, workers):
    consumer, (producer,), address = _start(workers, PAIRS[0], "cuda_ipc")
    first = [_item("life1", 0, 8)]
    _check_pushed(producer.call("push", 120, items=first, consumer=address, timeout_s=60))
    _verify(consumer, first)
    control = consumer.info["info"]["control"]
    consumer.stop()

    # A new consumer process at the same control port, over a new slab.
    port = int(address.rsplit(":", 1)[1])
    shard = {"ec_ip": "127.0.0.1", "ec_port": port, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "transport": "tcp"}
    second = workers("gpu_consumer", "consumer-2", config=shard, slab_bytes=256 * MiB, device=PAIRS[0][1], settings=SETTINGS)
    second.wait_ready(180)
    assert second.info["info"]["control"] == control
    items = [_item("life2", 0, 8), _item("life2", 1, 3)]
    # The first push after the restart may fail while the producer learns
    # the new layout; the next one must land.
    out = producer.call("push", 120, items=items, consumer=address, timeout_s=60)
    if out["failed"]:
        items = [_item("life2b", 0, 8), _item("life2b", 1, 3)]
        out = producer.call("push", 120, items=items, consumer=address, timeout_s=60)
    _check_pushed(out)
    _verify(second, items)
    assert _planes(second).get("cuda_ipc", 0) > 0
