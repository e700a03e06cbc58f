"""The Mooncake Store tier inside the connector (``store`` in
``ec_connector_extra_config``; see :mod:`ecmooncake.store`).

One :class:`~ecmooncake.store.StoreTier` per worker process that uses it,
opened in the role's ``start`` (after vLLM forked the worker: the Store's
client starts threads) and closed in its ``close``. What this module adds
to the tier: the key of an item as this instance would need it
(:func:`identity`), the put of an encoder output with its outcome counted
when the tier cannot take it (a CUDA output), and the counters handed to
vLLM's stats as the increments since vLLM last asked.

Today the encoder side puts; a PD does not get yet (see docs/operations.md,
"Mooncake Store beside an EPD fleet").
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable, Mapping

from .. import ec_config
from ..store import StoreTier, item_key, load_store_class
from .dtypes import dtype_name
from .log import throttle

# The Store client's factory: None is the wheel's MooncakeDistributedStore.
# Tests name ecmooncake.store.MemoryStore here (an in-memory Store).
backend_factory: Callable[[], Any] | None = None

# This module's own counters, beside the tier's.
OWN_COUNTERS = ("put_skipped_device", "put_skipped_key")


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


class _Tier:
    """A worker's Store tier: its key, its puts, its counters."""

    def __init__(self, cfg: ec_config.ECMooncakeConfig, vllm_config: Any):
        self.settings = cfg.store
        self._model, self._encoder = identity(vllm_config)
        self._lock = threading.Lock()
        self._own = dict.fromkeys(OWN_COUNTERS, 0)
        self._reported: dict[str, int] = {}
        factory = backend_factory or load_store_class()
        self.tier = StoreTier(self.settings, factory)

    def open(self) -> None:
        self.tier.open()

    def close(self) -> None:
        self.tier.close()

    def key(self, mm_hash: str, dtype: str, shape: tuple[int, ...]) -> str:
        return item_key(mm_hash, model=self._model, encoder_config=self._encoder, dtype=dtype, shape=shape,
                        tp_layout="replicated")

    def _count(self, name: str) -> None:
        with self._lock:
            self._own[name] += 1

    def put(self, mm_hash: str, tensor: Any) -> None:
        """Offers one encoder output to the Store; never raises, never
        waits. A CPU tensor is kept referenced until the tier copied it; a
        CUDA one is not put (counted: copying it to host memory would need
        a stream and pinned memory of its own, which this path does not
        have yet)."""
        if tensor.device.type != "cpu":
            self._count("put_skipped_device")
            throttle.warn("store-device", "ecmooncake: encoder outputs on %s are not put into Mooncake Store "
                          "(only host memory is; counted as put_skipped_device)", tensor.device)
            return
        try:
            key = self.key(mm_hash, dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape))
        except (ValueError, KeyError, TypeError) as exc:
            self._count("put_skipped_key")
            throttle.warn("store-key", "ecmooncake: no Store key for %s: %s", mm_hash, exc)
            return
        src = tensor if tensor.is_contiguous() else tensor.contiguous()
        # Bound to the callback, the tensor lives until the tier's put
        # thread has copied it; a dropped put leaves it to the caller.
        self.tier.put_async(key, src.data_ptr(), src.numel() * src.element_size(), release=lambda: src)

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
        now = {k: v for k, v in self.stats().items() if not k.endswith("_inflight_bytes") and k != "fallbacks"}
        with self._lock:
            out = {k: v - self._reported.get(k, 0) for k, v in now.items() if v != self._reported.get(k, 0)}
            self._reported = now
        return out


def make(cfg: ec_config.ECMooncakeConfig, vllm_config: Any) -> _Tier | None:
    """The worker's tier, or None when ``store`` is off."""
    return _Tier(cfg, vllm_config) if cfg.store.enabled else None
