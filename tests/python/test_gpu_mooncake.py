"""GPU memory over the ``mooncake`` transport, end to end on one host: a
shard process whose GPU slab is registered with Mooncake's engine as memory
of its device, a producer process whose CUDA sources leave from its GPU
staging (no host copy anywhere), ``mooncake_protocol: tcp`` on loopback.
Round trips from 4 KiB to 128 MiB are compared bit for bit on the GPU; a
producer killed mid-write and a shard restarted leave the others working.

Needs a CUDA device and a CUDA build of Mooncake's engine (the
``mooncake-transfer-engine-cuda13`` wheel, which ``bash build/gpu_run.sh
mooncake`` installs from the carried wheel); skips elsewhere, saying so.
"""

from __future__ import annotations

import time
import zlib

import pytest

from conftest import wait_until
from ecmooncake import native
from ecmooncake.tools import harness

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here: the mooncake GPU path is tested on a GPU host (bash build/gpu_run.sh mooncake)", allow_module_level=True)

MiB = 1 << 20
IP = "127.0.0.1"
SETTINGS = {"log_level": "info"}
SLAB = 1536 * MiB
MOONCAKE = {"transport": "mooncake", "mooncake_protocol": "tcp"}


@pytest.fixture(scope="module")
def cuda_engine(library):
    """The engine a shard and a producer load here, when it registers GPU
    memory; a skip naming why otherwise."""
    info = native.mooncake_info()
    if not info.get("available"):
        pytest.skip(f"no usable Mooncake engine: {info.get('reason')}")
    if not info.get("cuda"):
        pytest.skip(f"the Mooncake engine here ({info.get('engine') or info.get('library')}) is no CUDA build: install mooncake-transfer-engine-cuda13")
    print("mooncake engine:", info.get("engine") or info.get("library"), info.get("version"), info.get("cuda_runtime"))
    return info


def _shard(workers, name, port, slab=SLAB):
    config = {"ec_ip": IP, "ec_port": port, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, **MOONCAKE}
    return workers("gpu_consumer", name, config=config, slab_bytes=slab, device="cuda:0", settings=SETTINGS)


def _producer(workers, name):
    return workers("gpu_producer", name, config={**MOONCAKE, "local_transport": "none"}, device="cuda:0", settings=SETTINGS)


def _start(workers):
    port = harness.free_port_range(1, IP)
    shard, producer = _shard(workers, "shard", port), _producer(workers, "producer")
    for w in (shard, producer):
        w.wait_ready(180)
    return shard, producer, f"tcp://{IP}:{port}", port


def _item(tag, i, nbytes):
    return {"transfer_id": f"{tag}-t{i}", "mm_hash": f"{tag}-h{i}", "nbytes": int(nbytes) // 2 * 2, "seed": zlib.crc32(f"{tag}/{i}".encode()) % 100000}


def _check_pushed(result):
    assert not result["failed"], result["failed"]
    assert not result["timed_out"], result["timed_out"]
    assert result["held_sources"] == 0, "every source is released once its writes are done"


def _verify(shard, items):
    results = shard.call("verify", 300, items=items)
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad


def _drain(shard, items):
    shard.call("drain", 60, mm_hashes=[it["mm_hash"] for it in items])


SIZES = [4 << 10, 64 << 10, 1 * MiB, 4 * MiB + 6, 19 * MiB, 67 * MiB, 128 * MiB]


def test_round_trips_from_4k_to_128m_are_bit_exact(cuda_engine, workers):
    shard, producer, address, _ = _start(workers)
    for size in SIZES:
        items = [_item(f"rt{size}", 0, size)]
        t0 = time.monotonic()
        _check_pushed(producer.call("push", 180, items=items, consumer=address, timeout_s=120))
        took = time.monotonic() - t0
        _verify(shard, items)
        # The load is a view of the GPU slab the engine wrote into.
        assert shard.call("where", 30, mm_hash=items[0]["mm_hash"]) == {"device": "cuda:0", "view": True, "error": ""}
        _drain(shard, items)
        print(f"mooncake GPU->GPU {size / MiB:9.3f} MiB: {took * 1e3:8.2f} ms, bit-exact")
    # A batch of every size at once, with a duplicate hash.
    batch = [_item("batch", i, size) for i, size in enumerate(SIZES)]
    batch.append({**batch[3], "transfer_id": "batch-again"})
    _check_pushed(producer.call("push", 180, items=batch, consumer=address, timeout_s=120))
    _verify(shard, batch[:-1])


def test_source_is_read_only_after_the_kernel_that_writes_it(cuda_engine, workers):
    shard, producer, address, _ = _start(workers)
    items = [_item("race", i, mib * MiB) for i, mib in enumerate([32, 4])]
    result = producer.call("push_after_kernel", 180, items=items, consumer=address, timeout_s=120, sleep_cycles=200_000_000)
    _check_pushed(result)
    assert result["pending_at_handover"], "the kernel had finished before the hand-over: the test proved nothing"
    _verify(shard, items)


def test_a_producer_killed_mid_write_leaves_the_shard_serving(cuda_engine, workers):
    shard, producer, address, _ = _start(workers)
    big = [_item("killed", i, 128 * MiB) for i in range(8)]
    producer.send("push", items=big, consumer=address, timeout_s=120)

    wait_until(lambda: shard.call("stats", 10)["bytes_in_use"] > 0, 60, interval=0.005, what="the reservations")
    # About two of the eight 128 MiB items on their way at 1.5 GB/s.
    time.sleep(0.2)
    producer.kill()
    # An item the producer finished is served intact; one it left
    # half-written is never served.
    for r in shard.call("verify", 300, items=big):
        assert r["ok"] or r["error"].startswith("acquire"), r
    # A new producer's writes land, bit-exact, on the same shard.
    second = _producer(workers, "producer-2")
    second.wait_ready(180)
    items = [_item("after-kill", i, mib * MiB) for i, mib in enumerate([128, 19, 1])]
    _check_pushed(second.call("push", 180, items=items, consumer=address, timeout_s=120))
    _verify(shard, items)
    assert shard.alive


def test_a_restarted_shard_is_written_again(cuda_engine, workers):
    shard, producer, address, port = _start(workers)
    first = [_item("life1", 0, 8 * MiB)]
    _check_pushed(producer.call("push", 120, items=first, consumer=address, timeout_s=60))
    _verify(shard, first)
    shard.stop()
    # A new shard process at the same control port, with a new engine and
    # a new slab: the producer must open its segment again.
    second = _shard(workers, "shard-2", port, slab=512 * MiB)
    second.wait_ready(180)
    items = [_item("life2", 0, 64 * MiB), _item("life2", 1, 3 * MiB)]
    out = producer.call("push", 120, items=items, consumer=address, timeout_s=60)
    if out["failed"]:
        # The first push after the restart may fail while the producer
        # learns the new segment; the next one must land.
        items = [_item("life2b", 0, 64 * MiB), _item("life2b", 1, 3 * MiB)]
        out = producer.call("push", 120, items=items, consumer=address, timeout_s=60)
    _check_pushed(out)
    _verify(second, items)
