"""``ECMooncakeConnector``: vLLM's encoder-cache connector over the native core.

One class serves both roles vLLM gives a connector:

* **scheduler role** (the engine-core process). On a consumer (prefill/decode)
  instance it owns a native :class:`~ecmooncake.native.Scheduler`, whose
  background goroutines keep a transfer table current from the shards'
  readiness events. ``has_cache_item`` and ``ensure_cache_available``
  answer from memory while the table's generation (a counter the library
  keeps current in this process's memory) stands, and with one
  non-blocking call for every waiting request when it moved. Everything else a step needs
  (expectations, load outcomes, frees, finished requests, new loads) goes in
  one ``step()`` call from ``build_connector_meta``. On a producer (encoder)
  instance it is plain bookkeeping: which pushes to announce, and what
  ``request_finished`` tells the proxy.
* **worker role** (each GPU worker). A consumer rank on the first pipeline
  stage owns a native :class:`~ecmooncake.native.Consumer` over a slab and
  puts zero-copy views of arrived items into the engine's encoder cache; the
  producer owns a native :class:`~ecmooncake.native.Producer` that reserves
  space on every consumer shard before the encoder runs and writes the
  output once it exists.

Failures never reach vLLM's engine loop: every hook catches, logs one line
naming the item, the peer and the cause, and turns the failure into a
retryable error of the request concerned (``take_unavailable_requests``).

``update_state_after_free`` is left to the base class on purpose: a request
releasing its reference says nothing about the bytes, which are freed when
the scheduler evicts the entry (``free_encoder_mm_hashes``).

Importing this module imports neither vLLM nor torch, because importing
vLLM starts threads and this package promises imports that start nothing.
The classes vLLM sees (``ECMooncakeConnector`` and its metadata) subclass
vLLM's bases and are assembled from the implementations below on first
attribute access, which is what vLLM's factory and pickle do.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import ec_config
from .native import Consumer, EcmError, Producer, Scheduler, configure, shared_slab

# A child of vLLM's logger, so that these lines carry vLLM's format and obey
# VLLM_LOGGING_LEVEL; a logger outside that tree has no handler in vLLM.
logger = logging.getLogger("vllm.ecmooncake")

CONNECTOR_NAME = "ECMooncakeConnector"
# The same class under a name vLLM's factory does not register, for
# ec_connector_module_path: the factory ignores the module path for names
# it knows, and recent vLLM knows ECMooncakeConnector as its own.
MODULE_PATH_NAME = "EcmooncakeConnector"

# Hooks that only some vLLM releases call, with what their absence costs;
# the connector adapts where it can (see _Connector) and says so at startup.
OPTIONAL_HOOKS = {
    "ensure_cache_available": "requests are scheduled before their items arrive",
    "start_save_caches": "pushes are announced when the step's metadata is bound",
    "start_worker_services": "consumer shards start listening at the first step",
    "take_unavailable_requests": "a request whose items never arrive is not failed",
    "build_connector_worker_meta": "load and push outcomes do not reach the scheduler",
    "has_pending_push_work": "an idle engine may sit on pushes in flight",
    "get_ec_connector_stats": "transfer statistics stay off vLLM's /metrics (metrics_port still serves the library's)",
}

# dtypes an item's description may name; anything else from the wire is
# refused rather than looked up on the torch module.
DTYPES = (
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
)


# --- metadata ----------------------------------------------------------------


@dataclass
class LoadSpec:
    """One item a consumer worker puts into its encoder cache this step."""

    mm_hash: str
    transfer_id: str
    num_embeds: int
    modality: str
    # Set when the scheduler could not hand out a transfer: the worker must
    # still fill the entry (vLLM gathers it) and the request is failed.
    error: str = ""


@dataclass
class PushSpec:
    """One push a producer worker announces before its encoder runs."""

    transfer_id: str
    mm_hash: str
    consumer: str
    request_id: str
    modality: str
    # Known ahead only when the engine measured the encoder's output width;
    # otherwise the push is sized from the tensor when it exists.
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int | None:
        if self.dtype is None or self.shape is None:
            return None
        return math.prod(self.shape) * _itemsize(self.dtype)

    def describe(self) -> str:
        return json.dumps({"dtype": self.dtype, "shape": list(self.shape or ())}, separators=(",", ":"))


@dataclass
class _StepMetadata:
    """Scheduler → workers, once per step."""

    # No list of freed items: vLLM's runner drops freed entries from its
    # encoder cache before the connector's hooks run, and a worker releases
    # whatever it loaded that is no longer there, even in steps whose
    # metadata never reached it.
    loads: list[LoadSpec] = field(default_factory=list)
    pushes: list[PushSpec] = field(default_factory=list)


@dataclass
class _WorkerReport:
    """Workers → scheduler, once per step; merged across TP ranks."""

    loaded: set[str] = field(default_factory=set)  # transfer ids
    failed_loads: dict[str, str] = field(default_factory=dict)  # transfer id -> cause
    pushes_done: set[str] = field(default_factory=set)
    pushes_failed: dict[str, str] = field(default_factory=dict)
    pending_pushes: bool = False

    def aggregate(self, other: Any) -> Any:
        # Every TP rank gathers from its own encoder cache, so an item is
        # loaded only where every rank has it; one rank's failure fails it.
        return type(self)(
            loaded=self.loaded & other.loaded,
            failed_loads={**self.failed_loads, **other.failed_loads},
            pushes_done=self.pushes_done | other.pushes_done,
            pushes_failed={**self.pushes_failed, **other.pushes_failed},
            pending_pushes=self.pending_pushes or other.pending_pushes,
        )


# --- helpers -----------------------------------------------------------------


def _torch():
    import torch

    return torch


def _itemsize(dtype: str) -> int:
    return getattr(_torch(), dtype).itemsize


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class _Throttle:
    """Logs a repeated failure of one kind at most once per interval."""

    def __init__(self, interval_s: float = 10.0):
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._muted: dict[str, int] = {}

    def warn(self, key: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self._interval) < self._interval:
            self._muted[key] = self._muted.get(key, 0) + 1
            return
        muted = self._muted.pop(key, 0)
        self._last[key] = now
        if muted:
            message += " (%d similar lines muted)"
            args = (*args, muted)
        logger.warning(message, *args)


_throttle = _Throttle()


def _guarded(default: Callable[[], Any]) -> Callable:
    """Runs a hook so that no exception reaches vLLM's engine loop."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                _throttle.warn(
                    "hook:" + fn.__name__,
                    "ecmooncake: %s failed, carrying on without it: %s: %s",
                    fn.__name__,
                    type(exc).__name__,
                    exc,
                )
                return default()

        return hook

    return wrap


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


# How long shutdown waits for a native object to close. The library's close
# waits for control round trips in flight, each up to control_timeout_s, and
# vLLM's shutdown should not; the object (and any memory the library may
# still read) stays referenced by the closing thread until it is done.
CLOSE_WAIT_S = 2.0


def _close_bounded(native: Any) -> None:
    closer = threading.Thread(target=native.close, name="ecmooncake-close", daemon=True)
    closer.start()
    closer.join(CLOSE_WAIT_S)
    if closer.is_alive():
        logger.info("ecmooncake: %s still closing in the background (control calls in flight)", native.kind)


_configure_lock = threading.Lock()
_configured = False


def _configure_process(cfg: ec_config.ECMooncakeConfig, worker: bool) -> None:
    """Process-wide library settings, once, before the first native object."""
    global _configured
    with _configure_lock:
        if not _configured:
            configure(**cfg.process_settings(worker))
            _configured = True


