"""What every part of the connector shares: the names vLLM knows it by, the
metadata that crosses from the scheduler to the workers and back, the guard
that keeps exceptions out of vLLM's engine loop, and the helpers that read
a request's transfer ids."""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import ec_config
from ..native import configure

# A child of vLLM's logger, so that these lines carry vLLM's format and obey
# VLLM_LOGGING_LEVEL; a logger outside that tree has no handler in vLLM.
logger = logging.getLogger("vllm.ecmooncake")

CONNECTOR_NAME = "ECMooncakeConnector"
# The same class under a name vLLM's factory does not register, for
# ec_connector_module_path: the factory ignores the module path for names
# it knows, and recent vLLM knows ECMooncakeConnector as its own.
MODULE_PATH_NAME = "EcmooncakeConnector"

# Hooks that only some vLLM releases call, with what their absence costs;
# the connector adapts where it can (see hooks._Connector) and says so at startup.
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
        return _description(self.dtype, tuple(self.shape or ()))


@functools.lru_cache(maxsize=4096)
def _description(dtype: str | None, shape: tuple[int, ...]) -> str:
    # Every push of a step is described on the encoder's per-batch path,
    # and a model's outputs come in few shapes: JSON once a shape, not once
    # an item.
    return json.dumps({"dtype": dtype, "shape": list(shape)}, separators=(",", ":"))


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


def _hook_failed(name: str, exc: Exception) -> None:
    """Logs a hook's failure, throttled per hook; the hook then answers its default."""
    _throttle.warn(
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
