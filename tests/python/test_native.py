"""Round trips through the public API across processes, and the errors that
bad input must raise."""

from __future__ import annotations

import ctypes
import fcntl
import gc
import os
import weakref

import numpy as np
import pytest

from conftest import wait_until
from ecmooncake import _ffi, native
from ecmooncake.tools.harness import free_port_range, payload
from ecmooncake.native import Consumer, EcmError, EcmHandleError, EcmInvalid, Producer, Scheduler

pytestmark = pytest.mark.usefixtures("library")

IP = "127.0.0.1"
MiB = 1 << 20


def consumer_config(port: int, rank: int = 0, tp_size: int = 1, **extra) -> dict:
    return {"ec_ip": IP, "ec_port": port, "tp_rank": rank, "tp_size": tp_size, "dp_rank": 0, "transport": "tcp", **extra}


def scheduler_config(port: int, tp_size: int, **extra) -> dict:
    return {"ec_ip": IP, "ec_port": port, "tp_size": tp_size, "dp_rank": 0, "push_wait_timeout_s": 20, "load_timeout_s": 10, **extra}


def item(tag: str, mm_hash: str, nbytes: int, seed: int) -> dict:
    return {"transfer_id": f"t-{tag}", "mm_hash": mm_hash, "nbytes": nbytes, "seed": seed}


def expect(scheduler: Scheduler, items: list[dict]) -> None:
    out = scheduler.step(
        {"expect": [{"request_id": f"r-{it['transfer_id']}", "items": [{"transfer_id": it["transfer_id"], "mm_hash": it["mm_hash"]}]} for it in items]}
    )
    assert not out.get("expect_errors"), out


def push_and_check(scheduler, shards, producer, address, items):
    """Pushes items as one batch; asserts every one arrives on every shard, bit-exact."""
    tids = [it["transfer_id"] for it in items]
    expect(scheduler, items)
    pushed = producer.call("push", 90, items=items, consumer=address, timeout_s=60)
    assert pushed["failed"] == {} and pushed["timed_out"] == [], pushed
    assert sorted(pushed["done"]) == sorted(tids)
    assert pushed["held_sources"] == 0, "sources are released once their writes finished"
    waited = scheduler.wait(tids, 20_000)
    assert sorted(waited["available"]) == sorted(tids), waited
    for shard in shards:
        results = shard.call("verify", 60, items=items)
        assert [r["ok"] for r in results] == [True] * len(items), results
    for it in items:
        assert scheduler.has(it["mm_hash"])


def test_two_shards_round_trip_with_duplicates(workers):
    port = free_port_range(2, IP)
    shards = [
        workers("consumer", f"consumer-{rank}", config=consumer_config(port, rank, 2), slab_bytes=64 * MiB)
        for rank in range(2)
    ]
    producer = workers("producer", "producer", config={"transport": "tcp", "control_timeout_s": 10, "push_wait_timeout_s": 30})
    for worker in [*shards, producer]:
        worker.wait_ready(60)
    address = f"tcp://{IP}:{port}"
    with Scheduler(scheduler_config(port, 2)) as scheduler:
        first = [
            item("a", "a" * 64, 1, 11),
            item("b", "b" * 64, 257, 12),
            item("c", "c" * 64, 3 * MiB + 5, 13),
            item("a2", "a" * 64, 1, 11),  # same content as a, in the same batch
            item("d", "d" * 64, 9 * MiB, 14),
        ]
        push_and_check(scheduler, shards, producer, address, first)
        # b is now a resident copy on both shards; e is new.
        second = [item("b2", "b" * 64, 257, 12), item("e", "e" * 64, 2 * MiB + 1, 15)]
        push_and_check(scheduler, shards, producer, address, second)
        tiny = shards[1].call("read", 30, mm_hash="b" * 64)
        assert tiny == payload(12, 257).tobytes()
        assert 0 not in tiny


