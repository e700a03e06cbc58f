"""Worker processes that host a consumer shard or a producer, for the demo,
the benchmark and the tests.

Each worker is a child started with the *spawn* method: the parent may already
have loaded the library (a Go runtime does not survive fork), and in vLLM every
TP rank and the encoder are separate processes too. The parent drives a worker
with commands over a pipe; every wait on an answer has a deadline and notices
a worker that died, so a crashed child turns into a :class:`WorkerError`
instead of a hang.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
import traceback
from typing import Any

import numpy as np

from .native import Consumer, EcmError, Producer, configure, error_for, shared_slab

_POLL_S = 0.05


class WorkerError(RuntimeError):
    """A worker died, did not answer in time, or failed outside the library."""


def payload(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes for an item, each in 1..255.

    Zero never occurs, so a region that was reserved but never written (the
    slab starts zeroed) cannot pass verification.
    """
    words = np.random.PCG64(seed).random_raw((nbytes + 7) // 8)
    data = words.view(np.uint8)[:nbytes]
    np.maximum(data, 1, out=data)
    return data


def free_port_range(count: int, host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A base port such that base .. base+count-1 are all free on host now."""
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        if all(_port_free(host, base + i) for i in range(count)):
            return base
    raise WorkerError(f"no run of {count} free ports on {host} after {attempts} tries")


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

    def __init__(self, config: dict, slab_bytes: int, settings: dict | None = None):
        if settings:
            configure(**settings)
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
            return self.consumer.view(item["offset"], item["nbytes"]).tobytes()
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
                return {
                    "mm_hash": mm_hash,
                    "ok": False,
                    "error": f"size {got['nbytes']}, expected {nbytes}",
                }
            region = self.consumer.view(got["offset"], got["nbytes"])
            expected = payload(seed, nbytes)
            if np.array_equal(region, expected):
                return {"mm_hash": mm_hash, "ok": True, "error": ""}
            wrong = np.flatnonzero(region != expected)
            first = int(wrong[0])
            return {
                "mm_hash": mm_hash,
                "ok": False,
                "error": f"{wrong.size} of {nbytes} bytes differ, first at {first} "
                f"(got {int(region[first])}, expected {int(expected[first])})",
            }
        finally:
            self.consumer.release([mm_hash])

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

    def __init__(self, config: dict, settings: dict | None = None):
        if settings:
            configure(**settings)
        self.producer = Producer(config)
        self._filler = np.zeros(0, dtype=np.uint8)

    def ready(self) -> dict:
        return {"pid": os.getpid()}

    def op_stats(self) -> dict:
        return self.producer.stats()

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


_HOSTS = {"consumer": ConsumerHost, "producer": ProducerHost}

# Roles whose hosts keep their memory on a GPU. They live in gpubench, which
# imports torch, so they are looked up only in a worker that plays one.
_GPU_ROLES = {"gpu_consumer": "GPUConsumerHost", "gpu_producer": "GPUProducerHost"}


def _host_class(role: str) -> Any:
    if role in _GPU_ROLES:
        from . import gpubench

        return getattr(gpubench, _GPU_ROLES[role])
    return _HOSTS[role]


def _reply_error(conn: Any, exc: BaseException) -> None:
    if isinstance(exc, EcmError):
        conn.send(("ecm", exc.code, str(exc)))
    else:
        conn.send(("error", type(exc).__name__, "".join(traceback.format_exception(exc))))


def _serve(conn: Any, role: str, kwargs: dict) -> None:
    # The parent owns Ctrl-C: a terminal's SIGINT must not kill workers
    # before the parent has collected their answers and stopped them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        host = _host_class(role)(**kwargs)
        conn.send(("ok", host.ready()))
    except BaseException as exc:
        _reply_error(conn, exc)
        return
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            op = "stop"
        if op == "stop":
            break
        try:
            conn.send(("ok", getattr(host, "op_" + op)(**args)))
        except Exception as exc:
            _reply_error(conn, exc)
    try:
        host.close()
        conn.send(("ok", None))
    except Exception as exc:
        try:
            _reply_error(conn, exc)
        except OSError:
            pass


# --- parent side ------------------------------------------------------------


class Worker:
    """A spawned process hosting a ConsumerHost or ProducerHost.

    Use :meth:`call` for one command, or :meth:`send` then :meth:`result` to
    keep several workers busy at once.
    """

    def __init__(self, role: str, name: str, **kwargs: Any):
        if role not in _HOSTS and role not in _GPU_ROLES:
            raise ValueError(f"unknown role {role!r}")
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve, args=(child, role, kwargs), name=name, daemon=True
        )
        self._proc.start()
        child.close()
        self._op = "start"
        self._broken: str | None = None
        self.info: Any = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def wait_ready(self, timeout: float) -> Any:
        self.info = self.result(timeout)
        return self.info

    def call(self, op: str, timeout: float, **args: Any) -> Any:
        self.send(op, **args)
        return self.result(timeout)

    def send(self, op: str, **args: Any) -> None:
        if self._broken:
            raise WorkerError(f"{self.name}: unusable after {self._broken}")
        self._op = op
        try:
            self._conn.send((op, args))
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            self._broken = f"{op}: {exc}"
            raise WorkerError(self._death_note(op)) from exc

    def result(self, timeout: float) -> Any:
        op = self._op
        deadline = time.monotonic() + timeout
        while True:
            if self._conn.poll(_POLL_S):
                try:
                    message = self._conn.recv()
                except (EOFError, ConnectionResetError, OSError) as exc:
                    self._broken = f"{op}: pipe closed"
                    raise WorkerError(self._death_note(op)) from exc
                break
            if not self._proc.is_alive() and not self._conn.poll(0):
                self._broken = f"{op}: process exited"
                raise WorkerError(self._death_note(op))
            if time.monotonic() >= deadline:
                self._broken = f"{op}: no answer within {timeout:.1f}s"
                raise WorkerError(f"{self.name}: no answer to {op!r} within {timeout:.1f}s")
        status = message[0]
        if status == "ok":
            return message[1]
        if status == "ecm":
            raise error_for(message[1], f"{self.name}: {message[2]}")
        raise WorkerError(f"{self.name}: {op!r} raised {message[1]}:\n{message[2]}")

    def _death_note(self, op: str) -> str:
        self._proc.join(1.0)
        code = self._proc.exitcode
        how = f"exit status {code}" if code is None or code >= 0 else f"signal {-code}"
        return f"{self.name} (pid {self.pid}) died during {op!r} ({how})"

    def kill(self) -> None:
        if self._proc.is_alive():
            os.kill(self._proc.pid, signal.SIGKILL)
        self._proc.join(5.0)
        self._broken = self._broken or "kill"

    def stop(self, timeout: float = 10.0) -> None:
        """Closes the hosted object and ends the process; kills it if it hangs."""
        if self._proc.is_alive() and not self._broken:
            try:
                self.call("stop", timeout)
            except (WorkerError, EcmError):
                pass
        self._proc.join(timeout if self._proc.is_alive() else 0)
        if self._proc.is_alive():
            self.kill()
        self._conn.close()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def stop_all(workers: list[Worker], timeout: float = 10.0) -> None:
    """Stops every worker, even when some of them fail to stop."""
    for worker in workers:
        try:
            worker.stop(timeout)
        except Exception:
            worker.kill()


def report(name: str, run: Any, format_summary: Any, as_json: bool, plot_path: str | None = None) -> int:
    """Runs a tool's measurement and prints its summary, as text or JSON,
    and draws it into plot_path when given.

    Exit status: 0 when the summary says ok, 1 when it does not, 2 when the
    run could not finish (the reason goes to stderr).
    """
    import json
    import sys

    try:
        summary = run()
    except (EcmError, WorkerError, OSError, ValueError) as exc:
        print(f"ecmooncake {name}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2, sort_keys=True) if as_json else format_summary(summary))
    if plot_path:
        from . import plot

        print(f"ecmooncake {name}: plot written to {plot.write(summary, plot_path)}", file=sys.stderr)
    return 0 if summary["ok"] else 1
