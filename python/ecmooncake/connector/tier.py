"""The Mooncake Store tier inside the connector (``store`` in
``ec_connector_extra_config``; see :mod:`ecmooncake.store`).

One :class:`~ecmooncake.store.StoreTier` per worker process that uses it,
opened in the role's ``start`` (after vLLM forked the worker: the Store's
client starts threads) and closed in its ``close``. What this module adds
to the tier: the key of an item as this instance would need it
(:func:`identity`), the put of an encoder output from host or GPU memory
(:class:`_DeviceStaging` copies a CUDA output into a bounded pinned pool
on a stream of its own, and a thread hands it to the tier once the copy
completed), and the counters handed to vLLM's stats as the increments
since vLLM last asked.

The encoder side puts each output and its index; a PD gets the items the
proxy says come from the Store (:mod:`.fetch`; docs/operations.md,
"Mooncake Store beside an EPD fleet").
"""

from __future__ import annotations

import ctypes
import json
import queue
import threading
import time
from typing import Any, Callable, Mapping

from .. import ec_config
from ..store import Extents, Fetched, StoreTier, encode_index, index_key, item_key, load_store_class
from .dtypes import dtype_name, import_torch
from .log import logger, throttle

# The Store client's factory: None is the wheel's MooncakeDistributedStore.
# Tests name ecmooncake.store.MemoryStore here (an in-memory Store).
backend_factory: Callable[[], Any] | None = None

# This module's own counters, beside the tier's.
OWN_COUNTERS = (
    "put_skipped_device",  # a GPU output with no pinned pool (no CUDA in this process when the tier opened)
    "put_skipped_key",  # no key could be made for the output
    "put_dropped_pinned_full",  # the pinned pool held no room for a GPU output
    "put_device_copy_timeout",  # a GPU output's copy to the pool did not complete within put_timeout_s
    "put_skipped_error",  # queuing the put failed (a CUDA error, say); logged
    # A PD's fetches (connector.fetch): each that did not arrive is also
    # counted by the tier's get_* counter of its get, when it got that far.
    "fetch_pushed",  # an item got from the Store arrived in this instance's shards
    "fetch_queue_full",  # the scheduler handed over more fetches than fetch.MAX_QUEUED
    "fetch_expired",  # a fetch waited in the queue past its deadline
    "fetch_get_failed",  # the Store's get fell back (the tier's get_* counter says why)
    "fetch_push_failed",  # the push to this instance's own shards failed or ran past fetch.PUSH_WAIT_S
)
# How often the copy thread asks its pending copies whether they completed.
COPY_POLL_S = 0.001


def _plain(value: Any) -> Any:
    """value as plain JSON (what is not JSON is named by its repr), so that
    a key can always be made from it."""
    return json.loads(json.dumps(value, sort_keys=True, default=repr))


def identity(vllm_config: Any) -> tuple[str, dict[str, Any]]:
    """(model, encoder_config) of an item's Store key: the model and its
    revision, and what changes an encoder's output for the same image: the
    processor's settings (``mm_processor_kwargs``, e.g. pixel bounds) and
    the model config's overrides. The same on an encoder and a PD of one
    deployment, so that both name an item alike."""
    mc = getattr(vllm_config, "model_config", None)
    model = str(getattr(mc, "model", None) or "unknown-model")
    revision = getattr(mc, "revision", None)
    if revision:
        model = f"{model}@{revision}"
    mm = getattr(mc, "multimodal_config", None)
    kwargs = getattr(mm, "mm_processor_kwargs", None)
    if kwargs is None:
        kwargs = getattr(mc, "mm_processor_kwargs", None)
    overrides = getattr(mc, "hf_overrides", None)
    encoder = {
        "mm_processor_kwargs": _plain(dict(kwargs or {})),
        # A callable override cannot be named: it counts as none, and the
        # deployment that uses one must not share a Store with one that
        # does not (docs/operations.md).
        "hf_overrides": _plain(dict(overrides)) if isinstance(overrides, Mapping) else {},
    }
    return model, encoder