def test_source_stays_alive_until_released():
    port = free_port_range(1, IP)
    slab = np.zeros(16 * MiB, dtype=np.uint8)
    with Consumer(consumer_config(port), slab) as consumer, Producer({"transport": "tcp", "control_timeout_s": 10}) as producer:
        data = payload(7, 4 * MiB + 3)
        alive = weakref.ref(data)
        submitted = producer.submit([{"transfer_id": "keep", "mm_hash": "k" * 64, "nbytes": data.nbytes, "consumer": f"tcp://{IP}:{port}"}])
        assert not submitted[0].get("error"), submitted
        source_id = producer.source("k" * 64, data)
        del data
        gc.collect()
        assert alive() is not None, "the producer holds a source until it is released"
        assert producer.held_sources == 1
        seen: dict[str, list] = {"done": [], "released": []}

        def finished():
            out = producer.poll(200)
            assert not out.get("failed"), out
            seen["done"] += out.get("done") or []
            seen["released"] += out.get("released") or []
            return "keep" in seen["done"] and source_id in seen["released"]

        wait_until(finished, 30, interval=0, what="push done and source released")
        gc.collect()
        assert alive() is None
        assert producer.held_sources == 0
        (got,) = consumer.acquire(["k" * 64])
        assert not got.get("error"), got
        assert np.array_equal(consumer.view(got["offset"], got["nbytes"]), payload(7, 4 * MiB + 3))
        consumer.release(["k" * 64])


def test_consumer_in_process_api():
    port = free_port_range(1, IP)
    slab = np.zeros((1024, 1024), dtype=np.float32)
    with Consumer(consumer_config(port), slab) as consumer:
        info = consumer.info()
        assert info["control"].endswith(f":{port}")
        assert info["slab_bytes"] == slab.nbytes == consumer.slab_nbytes
        assert consumer.stats()["bytes_in_use"] == 0
        (missing,) = consumer.acquire(["no-such-hash"])
        assert missing["mm_hash"] == "no-such-hash" and missing["error"]
        (unknown,) = consumer.release(["no-such-hash"])
        assert unknown["error"]
        with pytest.raises(EcmInvalid, match="outside"):
            consumer.view(slab.nbytes - 1, 2)
        consumer.view(4, 16)[:] = 5
        assert slab.view(np.uint8).reshape(-1)[:24].tolist() == [0] * 4 + [5] * 16 + [0] * 4, "a view, not a copy"


def test_scheduler_refuses_a_transfer_id_reused_for_other_content():
    port = free_port_range(1, IP)
    with Scheduler(scheduler_config(port, 1)) as scheduler:
        ok = scheduler.step({"expect": [{"request_id": "r1", "items": [{"transfer_id": "t1", "mm_hash": "h1"}]}]})
        assert not ok.get("expect_errors")
        clash = scheduler.step({"expect": [{"request_id": "r2", "items": [{"transfer_id": "t1", "mm_hash": "h2"}]}]})
        assert "r2" in clash["expect_errors"] and "t1" in clash["expect_errors"]["r2"]
        assert scheduler.has("h1") is False
        waited = scheduler.wait(["t1"], 0)
        assert waited["waiting"] == ["t1"]


def test_scheduler_generation_is_read_without_a_call():
    port = free_port_range(1, IP)
    with Scheduler(scheduler_config(port, 1)) as scheduler:
        start = scheduler.generation()
        asked = scheduler.step({"ensure": ["r1"], "has": ["h1"]})
        assert asked["generation"] == scheduler.generation() == start, "questions change nothing"
        assert scheduler.has("h1") is False
        out = scheduler.step({"expect": [{"request_id": "r1", "items": [{"transfer_id": "t1", "mm_hash": "h1"}]}], "ensure": ["r1"]})
        assert out["ensure"]["r1"]["ready"] is False
        assert out["generation"] == scheduler.generation() > start
        assert scheduler.generation_counter.value == scheduler.generation()
        again = scheduler.step({"ensure": ["r1"], "has": ["h1"]})
        assert again["generation"] == out["generation"]
        scheduler.step({"finished": ["r1"]})
        assert scheduler.generation() > out["generation"]


def test_scheduler_answers_what_moved_since_a_generation():
    """The engine loop's catch-up (changes_since): only what moved since the
    generation of the answers it holds; a snapshot where the table cannot
    say (a generation it never gave)."""
    port = free_port_range(1, IP)
    with Scheduler(scheduler_config(port, 1)) as scheduler:
        first = scheduler.step({"expect": [{"request_id": "r1", "items": [{"transfer_id": "t1", "mm_hash": "h1"}]}], "snapshot": True})
        at = first["generation"]
        out = scheduler.step({"expect": [{"request_id": "r2", "items": [{"transfer_id": "t2", "mm_hash": "h2"}]}], "changes_since": at})
        assert out["incremental"] is True
        assert out["changed"] == {"h2": False}, "r1's content did not move"
        assert not out["changed_failed"]["r2"] and "r1" not in out["changed_failed"]
        assert "covered" not in out and out["generation"] == scheduler.generation() > at
        nothing = scheduler.step({"changes_since": out["generation"]})
        assert nothing["incremental"] is True and not nothing.get("changed")
        fallback = scheduler.step({"changes_since": scheduler.generation() + 100})
        assert not fallback.get("incremental"), "a generation the table never gave: a snapshot instead"
        assert fallback["generation"] == scheduler.generation()


