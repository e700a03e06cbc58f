"""``ECMooncakeConnector``: vLLM's encoder-cache connector over the native core.

One class serves both roles vLLM gives a connector:

* **scheduler role** (the engine-core process). On a consumer (prefill/decode)
  instance it owns a native :class:`~ecmooncake.native.Scheduler`, whose
  background goroutines keep a transfer table current from the shards'
  readiness events. The first of ``has_cache_item`` and
  ``ensure_cache_available`` in a schedule pass applies, on the engine's
  thread and without waiting, the same-host shards' events already in their
  sockets (``Scheduler.poll``), so a request the engine spins on does not
  wait for the reader thread's wake. Both answer from memory while the
  table's generation (a counter the library keeps current in this
  process's memory) stands, and with one non-blocking call for every
  waiting request when it moved. Everything else a step needs
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
vLLM's bases and are assembled from the implementations in this package on
first attribute access, which is what vLLM's factory and pickle do.

The parts live by role: :mod:`.scheduler` (both scheduler roles),
:mod:`.consumer` and :mod:`.producer` (the worker roles), :mod:`.hooks`
(the hooks vLLM calls, dispatched to the parts, and their guard),
:mod:`.stats` (transfer statistics), :mod:`.calls` (which hooks the running
vLLM calls, read from its source). What they share has a room each:
:mod:`.names` (what vLLM knows the connector by), :mod:`.metadata` (the
records between scheduler and workers), :mod:`.dtypes`, :mod:`.request`
(what a vLLM request says), :mod:`.log` (the logger and its throttle) and
:mod:`.lifecycle` (the library's settings and bounded close).
"""

from __future__ import annotations

import threading
from typing import Any

# Re-exported: the plugin, the tools and the tests name them here.
from .dtypes import DTYPES  # noqa: F401
from .calls import read_calls
from .hooks import _Connector
from .metadata import LoadSpec, PushSpec, _StepMetadata, _WorkerReport  # noqa: F401
from .names import CONNECTOR_NAME, MODULE_PATH_NAME, OPTIONAL_HOOKS  # noqa: F401
from .request import consumer_address, transfer_ids  # noqa: F401
from .stats import _PromMetrics, _Stats


# --- binding to vLLM's base classes ------------------------------------------

_PUBLIC = ("ECMooncakeConnector", MODULE_PATH_NAME, "ECMooncakeConnectorMetadata", "ECMooncakeWorkerMetadata", "ECMooncakeConnectorStats")
_bind_lock = threading.Lock()


def _bind() -> None:
    from vllm.distributed.ec_transfer.ec_connector import base

    # What this vLLM calls, read from its source: its base class defines
    # hooks its scheduler never calls (0.26: update_connector_output).
    calls = read_calls(base=base.ECConnectorBase)
    hooks = {name: calls.hooks.get(name, hasattr(base.ECConnectorBase, name)) for name in OPTIONAL_HOOKS}
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
        {"_hooks": hooks, "_calls": calls, "_metadata_cls": metadata, "_report_cls": report, "_stats_cls": stats, "_prom_cls": prom},
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
