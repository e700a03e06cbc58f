"""``python -m ecmooncake hotpath``: what Python's per-batch producer calls
cost, beside the cost of crossing into the library once.

This process is an encoder's worker: a Producer pushes batches (8 items of
4 KiB by default, each a distinct mm_hash) over loopback TCP to a consumer
shard in a spawned process. Each batch is announced with
``Producer.submit`` and its outputs handed over with ``Producer.sources``,
as the connector's producer does once a model step; each call is timed
from Python, around the whole method (packing, the native call, reading
its answer). Between batches the producer waits until every push is done
and its source released, so that batches do not queue behind each other
and every call meets an idle data plane.

The floor is ``ecm_noop`` through ctypes, timed in the same loop: one
crossing of the boundary with the argument count of the packed calls and
nothing else. Every figure is printed as a ratio to its p50.

Beside each wall-clock figure the calling thread's own CPU time for the
same call is printed (``time.thread_time_ns``, its ratio to the floor's
CPU time): on a loaded machine the wall clock mostly measures the waits
for a core, while the CPU time is what the call itself costs the engine's
thread. The work it hands to the library's other threads is in neither.

``--busy-thread`` runs a second Python thread that spins in bytecode the
whole time, as an engine's other Python threads do. A call that releases
the GIL then waits to take it back from that thread (up to the
interpreter's switch interval, 5 ms by default): the figures show what a
crossing costs when the GIL is contended, not just when it is free.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import sys
import threading
import time
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
IP = "127.0.0.1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=8, help="items per batch (default %(default)s)")
    parser.add_argument("--item-kb", type=float, default=4, help="bytes per item, KiB (default %(default)s)")
    parser.add_argument("--batches", type=int, default=500, help="timed batches (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed batches first (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=60, help="seconds one batch may take to finish (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="where the encoder outputs are: cpu, or cuda[:N] (needs torch) (default %(default)s)")
    parser.add_argument("--busy-thread", action="store_true", help="run a Python thread that spins beside the calls, holding the GIL whenever they let go of it")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def percentiles(ns: list[int]) -> dict[str, float]:
    """p50, p99 and the worst of a list of nanoseconds, in µs."""
    if not ns:
        return {"p50_us": 0.0, "p99_us": 0.0, "max_us": 0.0}
    s = sorted(ns)

    def at(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))] / 1e3

    return {"p50_us": at(0.50), "p99_us": at(0.99), "max_us": s[-1] / 1e3}


class _Floor:
    """One ctypes call of ecm_noop, argument for argument as the packed
    calls pass theirs, through the handle they use: the one that keeps the
    GIL (_ffi.HOLD_GIL), unless ``release_gil``, which calls it through the
    CDLL as every call that can wait is made. A library from before ABI 3
    has none: its floor is ecm_abi_version (two arguments), and the report
    says so."""

    def __init__(self, release_gil: bool = False) -> None:
        from .. import _ffi

        dll = _ffi.lib()
        self._out = ctypes.c_uint64()
        self._version = ctypes.c_int32()
        self._body = b"\0" * 64
        self.name = "ecm_noop" if hasattr(dll, "ecm_noop") else "ecm_abi_version"
        # A package from before the GIL split has no _ffi.function: every
        # call released the GIL.
        self.holds_gil = not release_gil and hasattr(_ffi, "function") and self.name in _ffi.HOLD_GIL
        if self.name == "ecm_noop":
            fn = _ffi.function("ecm_noop") if self.holds_gil else dll.ecm_noop
            if not fn.argtypes:
                fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64,
                                                         ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_void_p)]
            self._args = lambda err: (1, 8, self._body, len(self._body), ctypes.byref(self._out), ctypes.byref(err))
        else:
            fn = dll.ecm_abi_version
            self._args = lambda err: (ctypes.byref(self._version), ctypes.byref(err))
        self._fn = fn

    def __call__(self) -> tuple[int, int]:
        """(wall, thread CPU) nanoseconds of one call."""
        err = ctypes.c_void_p()
        args = self._args(err)
        cpu = time.thread_time_ns()
        start = time.perf_counter_ns()
        self._fn(*args)
        wall = time.perf_counter_ns() - start
        return wall, time.thread_time_ns() - cpu


class _Busy:
    """A Python thread that runs bytecode until stopped: it holds the GIL
    whenever the timed thread lets go of it, as an engine's other Python
    threads (a tokenizer, an HTTP server) do."""

    def __init__(self) -> None:
        self._stop = False
        self.spins = 0
        self._thread = threading.Thread(target=self._spin, name="hotpath-busy", daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self._stop:
            n += 1
        self.spins = n

    def __enter__(self) -> "_Busy":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()


def _finish(producer: Any, tids: set[str], timeout_s: float) -> None:
    """Waits until every push of a batch is done and its source released;
    raises on a failure or at the deadline."""
    waiting = set(tids)
    deadline = time.monotonic() + timeout_s
    while waiting or producer.held_sources:
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch not finished within {timeout_s:.0f}s: {sorted(waiting)[:4]} waiting, {producer.held_sources} sources held")
        out = producer.poll(100)
        if out.get("failed"):
            raise RuntimeError(f"pushes failed: {out['failed'][:4]}")
        waiting.difference_update(out.get("done") or ())


def run(args: argparse.Namespace) -> dict:
    import numpy as np

    from .. import native
    from ..native import Producer
    from .harness import Worker, free_port_range, stop_all

    nbytes = max(1, int(args.item_kb * KiB))
    total = args.warmup + args.batches
    # Every item stays resident on the consumer (distinct hashes): a slab
    # that holds them all keeps eviction out of the timed calls.
    slab_bytes = max(64 * MiB, 2 * total * args.batch * nbytes)
    port = free_port_range(1, IP)
    consumer = Worker(
        "consumer",
        "hotpath-consumer",
        config={"ec_ip": IP, "ec_port": port, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "transport": "tcp"},
        slab_bytes=slab_bytes,
    )
    try:
        consumer.wait_ready(60)
        address = f"tcp://{IP}:{port}"
        data: list[Any] = [np.full(nbytes, 1 + i % 255, dtype=np.uint8) for i in range(args.batch)]
        if args.device != "cpu":
            import torch

            torch.cuda.set_device(args.device)
            data = [torch.from_numpy(d).to(args.device) for d in data]
            torch.cuda.synchronize()
        meta = json.dumps({"dtype": "uint8", "shape": [1, nbytes]}, separators=(",", ":"))
        floor, released = _Floor(), _Floor(release_gil=True)
        names = ("floor", "submit", "submit_call", "hand_over", "hand_over_call", "gil_released")
        times: dict[str, list[int]] = {name: [] for name in names}
        cpu: dict[str, list[int]] = {name: [] for name in names}
        busy = _Busy() if args.busy_thread else contextlib.nullcontext()
        calls = _CallTimer(native)
        with busy, calls, Producer({"transport": "tcp", "control_timeout_s": 10}) as producer:
            for b in range(total):
                pushes = [
                    {"transfer_id": f"hp-{b}-{i}", "mm_hash": f"{b:032x}{i:032x}", "nbytes": nbytes, "consumer": address, "meta": meta}
                    for i in range(args.batch)
                ]
                items = [(p["mm_hash"], d) for p, d in zip(pushes, data)]
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                answers = producer.submit(pushes)
                t1 = time.perf_counter_ns()
                c1 = time.thread_time_ns()
                t2 = time.perf_counter_ns()
                producer.sources(items)
                t3 = time.perf_counter_ns()
                c2 = time.thread_time_ns()
                refused = [a for a in answers if a.get("error")]
                if refused:
                    raise RuntimeError(f"pushes refused: {refused[:4]}")
                f, f_cpu = floor()
                r, r_cpu = released()
                if b >= args.warmup:
                    times["gil_released"].append(r)
                    cpu["gil_released"].append(r_cpu)
                    times["submit"].append(t1 - t0)
                    times["hand_over"].append(t3 - t2)
                    times["floor"].append(f)
                    cpu["submit"].append(c1 - c0)
                    cpu["hand_over"].append(c2 - c1)
                    cpu["floor"].append(f_cpu)
                    for call, name in (("submit_call", "ecm_producer_submit_packed"), ("hand_over_call", "ecm_producer_sources_packed")):
                        times[call].append(calls.wall[name])
                        cpu[call].append(calls.cpu[name])
                _finish(producer, {p["transfer_id"] for p in pushes}, args.timeout)
    finally:
        stop_all([consumer], timeout=10)
    figures, cpu_figures = _ratios(times), _ratios(cpu)
    return {
        "batch": args.batch,
        "item_bytes": nbytes,
        "batches": args.batches,
        "device": args.device,
        "busy_thread": bool(args.busy_thread),
        "switch_interval_us": sys.getswitchinterval() * 1e6,
        "floor": floor.name,
        "floor_holds_gil": floor.holds_gil,
        "cpus": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d"),
        "figures": figures,
        "cpu_figures": cpu_figures,
    }


class _CallTimer:
    """Times each call into the library that Producer's methods make
    (native._call, replaced while in use), so that a method's time splits
    into the library's call (the ctypes crossing and the Go side) and
    Python's packing and bookkeeping around it: the last call of each
    function, wall and thread CPU time."""

    def __init__(self, native: Any):
        self._native = native
        self._inner = native._call
        self.wall: dict[str, int] = {}
        self.cpu: dict[str, int] = {}

    def __enter__(self) -> "_CallTimer":
        inner, wall, cpu = self._inner, self.wall, self.cpu

        def timed(name: str, *args: Any, **kwargs: Any) -> Any:
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return inner(name, *args, **kwargs)
            finally:
                wall[name], cpu[name] = time.perf_counter_ns() - t0, time.thread_time_ns() - c0

        self._native._call = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        self._native._call = self._inner


def _ratios(times: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Each call's percentiles, with their ratios to the floor's p50."""
    figures = {name: percentiles(ns) for name, ns in times.items()}
    base = figures["floor"]["p50_us"] or 1e-3
    for fig in figures.values():
        fig["p50_per_floor"] = fig["p50_us"] / base
        fig["p99_per_floor"] = fig["p99_us"] / base
    return figures