def test_scheduler_watch_checks_its_counter():
    with Scheduler(scheduler_config(free_port_range(1, IP), 1)) as scheduler:
        rc, msg = _raw_call("ecm_scheduler_watch", scheduler.handle, None)
        assert rc == _ffi.ECM_ERR_INVALID and "counter is NULL" in msg
        words = (ctypes.c_uint64 * 2)()
        odd = ctypes.cast(ctypes.addressof(words) + 4, ctypes.POINTER(ctypes.c_uint64))
        rc, msg = _raw_call("ecm_scheduler_watch", scheduler.handle, odd)
        assert rc == _ffi.ECM_ERR_INVALID and "aligned" in msg


def _raw_call(name, *args):
    dll = _ffi.lib()
    err = ctypes.c_void_p()
    rc = getattr(dll, name)(*args, ctypes.byref(err))
    return rc, _ffi.take_string(dll, err) or ""


@pytest.mark.parametrize(
    "open_object, words",
    [
        (lambda: Producer("{not json"), ["producer"]),
        (lambda: Producer({"transport": "tcp", "bogus_key": 1}), ["bogus_key"]),
        (lambda: Producer({"tcp_conns": "four"}), ["tcp_conns"]),
        (lambda: Producer({"transport": "carrier-pigeon"}), ["transport"]),
        (lambda: Scheduler({"tp_size": 0}), ["tp_size"]),
        (lambda: Consumer({"ec_port": 70000}, np.zeros(4096, np.uint8)), ["ec_port"]),
        (lambda: Consumer({"lease_s": -1}, np.zeros(4096, np.uint8)), ["lease_s"]),
    ],
)
def test_bad_config_is_refused_with_a_message(open_object, words):
    with pytest.raises(EcmError) as info:
        open_object()
    assert info.value.code == _ffi.ECM_ERR_INVALID
    for word in words:
        assert word in str(info.value)


def test_bad_arguments_are_refused():
    with pytest.raises(EcmInvalid, match="gomaxprocs"):
        native.configure(gomaxprocs="many")
    with Scheduler(scheduler_config(free_port_range(1, IP), 1)) as scheduler:
        with pytest.raises(EcmInvalid, match="step"):
            scheduler.step("{not json")


def test_closed_handles():
    producer = Producer({"transport": "tcp"})
    handle = producer.handle
    assert isinstance(producer.stats(), dict)
    producer.close()
    producer.close()
    assert producer.closed
    with pytest.raises(EcmHandleError, match="producer is closed"):
        producer.poll()
    with pytest.raises(EcmHandleError) as info:
        native._call("ecm_close", handle)
    assert "ecm_close" in str(info.value)
    with pytest.raises(EcmHandleError):
        native._call("ecm_stats", handle, out=True)
    with Scheduler(scheduler_config(free_port_range(1, IP), 1)) as scheduler:
        other = scheduler.handle
    with pytest.raises(EcmHandleError):
        native._call("ecm_scheduler_step", other, b"{}", out=True)


def test_wrong_kind_of_handle_is_refused():
    with Producer({"transport": "tcp"}) as producer:
        with pytest.raises(EcmHandleError):
            native._call("ecm_scheduler_step", producer.handle, b"{}", out=True)


def test_producer_refuses_a_strided_source():
    with Producer({"transport": "tcp"}) as producer:
        with pytest.raises(EcmInvalid, match="C-contiguous"):
            producer.source("h", np.zeros((64, 64), dtype=np.uint8)[::2, ::2])
        assert producer.held_sources == 0


def test_shm_round_trip_between_processes(workers):
    """A producer and two consumer shards on one host, each in its own
    process: items land in the shards' shared-memory slabs, bit-exact."""
    port = free_port_range(2, IP)
    shards = [
        workers("consumer", f"shm-consumer-{rank}", config=consumer_config(port, rank, 2, transport="shm"), slab_bytes=32 * MiB)
        for rank in range(2)
    ]
    producer = workers("producer", "shm-producer", config={"transport": "shm", "control_timeout_s": 10, "push_wait_timeout_s": 30})
    for worker in [*shards, producer]:
        worker.wait_ready(60)
    with Scheduler(scheduler_config(port, 2)) as scheduler:
        items = [item("s1", "1" * 64, 1, 21), item("s2", "2" * 64, 5 * MiB + 3, 22), item("s3", "1" * 64, 1, 21)]
        push_and_check(scheduler, shards, producer, f"tcp://{IP}:{port}", items)
    for shard in shards:
        info = shard.call("info", 30)
        assert info["transport"] == "shm"
        assert info["data"].startswith("shm://@ecmooncake-shm-")