def consumer_address(params: Any) -> str | None:
    """The consumer control endpoint an encoder request names, if any.

    The in-tree connector's proxies send ``consumer_zmq``; ours ``consumer``.
    """
    if not isinstance(params, dict):
        return None
    raw = params.get("consumer") or params.get("consumer_zmq")
    if not isinstance(raw, str) or not raw:
        return None
    return raw if "://" in raw else "tcp://" + raw


def transfer_ids(request: Any) -> list[str | None]:
    """The transfer id of each multimodal item of a request, or None.

    ``ec_transfer_params["ec_items"][i]`` belongs to item i when it names no
    mm_hash or the item's own; otherwise the entry naming the item's mm_hash
    does. Proxies that merge the encoder's ``request_finished`` answer into
    the params put it under the item's identifier, which is accepted too.
    """
    params = getattr(request, "ec_transfer_params", None)
    features = getattr(request, "mm_features", None) or []
    if not isinstance(params, dict):
        return [None] * len(features)
    items = params.get("ec_items")
    items = [it for it in items if isinstance(it, dict)] if isinstance(items, list) else []
    by_hash = {str(it["mm_hash"]): it["transfer_id"] for it in items if it.get("mm_hash") and it.get("transfer_id")}
    out: list[str | None] = []
    for index, feature in enumerate(features):
        ident = feature.identifier
        tid = None
        if index < len(items):
            it = items[index]
            if it.get("mm_hash") in (None, "", ident) and it.get("transfer_id"):
                tid = it["transfer_id"]
        if tid is None:
            tid = by_hash.get(ident)
        if tid is None and isinstance(params.get(ident), dict):
            tid = params[ident].get("transfer_id")
        out.append(str(tid) if tid else None)
    return out


def _num_embeds(request: Any, index: int) -> int:
    if hasattr(request, "get_num_encoder_embeds"):
        return int(request.get_num_encoder_embeds(index))
    return int(request.get_num_encoder_tokens(index))


def _unconsumed(request: Any, index: int, num_computed_tokens: int) -> bool:
    pos = request.mm_features[index].mm_position
    return pos.offset + pos.length > num_computed_tokens


# --- scheduler side: consumer ------------------------------------------------


@dataclass
class _Expected:
    index: int
    transfer_id: str
    mm_hash: str


@dataclass
class _LoadPlan:
    num_embeds: int
    modality: str
    requests: set[str] = field(default_factory=set)


@dataclass
class _Inflight:
    mm_hash: str
    requests: set[str]
    deadline: float


