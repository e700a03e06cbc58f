"""Worker processes that host a consumer shard or a producer, for the demo,
the benchmarks and the tests, and what those share: deterministic payloads,
free ports, percentiles and the wait for items to become available.

A :class:`Worker` here is a :class:`~ecmooncake.tools.worker.Worker` named
by role: ``consumer`` and ``producer`` (host memory, below), ``gpu_consumer``
and ``gpu_producer`` (GPU memory, in :mod:`ecmooncake.tools.gpubench`).
"""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..buffers import shared_slab
from ..native import Consumer, Producer, Scheduler, configure, trace_drain, trace_enable
from .worker import Worker as _Worker
from .worker import WorkerError, stop_all

__all__ = [
    "ConsumerHost",
    "ProducerHost",
    "Worker",
    "WorkerError",
    "await_available",
    "free_port_range",
    "payload",
    "percentile",
    "stop_all",
]

# How often the scheduler is asked which items became available: the
# resolution of the latency figures.
_WAIT_SLICE_MS = 1


def payload(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes for an item, each in 1..255.

    Zero never occurs, so a region that was reserved but never written (the
    slab starts zeroed) cannot pass verification.
    """
    words = np.random.PCG64(seed).random_raw((nbytes + 7) // 8)
    data = words.view(np.uint8)[:nbytes]
    np.maximum(data, 1, out=data)
    return data


def free_port_range(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A base port such that base .. base+count-1 are all free on host now.

    The run is taken below the kernel's ephemeral range: whoever asked binds
    it only later (a worker process, a vLLM server seconds after), and a port
    in the ephemeral range may by then be any process's outgoing connection.
    """
    low, top = _port_range()
    top -= count
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(low, max(low + 1, top))
        if base + count <= 65536 and all(_port_free(host, base + i) for i in range(count)):
            return base
    raise WorkerError(f"no run of {count} free ports on {host} below {top + count} after {attempts} tries")


def _port_range() -> tuple[int, int]:
    """Where runs of ports are taken: [10000, the ephemeral range), or the
    part of it ECMOONCAKE_PORT_RANGE ("LOW-HIGH", HIGH excluded) names, so
    that test phases running side by side never pick the same port."""
    low, high = 10000, _ephemeral_low()
    text = os.environ.get("ECMOONCAKE_PORT_RANGE", "")
    if text:
        a, _, b = text.partition("-")
        try:
            low, high = max(1024, int(a)), min(high, int(b))
        except ValueError:
            raise WorkerError(f"ECMOONCAKE_PORT_RANGE={text!r} is not LOW-HIGH") from None
        if high - low < 100:
            raise WorkerError(f"ECMOONCAKE_PORT_RANGE={text!r} leaves fewer than 100 ports below the ephemeral range")
    return low, high


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, int(np.ceil(q / 100.0 * len(ordered))))
    return ordered[rank - 1]


# --- child side -------------------------------------------------------------