def _shm_leftovers(pid: int) -> list[str]:
    """/dev/shm entries that name process pid (as the slab files of the
    path-based shm transport did)."""
    return [name for name in os.listdir("/dev/shm") if f"-{pid}-" in name or name.endswith(f"-{pid}")]


def _maps_slab(pid: int) -> bool:
    """Whether process pid maps a consumer slab memfd."""
    with open(f"/proc/{pid}/maps") as f:
        return "/memfd:ecmooncake-slab" in f.read()


def test_shm_consumer_killed_leaves_nothing_behind(workers):
    """vLLM SIGKILLs its workers: no finalizer runs. Nothing of the
    consumer's slab may stay in /dev/shm, and the producer that mapped it
    lets it go, so that every restart does not leak a slab of memory."""
    port = free_port_range(1, IP)
    shard = workers("consumer", "shm-killed-consumer", config=consumer_config(port, transport="shm"), slab_bytes=16 * MiB)
    producer = workers("producer", "shm-killed-producer", config={"transport": "shm", "control_timeout_s": 10, "push_wait_timeout_s": 30})
    for worker in (shard, producer):
        worker.wait_ready(60)
    with Scheduler(scheduler_config(port, 1)) as scheduler:
        push_and_check(scheduler, [shard], producer, f"tcp://{IP}:{port}", [item("k1", "k" * 64, 3 * MiB + 5, 31)])
    pid = shard.pid
    assert _maps_slab(pid), "the consumer's slab is a memfd"
    assert _maps_slab(producer.pid), "the producer mapped it"
    assert _shm_leftovers(pid) == [], "the slab is no file in /dev/shm"
    shard.kill()
    assert not os.path.exists(f"/proc/{pid}/maps") or not _maps_slab(pid)
    assert _shm_leftovers(pid) == [], "nothing of the killed consumer remains in /dev/shm"
    wait_until(lambda: not _maps_slab(producer.pid), 30, what="the producer unmapping the dead consumer's slab")


def test_shared_slab_is_a_sealed_memfd_closed_with_its_array():
    before = set(os.listdir("/dev/shm"))
    slab, fd = native.shared_slab(3 * MiB + 1)
    assert slab.dtype == np.uint8 and slab.nbytes == 3 * MiB + 1 and slab.flags.writeable
    assert set(os.listdir("/dev/shm")) == before, "no file in /dev/shm"
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:ecmooncake-slab")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_SEAL
    with pytest.raises(OSError):
        os.ftruncate(fd, 0)
    slab[-1] = 7
    assert os.pread(fd, 1, 3 * MiB) == b"\x07", "the array is the memfd"
    view = slab[10:20]
    del slab
    gc.collect()
    os.fstat(fd)  # a view keeps the descriptor
    del view
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(EcmInvalid, match="positive"):
        native.shared_slab(0)


def test_shm_consumer_checks_its_slab():
    port = free_port_range(1, IP)
    slab, fd = native.shared_slab(4 * MiB)
    with pytest.raises(EcmInvalid, match="slab_fd is not set"):
        Consumer(consumer_config(port, transport="shm"), slab)
    with pytest.raises(EcmInvalid, match="slab_path is no longer supported"):
        Consumer(consumer_config(port, transport="shm", slab_fd=fd, slab_path="/dev/shm/x"), slab)
    private = np.zeros(4 * MiB, dtype=np.uint8)
    with pytest.raises(EcmError, match="not mapped from slab_fd"):
        Consumer(consumer_config(port, transport="shm", slab_fd=fd), private)
    bigger = np.zeros(8 * MiB, dtype=np.uint8)
    with pytest.raises(EcmError, match="less than the 8388608-byte slab"):
        Consumer(consumer_config(port, transport="shm", slab_fd=fd), bigger)
    with Consumer(consumer_config(port, transport="shm", slab_fd=fd), slab) as consumer:
        assert consumer.info()["data"].startswith("shm://@ecmooncake-shm-")