class _ConsumerScheduler:
    """Consumer instance, engine core: what may load, from Go-side state."""

    def __init__(self, cfg: ec_config.ECMooncakeConfig, ensure_hook: bool):
        self._cfg = cfg
        # Without ensure_cache_available (older vLLM) expectations are
        # registered from update_state_after_alloc instead.
        self._ensure_hook = ensure_hook
        self._load_timeout_s = float(cfg.value("load_timeout_s"))
        _configure_process(cfg, worker=False)
        self._native = Scheduler(cfg.scheduler_settings())
        self._requests: dict[str, list[_Expected]] = {}
        self._registered: set[str] = set()
        self._refused: set[str] = set()
        self._to_register: dict[str, list[_Expected]] = {}
        # What the engine holds in its encoder cache, from alloc and free
        # notices: such items need nothing from the network.
        self._local: set[str] = set()
        self._said_yes: set[str] = set()
        self._to_load: dict[str, _LoadPlan] = {}
        self._inflight: dict[str, _Inflight] = {}
        self._loading: dict[str, str] = {}  # mm_hash -> transfer id in flight
        self._reports: list[dict[str, Any]] = []
        self._freed: list[str] = []
        self._deferred_free: set[str] = set()
        self._finished: list[str] = []
        self._unavailable: set[str] = set()
        # Answers remembered at one generation of the native table, which
        # the library keeps current in _counter: vLLM asks the same
        # questions for every waiting request on every schedule pass, and
        # while the generation stands the answers do (sched.Generation).
        self._counter = self._native.generation_counter
        self._at = -1  # the generation of _has and _failed; -1: none
        # mm_hash -> has_cache_item's answer at _at: every item of every
        # registered request after a snapshot, and hashes asked one by one.
        self._has: dict[str, bool] = {}
        # request id -> failures at _at, for every registered request
        # (absent: none) when _at comes from a snapshot.
        self._failed: dict[str, list[dict[str, Any]]] = {}
        self.recorder = _Recorder()
        # mm_hash -> when a request first asked for it, for the wait statistic.
        self._asked_at: dict[str, float] = {}

    @property
    def endpoints(self) -> str:
        return self._cfg.consumer_endpoint

    def _expected(self, request: Any) -> list[_Expected]:
        rid = request.request_id
        items = self._requests.get(rid)
        if items is None:
            items = [
                _Expected(i, tid, request.mm_features[i].identifier)
                for i, tid in enumerate(transfer_ids(request))
                if tid is not None
            ]
            self._requests[rid] = items
            now = time.monotonic()
            for it in items:
                self._asked_at.setdefault(it.mm_hash, now)
        return items

    def has_cache_item(self, identifier: str) -> bool:
        generation = self._counter.value
        found = self._has.get(identifier) if generation == self._at else None
        if found is None:
            found = self._native.has(identifier)
            if generation != self._at:
                self._at, self._has, self._failed = -1, {}, {}
            else:
                self._has[identifier] = found
        if found:
            self._said_yes.add(identifier)
        return found

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        rid = request.request_id
        if rid in self._refused or rid in self._unavailable:
            return False
        items = self._expected(request)
        remaining = {
            it.mm_hash
            for it in items
            if it.mm_hash not in self._local and _unconsumed(request, it.index, num_computed_tokens)
        }
        if not remaining:
            return True
        if rid not in self._registered:
            if not self._register(rid, items):
                return False
        elif self._counter.value != self._at:
            self._take(self._native.step({"snapshot": True}))
        has = self._has
        failed = [f for f in self._failed.get(rid) or () if f.get("mm_hash") in remaining and not has.get(f.get("mm_hash"))]
        if failed:
            for f in failed:
                logger.warning(
                    "ecmooncake: request %s fails (retryable): item %s (transfer %s) from consumer %s: %s",
                    rid,
                    f.get("mm_hash"),
                    f.get("transfer_id"),
                    self.endpoints,
                    f.get("reason"),
                )
            self._unavailable.add(rid)
            return False
        return all(has.get(h) for h in remaining)

    def _register(self, rid: str, items: list[_Expected]) -> bool:
        """Registers a new request and learns its answer in one native step.
        When the remembered answers were current up to this step, the step's
        own answer for the request's contents brings them up to date
        (registering one request changes no other answer but those of its
        contents); otherwise the step also takes a snapshot of every answer.
        False when the step refused the registration."""
        current = self._counter.value == self._at
        body: dict[str, Any] = {
            "expect": [self._expect_entry(rid, items)],
            "ensure": [rid],
            "has": sorted({it.mm_hash for it in items}),
        }
        if not current:
            body["snapshot"] = True
        out = self._native.step(body)
        if self._note_expect_errors(out):
            return False
        self._registered.add(rid)
        if current and out.get("since") == self._at:
            self._has.update(out.get("has") or {})
            failed = ((out.get("ensure") or {}).get(rid) or {}).get("failed")
            if failed:
                self._failed[rid] = failed
            self._at = int(out.get("generation", -1))
        else:
            self._take(out if "snapshot" in body else self._native.step({"snapshot": True}))
        return True

    def _take(self, out: dict[str, Any]) -> None:
        """Remembers a snapshot: every registered request's answers."""
        covered = set(out.get("covered") or ())
        self._has = {it.mm_hash: it.mm_hash in covered for r in self._registered for it in self._requests.get(r) or ()}
        self._failed = out.get("failed") or {}
        # Registration moves the generation, so a snapshot covers every
        # request registered before it was taken.
        self._at = int(out.get("generation", -1))

    @staticmethod
    def _expect_entry(rid: str, items: list[_Expected]) -> dict[str, Any]:
        return {"request_id": rid, "items": [{"transfer_id": it.transfer_id, "mm_hash": it.mm_hash} for it in items]}

    def _note_expect_errors(self, out: dict[str, Any]) -> bool:
        errors = out.get("expect_errors") or {}
        for rid, reason in errors.items():
            logger.warning(
                "ecmooncake: request %s refused (retryable with new transfer ids) by consumer %s: %s",
                rid,
                self.endpoints,
                reason,
            )
            self._refused.add(rid)
            self._unavailable.add(rid)
        return bool(errors)

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        feature = request.mm_features[index]
        self._local.add(feature.identifier)
        rid = request.request_id
        if not self._ensure_hook and rid not in self._registered:
            items = self._expected(request)
            if items:
                self._to_register[rid] = items
        if feature.identifier in self._said_yes:
            plan = self._to_load.get(feature.identifier)
            if plan is None:
                plan = _LoadPlan(_num_embeds(request, index), feature.modality)
                self._to_load[feature.identifier] = plan
            plan.requests.add(rid)

    def build(self, scheduler_output: Any, meta: _StepMetadata) -> None:
        now = time.monotonic()
        for tid, inflight in list(self._inflight.items()):
            if inflight.deadline <= now:
                # No report will come (a step whose worker output was lost);
                # the table's own load deadline has failed the transfer.
                self._drop_inflight(tid)
        for h in getattr(scheduler_output, "free_encoder_mm_hashes", None) or ():
            self._local.discard(h)
            # A free that overtakes its load's report (async scheduling)
            # waits for it: the table moves only loaded items to resident.
            if h in self._loading:
                self._deferred_free.add(h)
            else:
                self._freed.append(h)
        plans, self._to_load = self._to_load, {}
        self._said_yes.clear()
        body: dict[str, Any] = {}
        if self._to_register:
            body["expect"] = [self._expect_entry(rid, items) for rid, items in self._to_register.items()]
        if self._reports:
            body["loaded"] = self._reports
        if self._freed:
            body["freed"] = self._freed
        if self._finished:
            body["finished"] = self._finished
        if plans:
            body["load"] = list(plans)
        registering = list(self._to_register)
        self._to_register, self._reports, self._freed, self._finished = {}, [], [], []
        if not body:
            return
        try:
            out = self._native.step(body)
        except EcmError as exc:
            out = {"load": [{"mm_hash": h, "error": f"scheduler step failed: {exc}"} for h in plans]}
        self._note_expect_errors(out)
        self._registered.update(r for r in registering if r not in self._refused)
        deadline = now + self._load_timeout_s
        answered = {lo.get("mm_hash"): lo for lo in out.get("load") or ()}
        for h, plan in plans.items():
            lo = answered.get(h) or {"error": "no answer from the scheduler step"}
            tid = lo.get("transfer_id") or ""
            error = lo.get("error") or ("" if tid else "no transfer to load")
            if error:
                logger.warning(
                    "ecmooncake: load of %s for requests %s from consumer %s cannot start: %s",
                    h,
                    sorted(plan.requests),
                    self.endpoints,
                    error,
                )
                self._unavailable |= plan.requests
            else:
                self._inflight[tid] = _Inflight(h, plan.requests, deadline)
                self._loading[h] = tid
                asked = self._asked_at.pop(h, None)
                if asked is not None:
                    self.recorder.waited(now - asked)
            meta.loads.append(LoadSpec(h, tid, plan.num_embeds, plan.modality, error))

    def _drop_inflight(self, tid: str) -> _Inflight | None:
        inflight = self._inflight.pop(tid, None)
        if inflight is not None and self._loading.get(inflight.mm_hash) == tid:
            del self._loading[inflight.mm_hash]
            if inflight.mm_hash in self._deferred_free:
                self._deferred_free.discard(inflight.mm_hash)
                self._freed.append(inflight.mm_hash)
        return inflight

    def update_connector_output(self, report: _WorkerReport) -> None:
        for tid, reason in report.failed_loads.items():
            inflight = self._drop_inflight(tid)
            self._reports.append({"transfer_id": tid, "ok": False, "reason": reason})
            if inflight is not None:
                self._unavailable |= inflight.requests
        for tid in report.loaded - report.failed_loads.keys():
            self._drop_inflight(tid)
            self._reports.append({"transfer_id": tid, "ok": True})

    def request_finished(self, request: Any) -> None:
        rid = request.request_id
        for it in self._requests.pop(rid, None) or ():
            self._asked_at.pop(it.mm_hash, None)
        self._to_register.pop(rid, None)
        self._refused.discard(rid)
        self._unavailable.discard(rid)
        if rid in self._registered:
            self._registered.discard(rid)
            self._finished.append(rid)

    def fail(self, request_id: str, reason: str) -> None:
        """Fails a request (retryable) through take_unavailable_requests."""
        if request_id not in self._unavailable:
            logger.warning("ecmooncake: request %s fails (retryable) at consumer %s: %s", request_id, self.endpoints, reason)
        self._unavailable.add(request_id)

    def take_unavailable(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def has_pending_work(self) -> bool:
        # Outcomes, frees and finished requests reach the table with the next
        # step; asking for one keeps an otherwise idle engine from sitting on
        # them (cancels of finished requests free slab space on the shards).
        return bool(self._reports or self._freed or self._finished or self._to_register)

    def stats(self) -> dict[str, Any]:
        return self._native.stats()

    def close(self) -> None:
        # The counter stops once closed: no remembered answer outlives it.
        self._at, self._has, self._failed = -1, {}, {}
        _close_bounded(self._native)


# --- scheduler side: producer ------------------------------------------------


class _ProducerScheduler:
    """Encoder instance, engine core: announces pushes, answers the proxy."""

    def __init__(self, cfg: ec_config.ECMooncakeConfig, vllm_config: Any):
        self._vllm_config = vllm_config
        model_config = getattr(vllm_config, "model_config", None)
        dtype = getattr(model_config, "dtype", None)
        self._dtype = _dtype_name(dtype) if dtype is not None and _dtype_name(dtype) in DTYPES else None
        self._model_config = model_config
        self._resolver: Any = None
        self._widths: dict[str, int | None] = {}
        self._prepared: dict[str, PushSpec] = {}
        self._by_request: dict[str, list[str]] = {}
        self._new: list[PushSpec] = []
        self._unavailable: set[str] = set()
        self._pending = False

    def _width(self, modality: str) -> int | None:
        if modality not in self._widths:
            width = None
            try:
                from vllm.distributed.ec_transfer.ec_connector.encoder_output_width import (
                    get_encoder_output_width,
                )

                width = int(get_encoder_output_width(self._vllm_config, modality))
            except (ImportError, ValueError, AssertionError) as exc:
                logger.info(
                    "ecmooncake: no measured encoder output width for %s (%s); "
                    "its pushes reserve space once the encoder output exists",
                    modality,
                    exc,
                )
            self._widths[modality] = width
        return self._widths[modality]

    def prepare(self, request: Any, index: int) -> None:
        consumer = consumer_address(getattr(request, "ec_transfer_params", None))
        if consumer is None:
            return
        rid = request.request_id
        tid = transfer_ids(request)[index]
        if tid is None:
            # The proxy still learns this id from request_finished and can
            # hand it to the consumer.
            tid = f"{rid}:{index}"
            _throttle.warn(
                "no-transfer-id",
                "ecmooncake: request %s item %d names no transfer_id in ec_items; using %s",
                rid,
                index,
                tid,
            )
        if tid in self._prepared:
            return
        feature = request.mm_features[index]
        width = self._width(feature.modality)
        spec = PushSpec(tid, feature.identifier, consumer, rid, feature.modality)
        if width is not None and self._dtype is not None:
            spec.dtype = self._dtype
            spec.shape = (_num_embeds(request, index), width)
        self._prepared[tid] = spec
        self._by_request.setdefault(rid, []).append(tid)
        self._new.append(spec)

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> None:
        # Items the encoder cache already holds never reach
        # update_state_after_alloc, so pushes are prepared here as well.
        for index in range(len(request.mm_features)):
            if _unconsumed(request, index, num_computed_tokens):
                self.prepare(request, index)

    def build(self, meta: _StepMetadata) -> None:
        meta.pushes, self._new = self._new, []

    def update_connector_output(self, report: _WorkerReport) -> None:
        self._pending = report.pending_pushes
        for tid, reason in report.pushes_failed.items():
            spec = self._prepared.get(tid)
            if spec is None:
                logger.warning("ecmooncake: push %s failed after its request finished: %s", tid, reason)
                continue
            logger.warning(
                "ecmooncake: request %s fails (retryable): push of %s (transfer %s) to %s: %s",
                spec.request_id,
                spec.mm_hash,
                tid,
                spec.consumer,
                reason,
            )
            self._unavailable.add(spec.request_id)

    def request_finished(self, request: Any) -> dict[str, Any] | None:
        rid = request.request_id
        specs = {}
        for tid in self._by_request.pop(rid, ()):
            spec = self._prepared.pop(tid, None)
            if spec is not None:
                specs[tid] = spec
        self._unavailable.discard(rid)
        features = getattr(request, "mm_features", None) or []
        if not features:
            return None
        items = self._item_metadata(features)
        for index, tid in enumerate(transfer_ids(request)):
            ident = features[index].identifier
            entry = items[ident]
            if tid is None:
                tid = f"{rid}:{index}" if f"{rid}:{index}" in specs else None
            spec = specs.get(tid) if tid else None
            if tid:
                entry["transfer_id"] = tid
            entry["mm_hash"] = ident
            if spec is not None and spec.shape is not None:
                entry.update(dtype=spec.dtype, shape=list(spec.shape), nbytes=spec.nbytes)
        return items

    def _item_metadata(self, features: list[Any]) -> dict[str, dict[str, Any]]:
        if self._model_config is not None:
            try:
                from vllm.distributed.ec_transfer.ec_connector.utils import (
                    PlaceholderMetadataResolver,
                    collect_ec_item_metadata,
                )

                if self._resolver is None:
                    self._resolver = PlaceholderMetadataResolver(self._model_config)
                items = collect_ec_item_metadata(features, self._resolver)
            except ImportError:
                items = None
        else:
            items = None
        if items is None:
            items = {}
            for index, feature in enumerate(features):
                items.setdefault(feature.identifier, {"item_indices": []})["item_indices"].append(index)
        for feature in features:
            entry = items[feature.identifier]
            # vLLM 0.32's helper leaves modality out (0.33 fills it in); the
            # proxy needs it to choose the embeds part for the PD request.
            entry.setdefault("modality", feature.modality)
            entry.setdefault("metadata", {})
        return items

    def take_unavailable(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def has_pending_work(self) -> bool:
        return bool(self._pending or self._new)


# --- worker side: consumer ---------------------------------------------------


def _require_cuda(device: str) -> None:
    """Refuses a GPU receive buffer on a host where torch sees no GPU, at
    startup and naming the setting; vLLM's default ec_buffer_device is
    "cuda", so this is the first thing a CPU-only PD instance meets."""
    torch = _torch()
    if torch.cuda.is_available():
        return
    raise ec_config.ConfigError(
        f"ECMooncakeConnector: ec_buffer_device = {device!r} (vLLM's default is 'cuda'), but this "
        f"process has no usable CUDA device (torch.cuda.is_available() is False); on a host "
        f'without a GPU add "ec_buffer_device": "cpu" to --ec-transfer-config'
    )


class _ConsumerWorker:
    """One consumer TP rank: a slab, a native Consumer, zero-copy loads."""

    def __init__(self, cfg: ec_config.ECMooncakeConfig, vllm_config: Any):
        self._cfg = cfg
        self.receiving = cfg.topology.first_pp_stage
        if self.receiving and cfg.buffer_device.startswith("cuda"):
            _require_cuda(cfg.buffer_device)
        self._native: Consumer | None = None
        self._slab: Any = None
        self._device: Any = None
        self._held: set[str] = set()
        self._loaded: set[str] = set()
        self._failed: dict[str, str] = {}
        model_config = getattr(vllm_config, "model_config", None)
        self._fallback_width = None
        self._fallback_dtype = None
        if model_config is not None:
            try:
                self._fallback_width = int(model_config.get_hidden_size())
                self._fallback_dtype = _dtype_name(model_config.dtype)
            except Exception:
                pass
        # The (dtype, width) last seen per modality: sizes a stand-in entry
        # for an item that could not be loaded (see _stand_in).
        self._seen: dict[str, tuple[str, int]] = {}

    @property
    def endpoint(self) -> str:
        t = self._cfg.topology
        return f"{self._cfg.ec_ip}:{self._cfg.ec_port + t.dp_rank * t.tp_size + t.tp_rank}"

    def start(self) -> None:
        if not self.receiving or self._native is not None:
            return
        torch = _torch()
        device = self._cfg.buffer_device
        settings = self._cfg.consumer_settings()
        if device.startswith("cuda"):
            # The data plane writes host memory; until GPU slabs land, items
            # arrive in pinned host memory and are copied to the GPU at load.
            self._device = torch.device(device if ":" in device else f"cuda:{torch.cuda.current_device()}")
            slab = torch.empty(self._cfg.buffer_size, dtype=torch.uint8, pin_memory=True)
            logger.info(
                "ecmooncake: ec_buffer_device=%s: receiving into %d bytes of pinned host memory, copied to %s at load",
                device,
                self._cfg.buffer_size,
                self._device,
            )
        elif self._cfg.value("transport") == "shm":
            # The shard hands the slab's memfd to producers on this host.
            shared, settings["slab_fd"] = shared_slab(self._cfg.buffer_size)
            slab = torch.from_numpy(shared)
        else:
            slab = torch.empty(self._cfg.buffer_size, dtype=torch.uint8)
        # Touch every page now, so that first writes do not pay page faults
        # inside a timed transfer.
        slab.zero_()
        _configure_process(self._cfg, worker=True)
        self._native = Consumer(settings, slab)
        self._slab = slab
        logger.info("ecmooncake: consumer shard listening at %s", self._native.info().get("control"))

    def load(self, meta: _StepMetadata, encoder_cache: dict[str, Any]) -> None:
        if not self.receiving:
            return
        if self._native is None:
            try:
                self.start()
            except Exception as exc:
                for spec in meta.loads:
                    self._fail(spec, encoder_cache, f"consumer shard cannot start: {exc}")
                return
        gone = [h for h in self._held if h not in encoder_cache]
        if gone:
            self._held.difference_update(gone)
            try:
                released = self._native.release(gone)
            except EcmError as exc:
                released = [{"mm_hash": h, "error": str(exc)} for h in gone]
            for item in released:
                if item.get("error"):
                    _throttle.warn("release", "ecmooncake: release of %s at shard %s: %s", item["mm_hash"], self.endpoint, item["error"])
        wanted: list[LoadSpec] = []
        for spec in meta.loads:
            if spec.mm_hash in encoder_cache:
                if spec.transfer_id:
                    self._loaded.add(spec.transfer_id)
            else:
                wanted.append(spec)
        if not wanted:
            return
        try:
            self._load(wanted, encoder_cache)
        except Exception as exc:
            # vLLM treats a missing entry as fatal: whatever went wrong, each
            # wanted item gets its tensor or a stand-in, and a failure.
            for spec in wanted:
                if spec.mm_hash not in encoder_cache:
                    self._fail(spec, encoder_cache, f"load failed: {type(exc).__name__}: {exc}")

    def _load(self, wanted: list[LoadSpec], encoder_cache: dict[str, Any]) -> None:
        try:
            acquired = self._native.acquire([s.mm_hash for s in wanted])
        except EcmError as exc:
            acquired = [{"error": str(exc)}] * len(wanted)
        if not isinstance(acquired, list):
            acquired = []
        by_hash = {item.get("mm_hash"): item for item in acquired if isinstance(item, dict) and item.get("mm_hash")}
        for index, spec in enumerate(wanted):
            # Answers come in the order asked; one that names its hash is
            # matched by it, and a missing answer is a failure, not a skip.
            item = by_hash.get(spec.mm_hash)
            if item is None:
                item = acquired[index] if index < len(acquired) and isinstance(acquired[index], dict) else None
            if item is None:
                self._fail(spec, encoder_cache, "the shard did not answer for this item")
                continue
            if item.get("error"):
                self._fail(spec, encoder_cache, item["error"] if not spec.error else f"{spec.error}; {item['error']}")
                continue
            try:
                tensor = self._view(spec, item)
            except (ValueError, TypeError, RuntimeError, KeyError) as exc:
                self._release_quietly(spec.mm_hash)
                self._fail(spec, encoder_cache, f"bad item description {item.get('meta')!r}: {type(exc).__name__}: {exc}")
                continue
            encoder_cache[spec.mm_hash] = tensor
            self._held.add(spec.mm_hash)
            if spec.error:
                # The shard had it although the scheduler could not name a
                # transfer; the request is failed already, the entry is real.
                continue
            self._loaded.add(spec.transfer_id)

    def _release_quietly(self, mm_hash: str) -> None:
        try:
            self._native.release([mm_hash])
        except Exception as exc:
            _throttle.warn("release", "ecmooncake: release of %s at shard %s: %s", mm_hash, self.endpoint, exc)

    def _view(self, spec: LoadSpec, item: dict[str, Any]) -> Any:
        torch = _torch()
        desc = json.loads(item.get("meta") or "{}")
        name = desc.get("dtype")
        shape = desc.get("shape")
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and d > 0 for d in shape)):
            raise ValueError(f"shape {shape!r} is not two positive integers")
        dtype = getattr(torch, name)
        nbytes = int(item["nbytes"])
        if math.prod(shape) * dtype.itemsize != nbytes:
            raise ValueError(f"{shape} x {name} is not {nbytes} bytes")
        if spec.num_embeds and shape[0] != spec.num_embeds:
            raise ValueError(f"{shape[0]} embeddings, the request places {spec.num_embeds}")
        offset = int(item["offset"])
        view = self._slab[offset : offset + nbytes].view(dtype).view(shape[0], shape[1])
        self._seen[spec.modality] = (name, shape[1])
        if self._device is not None:
            # The host region stays pinned until vLLM frees the entry, by
            # which time the step that consumed this copy has completed.
            return view.to(self._device, non_blocking=True)
        return view

    def _fail(self, spec: LoadSpec, encoder_cache: dict[str, Any], reason: str) -> None:
        logger.warning(
            "ecmooncake: load of %s (transfer %s) at shard %s failed: %s",
            spec.mm_hash,
            spec.transfer_id or "-",
            self.endpoint,
            reason,
        )
        if spec.transfer_id:
            self._failed[spec.transfer_id] = reason
        self._stand_in(spec, encoder_cache)

    def _stand_in(self, spec: LoadSpec, encoder_cache: dict[str, Any]) -> None:
        """Fills the entry of an item that could not be loaded with zeros.

        vLLM has already scheduled the step that gathers it, and a missing
        entry is a fatal error of the engine; the request itself is failed
        through take_unavailable_requests, so nothing reads the zeros.
        """
        dtype, width = self._seen.get(spec.modality, (self._fallback_dtype, self._fallback_width))
        if dtype is None or width is None or spec.num_embeds <= 0:
            logger.error(
                "ecmooncake: no stand-in for %s: its width is unknown; the engine will miss it",
                spec.mm_hash,
            )
            return
        torch = _torch()
        device = self._device if self._device is not None else "cpu"
        encoder_cache[spec.mm_hash] = torch.zeros(spec.num_embeds, width, dtype=getattr(torch, dtype), device=device)

    def note_loads(self, meta: _StepMetadata, before: set[str], encoder_cache: dict[str, Any], recorder: _Recorder) -> None:
        """Counts this step's loads for vLLM's stats: the bytes of each entry
        a load put into the encoder cache from the slab, and each failure."""
        for spec in meta.loads:
            if not spec.transfer_id:
                continue  # failed by the scheduler, and counted there
            if spec.transfer_id in self._failed:
                recorder.load_failed(spec.transfer_id)
            elif spec.mm_hash not in before and spec.mm_hash in self._held:
                tensor = encoder_cache.get(spec.mm_hash)
                if tensor is not None:
                    recorder.loaded(spec.transfer_id, tensor.numel() * tensor.element_size())

    def report(self, report: _WorkerReport) -> None:
        report.loaded |= self._loaded
        report.failed_loads.update(self._failed)
        self._loaded, self._failed = set(), {}

    def stats(self) -> dict[str, Any]:
        return self._native.stats() if self._native is not None else {}

    def close(self) -> None:
        if self._native is not None:
            self._native.close()
        self._slab = None


