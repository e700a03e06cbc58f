"""The hooks vLLM calls, each dispatched to the role parts this instance
has (see the package docstring), the guard that keeps their exceptions out
of vLLM's engine loop, and the startup line."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from .. import ec_config
from .consumer import _ConsumerWorker
from .fetch import make as make_fetcher
from .log import logger, throttle
from .metadata import _StepMetadata, _WorkerReport
from .names import OPTIONAL_HOOKS
from .producer import _ProducerWorker
from .scheduler import _ConsumerScheduler, _ProducerScheduler
from .stats import _Recorder, _Stats

# --- the guard ---------------------------------------------------------------


def _hook_failed(name: str, exc: Exception) -> None:
    """Logs a hook's failure, throttled per hook; the hook then answers its default."""
    throttle.warn(
        "hook:" + name,
        "ecmooncake: %s failed, carrying on without it: %s: %s",
        name,
        type(exc).__name__,
        exc,
    )


def _guarded(default: Callable[[], Any]) -> Callable:
    """Runs a hook so that no exception reaches vLLM's engine loop."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                _hook_failed(fn.__name__, exc)
                return default()

        return hook

    return wrap


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
        return "transport shm: other hosts refused, this host shm (CUDA outputs staged by the library)"
    if transport == "mooncake":
        return (
            f"transport {name}: every shard {name}, CUDA outputs from GPU staging registered with the engine "
            "(a CUDA build of it), else staged by the library"
        )
    return f"transport {name}: this host cuda_ipc into a GPU slab, else {name} (CUDA outputs staged by the library)"


def _slab_line(cfg: ec_config.ECMooncakeConfig) -> str:
    line = f"slab {_size(cfg.buffer_size)} on {cfg.buffer_device}"
    if cfg.slab_memory == "device":
        if cfg.value("transport") == "mooncake":
            return line + " (GPU memory, registered with Mooncake; needs a CUDA build of its engine)"
        return line + " (GPU memory: cuda_ipc from encoders on this host, staged tcp from others; loads are views)"
    if cfg.slab_memory == "pinned_host":
        return line + " (buffer_memory pinned_host: pinned host memory, copied to the GPU at load)"
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
    """The implementation behind ECMooncakeConnector; see the package docstring.

    vLLM calls the scheduler-role hooks from its scheduler and the
    worker-role hooks from its model runner; a hook of the other role is
    never called on an instance, and answers neutrally if it is.
    """

    # Filled in by _bind: which optional hooks this vLLM calls (.calls),
    # and the metadata classes bound to vLLM's bases.
    _hooks: dict[str, bool] = {}
    _calls: Any = None
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
                self._consumer_sched = _ConsumerScheduler(
                    self._cfg,
                    ensure_hook=self._hooks.get("ensure_cache_available", True),
                    outcomes=self._outcomes(),
                    can_fail=self._hooks.get("take_unavailable_requests", True),
                    fetcher=make_fetcher(self._cfg, vllm_config),
                    stats_hook=self._hooks.get("get_ec_connector_stats", True),
                )
            if self._cfg.is_producer:
                self._producer_sched = _ProducerScheduler(self._cfg, vllm_config)
        else:
            if self._cfg.is_consumer:
                self._consumer_worker = _ConsumerWorker(self._cfg, vllm_config)
            if self._cfg.is_producer:
                self._producer_worker = _ProducerWorker(self._cfg, vllm_config)
            if not self._hooks.get("start_worker_services", True):
                # Nothing else would start the shards before the first
                # step, and an encoder reserving space before then would
                # find nobody listening (its push failing).
                self.start_worker_services()
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
        calls = self._calls
        if calls is not None and calls.ensure_paths == 1:
            parts.append("ensure_cache_available in the waiting path only")
        if calls is not None and calls.unread:
            parts.append("source unreadable, the base class decided for " + ", ".join(calls.unread))
        if missing:
            parts.append("lacks " + ", ".join(missing))
        return (logging.WARNING if missing else logging.INFO), "; ".join(parts)

    def _outcomes(self) -> bool:
        """Whether workers' load and push outcomes reach the scheduler."""
        return self._hooks.get("build_connector_worker_meta", True) and self._hooks.get("update_connector_output", True)

    # --- scheduler side ---

    def has_cache_item(self, identifier: str) -> bool:
        # vLLM asks this for every media item of every waiting request on
        # each schedule pass, so it is guarded inline (the same guard as
        # _guarded's) instead of through a wrapper taking *args.
        sched = self._consumer_sched
        if sched is None:
            return False
        try:
            return sched.has_cache_item(identifier)
        except Exception as exc:
            _hook_failed("has_cache_item", exc)
            return False

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
                throttle.warn("build", "ecmooncake: build_connector_meta: %s: %s", type(exc).__name__, exc)
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
        if not self._outcomes():
            # Nobody collects the outcomes (no worker report on this vLLM):
            # dropped here, or they would pile up for good.
            self._consumer_worker.report(_WorkerReport())

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
            if not self._outcomes():
                self._producer_worker.report(_WorkerReport())
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
        if self._producer_worker is not None:
            self._recorder.store(self._producer_worker.store_increments())
        if self._consumer_sched is not None:
            self._recorder.store(self._consumer_sched.store_increments())
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