class ConsumerHost:
    """One consumer shard inside a worker: its slab and its Consumer."""

    def __init__(self, config: dict, slab_bytes: int, settings: dict | None = None, trace: int = 0):
        if settings:
            configure(**settings)
        if trace:
            trace_enable(trace)
        if config.get("transport") == "shm":
            # The shard hands the slab's memfd to producers on this host,
            # which map it and copy into it.
            self.slab, fd = shared_slab(slab_bytes)
            config = {**config, "slab_fd": fd}
        else:
            self.slab = np.empty(slab_bytes, dtype=np.uint8)
        # Touch every page now so that page faults do not land on a timed
        # transfer, and so that unwritten bytes read as zero.
        self.slab.fill(0)
        self.consumer = Consumer(config, self.slab)

    def ready(self) -> dict:
        return {"info": self.consumer.info(), "pid": os.getpid()}

    def op_info(self) -> dict:
        return self.consumer.info()

    def op_stats(self) -> dict:
        return self.consumer.stats()

    def op_trace(self) -> dict:
        """This process's ready-path stamps since the last call (ecmooncake.trace)."""
        return trace_drain()

    def op_acquire(self, mm_hashes: list[str]) -> list[dict]:
        return self.consumer.acquire(mm_hashes)

    def op_release(self, mm_hashes: list[str]) -> list[dict]:
        return self.consumer.release(mm_hashes)

    def op_read(self, mm_hash: str) -> bytes:
        """Acquires, copies out and releases one item (for small test items)."""
        (item,) = self.consumer.acquire([mm_hash])
        if item.get("error"):
            raise WorkerError(f"acquire {mm_hash}: {item['error']}")
        try:
            return self._bytes(self.consumer.view(item["offset"], item["nbytes"]))
        finally:
            self.consumer.release([mm_hash])

    def op_verify(self, items: list[dict]) -> list[dict]:
        """Acquires each item, compares every byte with payload(seed), releases it.

        items: [{"mm_hash", "nbytes", "seed"}]; returns one result per item:
        {"mm_hash", "ok", "error"}.
        """
        results = []
        for item in items:
            results.append(self._verify_one(item["mm_hash"], item["nbytes"], item["seed"]))
        return results

    def _verify_one(self, mm_hash: str, nbytes: int, seed: int) -> dict:
        (got,) = self.consumer.acquire([mm_hash])
        if got.get("error"):
            return {"mm_hash": mm_hash, "ok": False, "error": f"acquire: {got['error']}"}
        try:
            if got["nbytes"] != nbytes:
                return {"mm_hash": mm_hash, "ok": False, "error": f"size {got['nbytes']}, expected {nbytes}"}
            # The zero-copy view the engine would get.
            wrong = self._wrong(self.consumer.view(got["offset"], got["nbytes"]), seed, nbytes)
            if wrong is None:
                return {"mm_hash": mm_hash, "ok": True, "error": ""}
            count, first, value, expected = wrong
            return {
                "mm_hash": mm_hash,
                "ok": False,
                "error": f"{count} of {nbytes} bytes differ, first at {first} (got {value}, expected {expected})",
            }
        finally:
            self.consumer.release([mm_hash])

    def _bytes(self, region: Any) -> bytes:
        return region.tobytes()

    def _wrong(self, region: Any, seed: int, nbytes: int) -> tuple[int, int, int, int] | None:
        """None when region holds payload(seed, nbytes); else how many bytes
        differ, the first of them, its value and the expected one."""
        expected = payload(seed, nbytes)
        if np.array_equal(region, expected):
            return None
        wrong = np.flatnonzero(region != expected)
        first = int(wrong[0])
        return wrong.size, first, int(region[first]), int(expected[first])

    def op_drain(self, mm_hashes: list[str]) -> int:
        """Acquires and releases items so they become evictable residents;
        returns how many could not be acquired."""
        items = self.consumer.acquire(mm_hashes)
        ok = [i["mm_hash"] for i in items if not i.get("error")]
        if ok:
            self.consumer.release(ok)
        return len(items) - len(ok)

    def close(self) -> None:
        self.consumer.close()