# --- worker side: producer ---------------------------------------------------


@dataclass
class _Push:
    spec: PushSpec
    announced: float
    submitted: bool = False
    sourced: bool = False
    # When the encoder output was handed over: the push time starts here.
    sourced_at: float = 0.0


# Transfer ids of pushes that ended, remembered so that announcing one again
# (a proxy reusing an id) cannot create a push the library will never report
# on: it treats a known id as a no-op.
MAX_ENDED_PUSHES = 1 << 16


class _HostCopier:
    """Copies CUDA encoder outputs into pinned host memory off the engine thread.

    The engine thread only records an event after the encoder's kernels;
    this thread waits for it on its own stream, copies, waits for the copy,
    and only then hands the host copy over. It keeps the CUDA tensor
    referenced until the copy finished, so the caching allocator cannot
    reuse its memory under the copy.
    """

    def __init__(self, deliver: Callable[[str, Any, str], None]):
        self._deliver = deliver
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._inflight = 0

    @property
    def busy(self) -> bool:
        return self._inflight > 0

    def submit(self, mm_hash: str, tensor: Any) -> None:
        torch = _torch()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        with self._lock:
            self._inflight += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ecmooncake-d2h", daemon=True)
                self._thread.start()
        self._jobs.put((mm_hash, tensor, event))

    def _run(self) -> None:
        torch = _torch()
        streams: dict[Any, Any] = {}
        while True:
            job = self._jobs.get()
            if job is None:
                return
            mm_hash, tensor, event = job
            host, error = None, ""
            try:
                stream = streams.get(tensor.device)
                if stream is None:
                    stream = streams[tensor.device] = torch.cuda.Stream(tensor.device)
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                with torch.cuda.stream(stream):
                    stream.wait_event(event)
                    host.copy_(tensor, non_blocking=True)
                stream.synchronize()
            except Exception as exc:
                host, error = None, f"copy to host memory failed: {exc}"
            del tensor, job
            try:
                self._deliver(mm_hash, host, error)
            finally:
                with self._lock:
                    self._inflight -= 1

    def close(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout_s)


