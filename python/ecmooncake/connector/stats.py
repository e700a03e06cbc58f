"""Transfer statistics for vLLM's ``/metrics`` and its log line: what each
part records, how the TP ranks' records merge, and the Prometheus series."""

from __future__ import annotations

import math
import threading
from typing import Any


# --- statistics for vLLM's /metrics --------------------------------------------

# The series vLLM serves for this connector on its own /metrics, named as
# vLLM names its connectors' series (vllm:nixl_..., vllm:mooncake_...).
PROM_PREFIX = "vllm:ec_mooncake_"
SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
BYTES_BUCKETS = [float(1 << k) for k in range(16, 34, 2)]  # 64 KiB .. 4 GiB
# Observations a part keeps until vLLM reads them. A reader that never comes
# (vLLM's V1 model runner asks its workers for no stats) costs no more than this.
MAX_STAT_SAMPLES = 1 << 14
_MiB = float(1 << 20)


def _empty_stats() -> dict[str, Any]:
    # Plain lists, dicts and numbers: vLLM pickles the worker's stats to the
    # engine core and sends the data dict to its front end as msgpack.
    return {
        "push_seconds": [],  # per push: the encoder output handed over, to written on every shard
        "push_bytes": [],  # per push: the item's bytes
        "push_failures": 0,
        # Keyed by transfer id, so that the TP ranks of a consumer, which all
        # load the same item, count it once; a failure on any rank fails it.
        "load_bytes": {},
        "load_failures": [],
        "wait_seconds": [],  # per item: the request first asking for it, to its load handed to the workers
        "failed_requests": 0,  # requests failed for items that never arrived or never left
        # The Store tier's counters (ecmooncake.store.COUNTERS and
        # connector.tier.OWN_COUNTERS) that moved, by how much; TP ranks add up.
        "store": {},
    }


def _ms(values: list[float], quantile: float | None = None) -> float:
    if not values:
        return 0.0
    if quantile is None:
        return round(sum(values) / len(values) * 1e3, 3)
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(quantile * len(ordered)) - 1)] * 1e3, 3)


class _Stats:
    """Transfer statistics of one step, or of vLLM's logging interval.

    Bound to vLLM's ``ECConnectorStats`` as ``ECMooncakeConnectorStats``:
    vLLM merges the TP ranks' worker stats and the scheduler's with
    ``aggregate``, sends ``data`` to its front end, rebuilds it there with
    ``build_ec_connector_stats`` and logs ``reduce()`` every interval.
    """

    def __init__(self, data: dict[str, Any] | None = None):
        self.data = _empty_stats()
        if data:
            self._merge(data)

    def _merge(self, data: dict[str, Any]) -> None:
        d = self.data
        for key in ("push_seconds", "push_bytes", "wait_seconds"):
            d[key].extend(data.get(key) or ())
        for key in ("push_failures", "failed_requests"):
            d[key] += int(data.get(key) or 0)
        d["load_bytes"].update(data.get("load_bytes") or {})
        for key, n in (data.get("store") or {}).items():
            d["store"][key] = d["store"].get(key, 0) + int(n)
        known = set(d["load_failures"])
        d["load_failures"].extend(t for t in data.get("load_failures") or () if t not in known)

    def reset(self) -> None:
        self.data = _empty_stats()

    def aggregate(self, other: Any) -> Any:
        self._merge(other.data)
        return self

    def is_empty(self) -> bool:
        d = self.data
        return not any(d[key] for key in d)

    def loaded_bytes(self) -> list[int]:
        failed = set(self.data["load_failures"])
        return [n for tid, n in self.data["load_bytes"].items() if tid not in failed]

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {}
        # Only what happened: an encoder's line has no loads, a PD's no pushes.
        if d["push_seconds"] or d["push_failures"]:
            out["Num pushes"] = len(d["push_seconds"])
            out["Push MiB"] = round(sum(d["push_bytes"]) / _MiB, 3)
            out["Avg push time (ms)"] = _ms(d["push_seconds"])
            out["P90 push time (ms)"] = _ms(d["push_seconds"], 0.9)
            out["Num failed pushes"] = d["push_failures"]
        if d["load_bytes"] or d["load_failures"]:
            loaded = self.loaded_bytes()
            out["Num loads"] = len(loaded)
            out["Load MiB"] = round(sum(loaded) / _MiB, 3)
            out["Num failed loads"] = len(d["load_failures"])
        if d["wait_seconds"]:
            out["Avg wait (ms)"] = _ms(d["wait_seconds"])
            out["P90 wait (ms)"] = _ms(d["wait_seconds"], 0.9)
        if d["failed_requests"]:
            out["Num failed requests"] = d["failed_requests"]
        store = d["store"]
        if store:
            puts = store.get("put_ok", 0)
            out["Store puts"] = puts
            out["Store put MiB"] = round(store.get("put_bytes", 0) / _MiB, 3)
            not_put = sum(n for k, n in store.items() if k.startswith(("put_dropped", "put_skipped")) or k in ("put_error", "put_timeout"))
            out["Store puts not made"] = not_put
        return out