class ProducerHost:
    """A producer inside a worker, with payloads it generates itself."""

    def __init__(self, config: dict, settings: dict | None = None, trace: int = 0):
        if settings:
            configure(**settings)
        if trace:
            trace_enable(trace)
        self.producer = Producer(config)
        self._filler = np.zeros(0, dtype=np.uint8)

    def ready(self) -> dict:
        return {"pid": os.getpid()}

    def op_stats(self) -> dict:
        return self.producer.stats()

    def op_trace(self) -> dict:
        """This process's ready-path stamps since the last call (ecmooncake.trace)."""
        return trace_drain()

    def op_submit(self, pushes: list[dict]) -> list[dict]:
        return self.producer.submit(pushes)

    def op_source(self, mm_hash: str, nbytes: int, seed: int) -> int:
        return self.producer.source(mm_hash, payload(seed, nbytes))

    def op_cancel(self, transfer_ids: list[str]) -> None:
        self.producer.cancel(transfer_ids)

    def op_poll(self, timeout_ms: int = 0) -> dict:
        return self.producer.poll(timeout_ms)

    def op_held_sources(self) -> int:
        return self.producer.held_sources

    def op_push(
        self,
        items: list[dict],
        consumer: str,
        timeout_s: float,
        fill: str = "seed",
    ) -> dict:
        """Pushes a batch and waits until each push is done or failed.

        items: [{"transfer_id", "mm_hash", "nbytes", "seed"}]. ``fill="seed"``
        sends payload(seed, nbytes); ``fill="zeros"`` sends slices of one
        shared buffer, for benchmarks where generating data would dominate.
        Payloads are made before the clock starts; then, in vLLM's order, the
        pushes are submitted before their sources are handed over. Times are
        time.monotonic(), which all processes of a Linux host share.
        """
        sources = self._sources(items, fill)
        pushes = [
            {
                "transfer_id": it["transfer_id"],
                "mm_hash": it["mm_hash"],
                "nbytes": int(it["nbytes"]),
                "consumer": consumer,
            }
            for it in items
        ]
        t_submit = time.monotonic()
        submitted = self.producer.submit(pushes)
        self.producer.sources(list(sources.items()))
        del sources
        return self._await(pushes, submitted, t_submit, timeout_s)

    def _await(self, pushes: list[dict], submitted: list[dict], t_submit: float, timeout_s: float) -> dict:
        """Polls until every submitted push is done or failed and every
        source is released, or the deadline; returns op_push's report."""
        failed = {s["transfer_id"]: s["error"] for s in submitted if s.get("error")}
        outstanding = {p["transfer_id"] for p in pushes} - set(failed)
        done: dict[str, float] = {}
        deadline = t_submit + timeout_s
        while (outstanding or self.producer.held_sources) and time.monotonic() < deadline:
            out = self.producer.poll(100)
            now = time.monotonic()
            for tid in out.get("done") or ():
                if tid in outstanding:
                    outstanding.discard(tid)
                    done[tid] = now
            for entry in out.get("failed") or ():
                tid = entry.get("transfer_id")
                if tid in outstanding:
                    outstanding.discard(tid)
                    failed[tid] = entry.get("reason") or "failed"
        return {
            "t_submit": t_submit,
            "t_done": max(done.values(), default=t_submit),
            "done": done,
            "failed": failed,
            "timed_out": sorted(outstanding),
            "held_sources": self.producer.held_sources,
        }

    def _sources(self, items: list[dict], fill: str) -> dict[str, np.ndarray]:
        sizes: dict[str, tuple[int, int]] = {}
        for it in items:
            sizes.setdefault(it["mm_hash"], (int(it["nbytes"]), int(it.get("seed", 0))))
        if fill == "seed":
            return {h: payload(seed, n) for h, (n, seed) in sizes.items()}
        if fill == "zeros":
            largest = max((n for n, _ in sizes.values()), default=0)
            if self._filler.nbytes < largest:
                self._filler = np.zeros(largest, dtype=np.uint8)
            return {h: self._filler[:n] for h, (n, _) in sizes.items()}
        raise ValueError(f"unknown fill {fill!r}")

    def close(self) -> None:
        self.producer.close()


# Roles and their hosts. The GPU hosts live in gpubench, which imports
# torch, so they are named here and imported only in a worker that plays one.
ROLES: dict[str, type | str] = {
    "consumer": ConsumerHost,
    "producer": ProducerHost,
    "gpu_consumer": "ecmooncake.tools.gpubench:GPUConsumerHost",
    "gpu_producer": "ecmooncake.tools.gpubench:GPUProducerHost",
}


class Worker(_Worker):
    """A spawned process hosting the ConsumerHost or ProducerHost of a role."""

    def __init__(self, role: str, name: str, **kwargs: Any):
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        super().__init__(ROLES[role], name, **kwargs)


def await_available(scheduler: Scheduler, transfer_ids: list[str], timeout_s: float, spin: bool = False) -> tuple[dict, dict]:
    """Waits until every transfer is available or failed; returns
    ({transfer_id: time available}, {transfer_id: reason not available}).
    With spin, as vLLM's engine loop while a request waits: without pause,
    each pass reading the events already in the sockets (Scheduler.poll)
    and asking only when the table's generation moved; a core's worth of
    CPU. Else blocked in the library's wait, a slice at a time."""
    available: dict[str, float] = {}
    unavailable: dict[str, str] = {}
    waiting = list(transfer_ids)
    deadline = time.monotonic() + timeout_s
    seen = -1
    while waiting and time.monotonic() < deadline:
        if spin:
            scheduler.poll()
            generation = scheduler.generation()
            if generation == seen:
                continue
            seen = generation
            out = scheduler.wait(waiting, 0)
        else:
            out = scheduler.wait(waiting, _WAIT_SLICE_MS)
        now = time.monotonic()
        for tid in out.get("available") or ():
            available.setdefault(tid, now)
        for tid in out.get("failed") or ():
            unavailable.setdefault(tid, "failed before it was available")
        waiting = [t for t in waiting if t not in available and t not in unavailable]
    for tid in waiting:
        unavailable[tid] = f"not available within {timeout_s:.0f}s"
    return available, unavailable