class _ProducerWorker:
    """The encoder's worker: reserve before encoding, write once encoded."""

    def __init__(self, cfg: ec_config.ECMooncakeConfig):
        self._cfg = cfg
        self._native: Producer | None = None
        # Guards the native producer and everything below: the copy thread
        # hands sources over too. Held only for non-blocking native calls.
        self._lock = threading.Lock()
        self._pushes: dict[str, _Push] = {}
        self._by_hash: dict[str, set[str]] = {}
        self._ready: dict[str, Any] = {}
        self._done: set[str] = set()
        self._failed: dict[str, str] = {}
        self._copier = _HostCopier(self._deliver_copy)
        push_wait = float(cfg.value("push_wait_timeout_s"))
        control = float(cfg.extra.get("control_timeout_s", 30.0))
        self._shutdown_s = push_wait
        # Every state of a push has a deadline in the library; past the sum
        # of them (and a margin) no outcome will come.
        self._give_up_s = 3 * push_wait + 2 * control + 30.0
        self._ended: dict[str, None] = {}
        self._closed = False
        self.recorder = _Recorder()

    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise EcmError("producer: connector is shut down")
            if self._native is None:
                _configure_process(self._cfg, worker=True)
                self._native = Producer(self._cfg.producer_settings())

    def announce(self, pushes: list[PushSpec], encoder_cache: dict[str, Any] | None) -> None:
        self.start()
        new = [s for s in pushes if s.transfer_id not in self._pushes]
        if not new:
            return
        now = time.monotonic()
        with self._lock:
            for spec in new:
                if spec.transfer_id in self._ended:
                    self._failed[spec.transfer_id] = "transfer id already used by an earlier push"
                    self.recorder.push_failed()
                    continue
                self._pushes[spec.transfer_id] = _Push(spec, now)
                self._by_hash.setdefault(spec.mm_hash, set()).add(spec.transfer_id)
            self._submit_locked([self._pushes[s.transfer_id] for s in new if s.nbytes and s.transfer_id in self._pushes])
        if encoder_cache:
            # Outputs the encoder cache already holds are not encoded again,
            # so save_caches will not see them: hand them over now.
            for h in dict.fromkeys(s.mm_hash for s in new):
                if h in encoder_cache:
                    self.capture(h, encoder_cache[h])

    def _submit_locked(self, pushes: list[_Push]) -> None:
        if not pushes or self._native is None:
            return
        body = [
            {
                "transfer_id": p.spec.transfer_id,
                "mm_hash": p.spec.mm_hash,
                "nbytes": p.spec.nbytes,
                "consumer": p.spec.consumer,
                "meta": p.spec.describe(),
            }
            for p in pushes
        ]
        try:
            answers = self._native.submit(body)
        except EcmError as exc:
            answers = [{"transfer_id": p.spec.transfer_id, "error": str(exc)} for p in pushes]
        for push, answer in zip(pushes, answers):
            if answer.get("error"):
                self._fail_locked(push.spec.transfer_id, answer["error"])
            else:
                push.submitted = True

    def wants(self, mm_hash: str) -> bool:
        return bool(self._by_hash.get(mm_hash))

    def capture(self, mm_hash: str, tensor: Any) -> None:
        """Takes the encoder output of mm_hash for every push that wants it."""
        if not self.wants(mm_hash):
            return
        device = tensor.device.type
        with self._lock:
            if device not in ("cpu", "cuda"):
                reason = f"encoder output on {tensor.device}: only CPU and CUDA memory can be sent"
                self._abandon_locked(list(self._by_hash.get(mm_hash, ())), reason)
                return
            now = time.monotonic()
            for tid in self._by_hash.get(mm_hash, ()):
                self._pushes[tid].sourced = True
                self._pushes[tid].sourced_at = now
            if device == "cpu":
                self._ready[mm_hash] = tensor
                return
        self._copier.submit(mm_hash, tensor)

    def _deliver_copy(self, mm_hash: str, host: Any, error: str) -> None:
        with self._lock:
            if error:
                self._abandon_locked(list(self._by_hash.get(mm_hash, ())), error)
                return
            self._hand_over_locked({mm_hash: host})

    def flush(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, {}
            if ready:
                self._hand_over_locked(ready)

    def _hand_over_locked(self, ready: dict[str, Any]) -> None:
        if self._native is None:
            # Shut down: a copy that finished late has nobody to go to.
            return
        sources = []
        late: list[_Push] = []
        for h, tensor in ready.items():
            pushes = [self._pushes[tid] for tid in self._by_hash.get(h, ())]
            if not pushes:
                continue
            dtype, shape = _dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape)
            wrong = [p for p in pushes if p.spec.shape is not None and (p.spec.dtype, tuple(p.spec.shape)) != (dtype, shape)]
            for p in wrong:
                announced = f"{list(p.spec.shape)} {p.spec.dtype}"
                self._abandon_locked([p.spec.transfer_id], f"encoder output is {list(shape)} {dtype}, the push announced {announced}")
            for p in pushes:
                if p.spec.shape is None and not p.submitted and dtype in DTYPES and len(shape) == 2:
                    p.spec.dtype, p.spec.shape = dtype, shape
                    late.append(p)
            if any(p.submitted for p in pushes if p not in wrong) or late:
                sources.append((h, tensor if tensor.is_contiguous() else tensor.contiguous()))
        self._submit_locked(late)
        if not sources:
            return
        try:
            self._native.sources(sources)
        except EcmError as exc:
            # The library fails the pushes it could not source and reports
            # them through poll; the ones it took are already on their way.
            _throttle.warn("sources", "ecmooncake: encoder outputs refused by the producer: %s", exc)

    def _fail_locked(self, tid: str, reason: str) -> None:
        push = self._pushes.pop(tid, None)
        if push is None:
            return
        logger.warning(
            "ecmooncake: push of %s (transfer %s, request %s) to %s failed: %s",
            push.spec.mm_hash,
            tid,
            push.spec.request_id,
            push.spec.consumer,
            reason,
        )
        self._failed[tid] = reason
        self.recorder.push_failed()
        self._forget_locked(push)

    def _forget_locked(self, push: _Push) -> None:
        self._ended[push.spec.transfer_id] = None
        if len(self._ended) > MAX_ENDED_PUSHES:
            del self._ended[next(iter(self._ended))]
        tids = self._by_hash.get(push.spec.mm_hash)
        if tids is not None:
            tids.discard(push.spec.transfer_id)
            if not tids:
                del self._by_hash[push.spec.mm_hash]
                self._ready.pop(push.spec.mm_hash, None)

    def _abandon_locked(self, tids: list[str], reason: str) -> None:
        """Fails pushes for good, and frees what the library holds for them."""
        submitted = [tid for tid in tids if tid in self._pushes and self._pushes[tid].submitted]
        for tid in tids:
            self._fail_locked(tid, reason)
        self._cancel_locked(submitted)

    def _cancel_locked(self, tids: list[str]) -> None:
        if tids and self._native is not None:
            self._native.cancel(tids)

    def finish(self, finished_req_ids: set[str] | None) -> None:
        """End-of-step work: hand over outputs, drop pushes of finished
        requests that never got one, collect outcomes."""
        if self._native is None:
            return
        self.flush()
        with self._lock:
            if finished_req_ids:
                orphans = [
                    p for p in self._pushes.values() if p.spec.request_id in finished_req_ids and not p.sourced
                ]
                for p in orphans:
                    self._pushes.pop(p.spec.transfer_id, None)
                    self._forget_locked(p)
                self._cancel_locked([p.spec.transfer_id for p in orphans if p.submitted])
            out = self._native.poll(0)
            now = time.monotonic()
            for tid in out.get("done") or ():
                push = self._pushes.pop(tid, None)
                if push is not None:
                    self.recorder.pushed(now - (push.sourced_at or push.announced), push.spec.nbytes or 0)
                    self._forget_locked(push)
                self._done.add(tid)
            for failure in out.get("failed") or ():
                tid = failure.get("transfer_id") or ""
                if tid in self._pushes:
                    self._fail_locked(tid, failure.get("reason") or "failed")
            limit = time.monotonic() - self._give_up_s
            for tid in [tid for tid, p in self._pushes.items() if p.announced < limit]:
                self._fail_locked(tid, f"no outcome from the library after {self._give_up_s:.0f}s")

    def report(self, report: _WorkerReport) -> None:
        with self._lock:
            report.pushes_done |= self._done
            report.pushes_failed.update(self._failed)
            # Held sources keep the engine stepping too: only a poll lets
            # the library hand them back.
            held = self._native is not None and self._native.held_sources > 0
            pending = bool(self._pushes or self._ready or self._copier.busy or held)
            report.pending_pushes = report.pending_pushes or pending
            self._done, self._failed = set(), {}

    def stats(self) -> dict[str, Any]:
        return self._native.stats() if self._native is not None else {}

    def close(self) -> None:
        self._copier.close(self._shutdown_s)
        self.flush()
        with self._lock:
            native, self._native = self._native, None
            self._closed = True
        if native is not None:
            _close_bounded(native)