class _Recorder:
    """What one part of the connector observed since vLLM last asked."""

    def __init__(self) -> None:
        # The producer's copy thread records failures too.
        self._lock = threading.Lock()
        self._data = _empty_stats()
        self._count = 0

    def _note(self, **changes: Any) -> None:
        with self._lock:
            if self._count >= MAX_STAT_SAMPLES:
                self._data, self._count = _empty_stats(), 0
            self._count += 1
            for key, value in changes.items():
                slot = self._data[key]
                if isinstance(slot, list):
                    slot.append(value)
                elif key == "store":
                    for k, n in value.items():
                        slot[k] = slot.get(k, 0) + n
                elif isinstance(slot, dict):
                    slot.update(value)
                else:
                    self._data[key] = slot + value

    def pushed(self, seconds: float, nbytes: int) -> None:
        self._note(push_seconds=seconds, push_bytes=nbytes)

    def push_failed(self) -> None:
        self._note(push_failures=1)

    def loaded(self, transfer_id: str, nbytes: int) -> None:
        self._note(load_bytes={transfer_id: nbytes})

    def load_failed(self, transfer_id: str) -> None:
        self._note(load_failures=transfer_id)

    def waited(self, seconds: float) -> None:
        self._note(wait_seconds=seconds)

    def store(self, increments: dict[str, int]) -> None:
        if increments:
            self._note(store=increments)

    def requests_failed(self, count: int) -> None:
        if count:
            self._note(failed_requests=count)

    def drain_into(self, stats: _Stats) -> None:
        with self._lock:
            if not self._count:
                return  # the common step: nothing to hand over
            data, self._data, self._count = self._data, _empty_stats(), 0
        stats._merge(data)


class _PromMetrics:
    """The connector's series on vLLM's /metrics, labelled by engine.

    Bound to vLLM's ``ECConnectorPromMetrics``; vLLM's Prometheus logger
    calls ``observe`` with each step's stats data.
    """

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict[int, list[Any]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

        def histogram(name: str, documentation: str, buckets: list[float]) -> dict[int, Any]:
            return per_engine(self._histogram_cls(name=PROM_PREFIX + name, documentation=documentation, buckets=buckets, labelnames=labelnames))

        def counter(name: str, documentation: str) -> dict[int, Any]:
            return per_engine(self._counter_cls(name=PROM_PREFIX + name, documentation=documentation, labelnames=labelnames))

        self.push_time = histogram(
            "push_time_seconds",
            "Encoder: time from an encoder output's hand-over to its push written and completed on every consumer shard.",
            SECONDS_BUCKETS,
        )
        self.push_bytes = histogram("push_bytes", "Encoder: bytes of each encoder output pushed (each consumer shard gets a copy).", BYTES_BUCKETS)
        self.failed_pushes = counter("num_failed_pushes", "Encoder: pushes that failed.")
        self.load_bytes = histogram("load_bytes", "PD: bytes of each encoder output loaded into the encoder cache (TP ranks counted once).", BYTES_BUCKETS)
        self.failed_loads = counter("num_failed_loads", "PD: loads that failed on any TP rank.")
        self.wait_time = histogram(
            "wait_time_seconds",
            "PD: time from the scheduler first asking for a request's item to its load handed to the workers.",
            SECONDS_BUCKETS,
        )
        self.failed_requests = counter(
            "num_failed_requests", "Requests failed (retryable) because an encoder output did not arrive or could not be pushed."
        )
        # Labelled by event too, so kept as families and labelled when observed.
        self._labelvalues = per_engine_labelvalues
        self.store_events = self._counter_cls(
            name=PROM_PREFIX + "store_events",
            documentation="Mooncake Store tier: puts and gets by outcome (put_ok, put_dropped_full, put_skipped_device, "
            "get_hit, get_miss, get_timeout, ...; see docs/operations.md).",
            labelnames=labelnames + ["event"],
        )
        self.store_bytes = self._counter_cls(
            name=PROM_PREFIX + "store_bytes",
            documentation="Mooncake Store tier: bytes put (event put) and got (event get_hit).",
            labelnames=labelnames + ["event"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = _Stats(transfer_stats_data)
        d = stats.data
        for seconds in d["push_seconds"]:
            self.push_time[engine_idx].observe(seconds)
        for nbytes in d["push_bytes"]:
            self.push_bytes[engine_idx].observe(nbytes)
        for nbytes in stats.loaded_bytes():
            self.load_bytes[engine_idx].observe(nbytes)
        for seconds in d["wait_seconds"]:
            self.wait_time[engine_idx].observe(seconds)
        self.failed_pushes[engine_idx].inc(d["push_failures"])
        self.failed_loads[engine_idx].inc(len(d["load_failures"]))
        self.failed_requests[engine_idx].inc(d["failed_requests"])
        values = self._labelvalues.get(engine_idx)
        if values is None:
            return
        for event, n in d["store"].items():
            if n <= 0 or event == "fallbacks":
                continue
            if event in ("put_bytes", "get_hit_bytes"):
                self.store_bytes.labels(*values, "put" if event == "put_bytes" else "get_hit").inc(n)
            else:
                self.store_events.labels(*values, event).inc(n)