def summary(report: dict) -> str:
    lines = [
        f"Python's hot path: {report['batches']} batches of {report['batch']} × {report['item_bytes']} B on {report['device']}, "
        f"loopback TCP to a consumer process; {report['cpus']} CPUs, load average {report['load_avg'][0]}"
        + (f"; a busy Python thread beside the calls (switch interval {report['switch_interval_us']:.0f} µs)" if report.get("busy_thread") else ""),
        f"  {'call':<14} {'p50 µs':>8} {'p99 µs':>8} {'max µs':>9} {'p50/floor':>10} {'p99/floor':>10}",
    ]
    blocks = [("", report["figures"])]
    if "cpu_figures" in report:
        blocks.append((" cpu", report["cpu_figures"]))
    for suffix, figures in blocks:
        for name, fig in figures.items():
            lines.append(
                f"  {name + suffix:<14} {fig['p50_us']:8.1f} {fig['p99_us']:8.1f} {fig['max_us']:9.1f} "
                f"{fig['p50_per_floor']:10.1f} {fig['p99_per_floor']:10.1f}"
            )
    what = "with the packed calls' 6 arguments" if report["floor"] == "ecm_noop" else "(this library has no ecm_noop)"
    gil = "keeping the GIL, as the packed calls do" if report.get("floor_holds_gil") else "releasing the GIL"
    lines.append(
        f"  (floor = one ctypes call of {report['floor']} {what}, {gil}; gil_released = the same call through "
        "the CDLL handle, which releases the GIL and takes it back; submit and hand_over per batch, "
        "timed around Producer.submit and Producer.sources, and their _call rows around the library call inside "
        "each (the ctypes crossing and the Go side; the rest of the method is Python's); the cpu rows are the calling thread's CPU time "
        "for the same calls, each ratio to the floor's)"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else summary(report))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