class _DeviceStaging:
    """GPU outputs on their way into the Store: one pinned host pool of
    ``put_inflight_bytes``, copied into on a side stream ordered after the
    output's stream (the engine thread queues the copy and waits for
    nothing), and one thread that hands each copy to the tier once its
    event completed, then gives the pool's extent back when the tier has
    copied it out. A copy that does not complete within the tier's
    ``put_timeout_s`` is counted and its put abandoned; its extent stays
    taken until the GPU is done with it."""

    def __init__(self, tier: "_Tier", nbytes: int):
        torch = import_torch()
        self._tier = tier
        # Allocated when the tier opens (startup), never on the engine thread.
        self._pool = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._extents = Extents(nbytes)
        self._lock = threading.Lock()
        self._streams: dict[int, Any] = {}
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ecm-store-d2h", daemon=True)
        self._thread.start()

    def put(self, key: str, tensor: Any, stream: Any, index: tuple[str, bytes] | None = None) -> None:
        torch = import_torch()
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            off = None if self._closed else self._extents.alloc(nbytes)
        if off is None:
            self._tier._count("put_dropped_pinned_full")
            throttle.warn("store-pinned", "ecmooncake: Mooncake Store put of %s dropped: the pinned pool is full", key)
            return
        device = tensor.device
        side = self._streams.get(device.index)
        if side is None:
            side = self._streams[device.index] = torch.cuda.Stream(device=device)
        with torch.cuda.stream(side):
            # After every kernel queued so far on the output's stream.
            side.wait_stream(stream if stream is not None else torch.cuda.current_stream(device))
            src = tensor if tensor.is_contiguous() else tensor.contiguous()
            self._pool[off:off + nbytes].copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
            # The caching allocator must not hand the output's memory out
            # again before this stream has read it.
            tensor.record_stream(side)
            done = torch.cuda.Event()
            done.record(side)
        self._q.put((key, off, nbytes, done, time.monotonic(), index))

    def _free(self, off: int, nbytes: int) -> None:
        with self._lock:
            self._extents.free(off, nbytes)

    def _run(self) -> None:
        pending: list[tuple[str, int, int, Any, float, Any, bool]] = []
        while True:
            try:
                job = self._q.get(timeout=None if not pending else COPY_POLL_S)
            except queue.Empty:
                job = False
            if job is None:
                return
            if job:
                pending.append((*job, False))
            still = []
            limit = self._tier.settings.put_timeout_s
            for key, off, nbytes, event, started, index, late in pending:
                try:
                    finished = event.query()
                except Exception as exc:  # noqa: BLE001 - a failed copy is a dropped put
                    logger.warning("ecmooncake: copy of %s to the Store's pinned pool failed: %s", key, exc)
                    self._tier._count("put_device_copy_timeout")
                    continue  # the extent is not reused: the GPU's state is unknown
                if not finished:
                    if not late and time.monotonic() - started > limit:
                        self._tier._count("put_device_copy_timeout")
                        late = True
                    still.append((key, off, nbytes, event, started, index, late))
                    continue
                if late:
                    self._free(off, nbytes)
                    continue
                addr = self._pool.data_ptr() + off
                if self._tier.tier.put_async(key, addr, nbytes, release=lambda o=off, n=nbytes: self._free(o, n)):
                    self._tier.put_index(index)
                else:
                    self._free(off, nbytes)
            pending = still

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._q.put(None)