# --- the startup line --------------------------------------------------------


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


def _transport_line(cfg: ec_config.ECMooncakeConfig) -> str:
    transport = cfg.value("transport")
    name = transport
    if transport == "mooncake":
        name = f"mooncake/{cfg.extra.get('mooncake_protocol', 'rdma')}"
    if not cfg.is_producer:
        return f"transport {name}"
    # The producer picks per shard (see the README's GPU memory section).
    if transport == "shm":
        return "transport shm: other hosts refused, this host shm"
    return f"transport {name}: other hosts {name}, this host {name} (cuda_ipc into a GPU slab)"


def _slab_line(cfg: ec_config.ECMooncakeConfig) -> str:
    line = f"slab {_size(cfg.buffer_size)} on {cfg.buffer_device}"
    if cfg.buffer_device.startswith("cuda"):
        return line + " (pinned host memory, copied to the GPU at load)"
    if cfg.value("transport") == "shm":
        return line + " (a memfd shared with producers on this host)"
    return line


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except ImportError:
        return "not installed"


# --- the connector -----------------------------------------------------------


def _empty_pair() -> tuple[None, None]:
    return None, None


# Consecutive raises of ensure_cache_available after which a request is
# failed instead of being deferred once more.
ENSURE_STRIKES = 3


class _Connector:
    """The implementation behind ECMooncakeConnector; see the module docstring.

    vLLM calls the scheduler-role hooks from its scheduler and the
    worker-role hooks from its model runner; a hook of the other role is
    never called on an instance, and answers neutrally if it is.
    """

    # Filled in by _bind: which optional hooks this vLLM's base class has,
    # and the metadata classes bound to vLLM's bases.
    _hooks: dict[str, bool] = {}
    _metadata_cls: type = _StepMetadata
    _report_cls: type = _WorkerReport
    _stats_cls: type = _Stats
    _prom_cls: type | None = None

    def __init__(self, vllm_config: Any, role: Any):
        super().__init__(vllm_config=vllm_config, role=role)
        self._cfg = ec_config.from_vllm_config(vllm_config)
        self._closed = False
        self._ensure_strikes: dict[str, int] = {}
        self._consumer_sched: _ConsumerScheduler | None = None
        self._producer_sched: _ProducerScheduler | None = None
        self._consumer_worker: _ConsumerWorker | None = None
        self._producer_worker: _ProducerWorker | None = None
        self._recorder = _Recorder()
        if getattr(role, "name", str(role)) == "SCHEDULER":
            if self._cfg.is_consumer:
                self._consumer_sched = _ConsumerScheduler(self._cfg, ensure_hook=self._hooks.get("ensure_cache_available", True))
            if self._cfg.is_producer:
                self._producer_sched = _ProducerScheduler(self._cfg, vllm_config)
        else:
            if self._cfg.is_consumer:
                self._consumer_worker = _ConsumerWorker(self._cfg, vllm_config)
            if self._cfg.is_producer:
                self._producer_worker = _ProducerWorker(self._cfg)
        level, line = self._startup_line(getattr(role, "name", str(role)))
        logger.log(level, "%s", line)

    def _startup_line(self, role: str) -> tuple[int, str]:
        """Everything an operator checks first, in one line per connector:
        a warning when this vLLM lacks hooks, naming what each costs."""
        cfg = self._cfg
        t = cfg.topology
        kinds = [k for k, on in (("producer", cfg.is_producer), ("consumer", cfg.is_consumer)) if on]
        parts = [f"ecmooncake: {role} connector ({'+'.join(kinds)})"]
        if cfg.is_consumer:
            where = cfg.consumer_endpoint if self._consumer_worker is None else self._consumer_worker.endpoint
            parts.append(f"consumer at {where}, tp_rank {t.tp_rank} of {t.tp_size}, dp_rank {t.dp_rank}")
        parts.append(_transport_line(cfg))
        if cfg.is_consumer:
            parts.append(_slab_line(cfg) + (" per shard" if self._consumer_worker is None else ""))
        parts.append(f"vLLM {_vllm_version()}")
        present = [name for name in OPTIONAL_HOOKS if self._hooks.get(name, True)]
        parts.append("calls " + (", ".join(present) if present else "none of the optional hooks"))
        missing = [f"{name} ({cost})" for name, cost in OPTIONAL_HOOKS.items() if not self._hooks.get(name, True)]
        if missing:
            parts.append("lacks " + ", ".join(missing))
        return (logging.WARNING if missing else logging.INFO), "; ".join(parts)

    # --- scheduler side ---

    @_guarded(lambda: False)
    def has_cache_item(self, identifier: str) -> bool:
        if self._consumer_sched is None:
            return False
        return self._consumer_sched.has_cache_item(identifier)

    @_guarded(lambda: False)
    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        if self._producer_sched is not None:
            self._producer_sched.ensure_cache_available(request, num_computed_tokens)
        if self._consumer_sched is None:
            return True
        try:
            answer = self._consumer_sched.ensure_cache_available(request, num_computed_tokens)
        except Exception:
            # Deferred again and again, such a request would wait forever:
            # after ENSURE_STRIKES raises in a row it is failed (retryable).
            strikes = self._ensure_strikes.get(request.request_id, 0) + 1
            self._ensure_strikes[request.request_id] = strikes
            if strikes >= ENSURE_STRIKES:
                self._consumer_sched.fail(request.request_id, f"ensure_cache_available raised {strikes} times")
            raise
        self._ensure_strikes.pop(request.request_id, None)
        return answer

    @_guarded(lambda: None)
    def update_state_after_alloc(self, request: Any, index: int) -> None:
        if self._consumer_sched is not None:
            self._consumer_sched.update_state_after_alloc(request, index)
        if self._producer_sched is not None:
            self._producer_sched.prepare(request, index)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = self._metadata_cls()
        builds = []
        if self._consumer_sched is not None:
            builds.append(functools.partial(self._consumer_sched.build, scheduler_output, meta))
        if self._producer_sched is not None:
            builds.append(functools.partial(self._producer_sched.build, meta))
        # Each part separately: whatever the other added must still reach
        # the workers, which act on this step's metadata.
        for build in builds:
            try:
                build()
            except Exception as exc:
                _throttle.warn("build", "ecmooncake: build_connector_meta: %s: %s", type(exc).__name__, exc)
        return meta

    @_guarded(lambda: None)
    def update_connector_output(self, connector_output: Any) -> None:
        report = getattr(connector_output, "ec_connector_worker_meta", None)
        if not isinstance(report, _WorkerReport):
            return
        if self._consumer_sched is not None:
            self._consumer_sched.update_connector_output(report)
        if self._producer_sched is not None:
            self._producer_sched.update_connector_output(report)

    @_guarded(lambda: (False, None))
    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        # Never delay_free: vLLM applies it to KV blocks only, and nothing
        # would release them on an instance without a KV connector.
        params = None
        self._ensure_strikes.pop(request.request_id, None)
        if self._consumer_sched is not None:
            self._consumer_sched.request_finished(request)
        if self._producer_sched is not None:
            params = self._producer_sched.request_finished(request)
        return False, params

    @_guarded(set)
    def take_unavailable_requests(self) -> set[str]:
        out: set[str] = set()
        for part in (self._consumer_sched, self._producer_sched):
            if part is not None:
                out |= part.take_unavailable()
        self._recorder.requests_failed(len(out))
        return out

    @_guarded(lambda: False)
    def has_pending_push_work(self) -> bool:
        return any(part is not None and part.has_pending_work() for part in (self._consumer_sched, self._producer_sched))

    # --- worker side ---

    def start_worker_services(self) -> None:
        # Startup, not the engine loop: a shard that cannot listen (a port
        # in use) must stop the server with that message.
        if self._consumer_worker is not None:
            self._consumer_worker.start()
        if self._producer_worker is not None:
            self._producer_worker.start()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not self._hooks.get("start_save_caches", True):
            # Without start_save_caches (older vLLM) binding is the last
            # moment before the encoder runs.
            self.start_save_caches()

    @_guarded(lambda: None)
    def start_save_caches(self, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._producer_worker is None or not isinstance(meta, _StepMetadata):
            return
        self._producer_worker.announce(meta.pushes, kwargs.get("encoder_cache"))

    @_guarded(lambda: None)
    def start_load_caches(self, encoder_cache: dict[str, Any], **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._consumer_worker is None or not isinstance(meta, _StepMetadata):
            return
        before = set(encoder_cache) if meta.loads else set()
        self._consumer_worker.load(meta, encoder_cache)
        if meta.loads:
            self._consumer_worker.note_loads(meta, before, encoder_cache, self._recorder)

    @_guarded(lambda: None)
    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None:
        if self._producer_worker is None or not self._producer_worker.wants(mm_hash):
            return
        tensor = encoder_cache.get(mm_hash)
        if tensor is not None:
            self._producer_worker.capture(mm_hash, tensor)

    @_guarded(_empty_pair)
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._producer_worker is not None:
            self._producer_worker.finish(finished_req_ids)
        return None, None

    @_guarded(lambda: None)
    def build_connector_worker_meta(self) -> Any:
        receiving = self._consumer_worker is not None and self._consumer_worker.receiving
        if not receiving and self._producer_worker is None:
            # Later pipeline stages load nothing; a report from them would
            # empty the intersection of loaded items.
            return None
        report = self._report_cls()
        if receiving:
            self._consumer_worker.report(report)
        if self._producer_worker is not None:
            self._producer_worker.flush()
            self._producer_worker.report(report)
        return report

    # --- both ---

    @_guarded(lambda: None)
    def get_ec_connector_stats(self) -> Any:
        """This step's transfers, for vLLM's /metrics and its log line
        (None when nothing happened, so that vLLM sends nothing)."""
        stats = self._stats_cls()
        recorders = [self._recorder] + [p.recorder for p in (self._producer_worker, self._consumer_sched) if p is not None]
        for recorder in recorders:
            recorder.drain_into(stats)
        return None if stats.is_empty() else stats

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return cls._stats_cls(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict[int, list[Any]]) -> Any:
        if cls._prom_cls is None:
            return None
        try:
            return cls._prom_cls(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        except Exception as exc:
            # A server without these series still serves; one that cannot
            # start over them does not.
            logger.warning("ecmooncake: no connector series on vLLM's /metrics: %s: %s", type(exc).__name__, exc)
            return None

    def native_stats(self) -> dict[str, Any]:
        """Counters of the native objects this connector owns (for tools)."""
        out: dict[str, Any] = {}
        for name, part in (
            ("scheduler", self._consumer_sched),
            ("consumer", self._consumer_worker),
            ("producer", self._producer_worker),
        ):
            if part is not None:
                out[name] = part.stats()
        return out

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for part in (self._producer_worker, self._consumer_worker, self._consumer_sched):
            if part is None:
                continue
            try:
                part.close()
            except Exception as exc:
                logger.warning("ecmooncake: shutdown: %s: %s", type(exc).__name__, exc)


# --- binding to vLLM's base classes ------------------------------------------

_PUBLIC = ("ECMooncakeConnector", MODULE_PATH_NAME, "ECMooncakeConnectorMetadata", "ECMooncakeWorkerMetadata", "ECMooncakeConnectorStats")
_bind_lock = threading.Lock()


def _bind() -> None:
    from vllm.distributed.ec_transfer.ec_connector import base

    hooks = {name: hasattr(base.ECConnectorBase, name) for name in OPTIONAL_HOOKS}
    namespace = globals()

    def make(name: str, impl: type, vllm_base: type, extra: dict[str, Any] | None = None) -> type:
        attrs = {"__module__": __name__, "__qualname__": name, "__doc__": impl.__doc__, **(extra or {})}
        return type(name, (impl, vllm_base), attrs)

    metadata = make("ECMooncakeConnectorMetadata", _StepMetadata, base.ECConnectorMetadata)
    report = make("ECMooncakeWorkerMetadata", _WorkerReport, getattr(base, "ECConnectorWorkerMetadata", object))
    try:
        # Since vLLM 0.33; older releases have no stats hooks to serve.
        from vllm.distributed.ec_transfer.ec_connector import metrics as ec_metrics
    except ImportError:
        ec_metrics = None
    stats = make("ECMooncakeConnectorStats", _Stats, getattr(ec_metrics, "ECConnectorStats", object))
    prom = make("ECMooncakePromMetrics", _PromMetrics, ec_metrics.ECConnectorPromMetrics) if ec_metrics else None
    connector = make(
        "ECMooncakeConnector",
        _Connector,
        base.ECConnectorBase,
        {"_hooks": hooks, "_metadata_cls": metadata, "_report_cls": report, "_stats_cls": stats, "_prom_cls": prom},
    )
    namespace.update(
        ECMooncakeConnectorMetadata=metadata,
        ECMooncakeWorkerMetadata=report,
        ECMooncakeConnectorStats=stats,
        ECMooncakeConnector=connector,
        **{MODULE_PATH_NAME: connector},
    )


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        with _bind_lock:
            if name not in globals():
                _bind()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