class _Tier:
    """A worker's Store tier: its key, its puts, its counters."""

    def __init__(self, cfg: ec_config.ECMooncakeConfig, vllm_config: Any):
        self.settings = cfg.store
        self._model, self._encoder = identity(vllm_config)
        self._lock = threading.Lock()
        self._own = dict.fromkeys(OWN_COUNTERS, 0)
        self._reported: dict[str, int] = {}
        # How often _own moved, and how often as of the last increments():
        # unequal, a count waits for a step to report it (moved()).
        self._moves = 0
        self._reported_moves = 0
        factory = backend_factory or load_store_class()
        self.tier = StoreTier(self.settings, factory)
        self._device: _DeviceStaging | None = None

    def open(self, puts: bool = True) -> None:
        """Starts the Store client, and, for a process that puts (puts)
        and sees a GPU, the pinned pool GPU outputs are copied into
        (startup, not the engine loop: pinning memory takes time)."""
        self.tier.open()
        if self._device is not None or not puts:
            return
        try:
            torch = import_torch()
            if torch.cuda.is_available():
                self._device = _DeviceStaging(self, self.settings.put_inflight_bytes)
        except Exception as exc:  # noqa: BLE001 - without the pool GPU outputs are counted, not put
            logger.warning("ecmooncake: no pinned pool for GPU outputs to Mooncake Store (%s); they are not put", exc)

    def close(self) -> None:
        if self._device is not None:
            self._device.close()
        self.tier.close()

    def key(self, mm_hash: str, dtype: str, shape: tuple[int, ...]) -> str:
        return item_key(mm_hash, model=self._model, encoder_config=self._encoder, dtype=dtype, shape=shape,
                        tp_layout="replicated")

    def index_key(self, mm_hash: str) -> str:
        """The key of mm_hash's index: what a PD, which knows no dtype or
        shape ahead, gets first (:func:`ecmooncake.store.index_key`)."""
        return index_key(mm_hash, model=self._model, encoder_config=self._encoder, tp_layout="replicated")

    def put_index(self, index: tuple[str, bytes] | None) -> None:
        """Puts an index object (key, value) after its output's put was
        taken; its bytes live in the put's release callback until copied."""
        if index is None:
            return
        key, raw = index
        buf = ctypes.create_string_buffer(raw, len(raw))
        self.tier.put_async(key, ctypes.addressof(buf), len(raw), release=lambda: buf, index=True)

    def fetch(self, mm_hash: str, timeout: float | None = None) -> Fetched:
        """Gets mm_hash's output as an encoder of this deployment put it:
        its index, then its bytes (:meth:`ecmooncake.store.StoreTier.fetch`).
        Blocks at most get_timeout_s: for a thread of its own."""
        return self.tier.fetch(self.index_key(mm_hash), lambda idx: self.key(mm_hash, idx.dtype, idx.shape), timeout)

    def _count(self, name: str) -> None:
        with self._lock:
            self._own[name] += 1
            self._moves += 1

    def put(self, mm_hash: str, tensor: Any, stream: Any = None) -> None:
        """Offers one encoder output to the Store; never raises, never
        waits. A CPU tensor is kept referenced until the tier copied it; a
        CUDA one (produced on stream) is copied into the pinned pool first,
        or, without a pool, counted as put_skipped_device."""
        try:
            self._put(mm_hash, tensor, stream)
        except Exception as exc:  # noqa: BLE001 - a put is never worth an encoder output's push
            self._count("put_skipped_error")
            throttle.warn("store-put", "ecmooncake: Mooncake Store put of %s not made: %s: %s", mm_hash, type(exc).__name__, exc)

    def _put(self, mm_hash: str, tensor: Any, stream: Any) -> None:
        device = tensor.device.type
        if device != "cpu" and (device != "cuda" or self._device is None):
            self._count("put_skipped_device")
            throttle.warn("store-device", "ecmooncake: encoder outputs on %s are not put into Mooncake Store "
                          "(no pinned pool in this process; counted as put_skipped_device)", tensor.device)
            return
        try:
            dtype, shape = dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape)
            key = self.key(mm_hash, dtype, shape)
            index = (self.index_key(mm_hash), encode_index(dtype, shape, tensor.numel() * tensor.element_size()))
        except (ValueError, KeyError, TypeError) as exc:
            self._count("put_skipped_key")
            throttle.warn("store-key", "ecmooncake: no Store key for %s: %s", mm_hash, exc)
            return
        if device == "cuda":
            if self.tier.admit(key):
                self._device.put(key, tensor, stream, index)
            return
        src = tensor if tensor.is_contiguous() else tensor.contiguous()
        # Bound to the callback, the tensor lives until the tier's put
        # thread has copied it; a dropped put leaves it to the caller.
        if self.tier.put_async(key, src.data_ptr(), src.numel() * src.element_size(), release=lambda: src):
            self.put_index(index)

    def stats(self) -> dict[str, int]:
        """The tier's counters and this module's, since the process started."""
        out = self.tier.stats()
        with self._lock:
            out.update(self._own)
        return out

    def increments(self) -> dict[str, int]:
        """The counters that moved since the last call, by how much (the
        bytes in flight, which are no counters, and ``fallbacks``, a sum of
        others, are left out)."""
        with self._lock:
            moves = self._moves  # before the snapshot: a later move is reported next time
        now = {k: v for k, v in self.stats().items() if not k.endswith("_inflight_bytes") and k != "fallbacks"}
        with self._lock:
            out = {k: v - self._reported.get(k, 0) for k, v in now.items() if v != self._reported.get(k, 0)}
            self._reported = now
            self._reported_moves = moves
        return out

    def moved(self) -> bool:
        """Whether this module's counters moved since the last increments()."""
        return self._moves != self._reported_moves


def make(cfg: ec_config.ECMooncakeConfig, vllm_config: Any) -> _Tier | None:
    """The worker's tier, or None when ``store`` is off."""
    return _Tier(cfg, vllm_config) if cfg.store.enabled else None
