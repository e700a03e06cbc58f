"""Python objects that own the library's handles.

Errors (errors.py), the memory handed over (buffers.py) and the settings
read from the environment (environment.py) live in modules of their own and
are re-exported here, where callers have always found them.

Each class wraps one kind of native object: it opens the handle, turns every
failed status into an :class:`EcmError` carrying the library's message, keeps
alive the memory the library reads or writes, and closes the handle exactly
once. Structured values cross the boundary as JSON, and Python validates none
of what Go validates: a config dict goes through as it is. The encoder's
per-batch calls (:meth:`Producer.submit`, :meth:`Producer.sources`) are the
exception: each packs its batch into one buffer of binary records
(packed.py, include/ecmooncake.h) and crosses once, with no JSON unless an
item is refused.
"""

from __future__ import annotations

import json
import sys
from ctypes import byref, c_int32, c_uint64, c_void_p
from typing import Any

import numpy as np

from . import _ffi, trace as _trace
from .buffers import _EMPTY, _is_tensor, buffer_of, memory_of, shared_slab  # noqa: F401  (re-exported)
from .environment import (  # noqa: F401  (re-exported)
    METADATA_TOKEN_ENV,
    MOONCAKE_LIBRARY_ENV,
    SHIM_NAME,
    mooncake_wheel,
    with_metadata_token,
    with_mooncake_library,
)
from .errors import (  # noqa: F401  (re-exported)
    ERRORS,
    EcmError,
    EcmHandleError,
    EcmInternal,
    EcmInvalid,
    EcmIOError,
    EcmStateError,
    EcmTimeout,
    EcmUnavailable,
    REFUSALS,
    REFUSED_IN_PROGRESS,
    REFUSED_OVER_QUOTA,
    error_for,
    refusal_of,
)
from .auth import with_auth_default
from .packed import pack_pushes, pack_sources


def _encode(value: Any, what: str) -> bytes:
    # A str or bytes is taken as JSON text already, so that callers holding
    # JSON need not round-trip it through a dict.
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    try:
        return json.dumps(value, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise EcmInvalid(f"{what}: not JSON-serializable: {exc}") from exc


def _call(name: str, *args: Any, out: bool = False, optional: bool = False) -> Any:
    """Calls ``name(*args[, &out_json], &err)``; returns the decoded out_json
    (None when ``optional`` and the library wrote none).

    Raises the EcmError for the status, with the library's message prefixed
    by the function name.
    """
    fn = _ffi.function(name)
    dll = _ffi.lib()
    err = c_void_p()
    text = None
    if out:
        out_json = c_void_p()
        rc = fn(*args, byref(out_json), byref(err))
        text = _ffi.take_string(dll, out_json)
    else:
        rc = fn(*args, byref(err))
    message = _ffi.take_string(dll, err) if err.value else None
    if rc != _ffi.ECM_OK:
        message = message or f"failed with status {rc}"
        # Checks at the boundary already name the export.
        if not message.startswith(f"{name}: "):
            message = f"{name}: {message}"
        raise error_for(rc, message)
    if not out or (optional and text is None):
        return None
    if text is None:
        raise EcmInternal(f"{name}: returned no JSON")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise EcmInternal(f"{name}: returned undecodable JSON: {exc}") from exc


def configure(**settings: Any) -> None:
    """Process-wide settings, e.g. ``configure(gomaxprocs=2, log_level="warn")``.

    Call before opening objects; later calls change only the log level.
    """
    _call("ecm_configure", _encode(settings, "settings"))


def gpu_info() -> dict:
    """Whether this process can use GPU memory: available, reason,
    driver_version, devices. Opens the CUDA driver on first use."""
    return _call("ecm_gpu_info", out=True)


def mooncake_info(library: str | None = None, engine: str | None = None) -> dict:
    """Whether Mooncake's TransferEngine serves the mooncake transport here:
    library, engine and version (with a wheel), available, reason, symbols
    (the functions it needs).

    With neither given, the engine a consumer or producer would load:
    $ECMOONCAKE_MOONCAKE_LIBRARY, else the installed Mooncake wheel through
    this package's shim, else libtransfer_engine.so on the loader's search
    path. Loads the library; creates no engine."""
    if library is None and engine is None:
        filled = with_mooncake_library({"transport": "mooncake"})
        library, engine = filled.get("mooncake_library", ""), filled.get("mooncake_engine", "")
    return _call(
        "ecm_mooncake_info", _encode({"library": library or "", "engine": engine or ""}, "mooncake_info"), out=True
    )


def trace(capacity: int | None = None, drain: bool = False) -> dict:
    """This process's ring of Go ready-path stamps (ecm_trace): ``capacity``
    starts a fresh ring of that many entries (0 turns it off), ``drain``
    takes the stamps since the last drain as [hop, mm_hash, ns] lists.
    ecmooncake.trace reads it beside Python's own ring."""
    request: dict[str, Any] = {"drain": bool(drain)}
    if capacity is not None:
        request["capacity"] = int(capacity)
    return _call("ecm_trace", _encode(request, "trace"), out=True)


def trace_enable(capacity: int) -> None:
    """Starts fresh rings of ready-path stamps in this process, Python's
    (ecmooncake.trace) and the library's, of ``capacity`` entries each (0:
    off)."""
    _trace.enable(capacity)
    trace(capacity=max(0, int(capacity)))


def trace_drain() -> dict:
    """This process's stamps since the last drain, Python's and the
    library's together, sorted by time: {"capacity", "dropped", "stamps":
    [[hop, mm_hash, CLOCK_MONOTONIC ns], ...]}."""
    out = _trace.drain()
    got = trace(drain=True)
    out["capacity"] = max(out["capacity"], int(got.get("capacity") or 0))
    out["dropped"] += int(got.get("dropped") or 0)
    out["stamps"] += got.get("stamps") or []
    out["stamps"].sort(key=lambda s: s[2])
    return out


class _Region:
    """Exposes raw memory to numpy while holding its owner alive."""

    def __init__(self, owner: Any, ptr: int, nbytes: int):
        self.owner = owner
        self.__array_interface__ = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
        }


class _Handle:
    """Owns one library handle; closes it once."""

    kind = "object"

    def __init__(self) -> None:
        self._h = 0

    @property
    def handle(self) -> int:
        self._check_open()
        return self._h

    def _check_open(self) -> None:
        if not self._h:
            raise EcmHandleError(f"{self.kind} is closed")

    @property
    def closed(self) -> bool:
        return not self._h

    def _open(self, name: str, *args: Any) -> None:
        out = c_uint64(0)
        _call(name, *args, byref(out))
        self._h = out.value

    def stats(self) -> dict:
        return _call("ecm_stats", self.handle, out=True)

    def close(self) -> None:
        h, self._h = self._h, 0
        if not h:
            return
        try:
            _call("ecm_close", h)
        finally:
            self._drop_memory()

    def _drop_memory(self) -> None:
        """Lets go of memory the library no longer touches once closed."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = f"handle={self._h}" if self._h else "closed"
        return f"<{type(self).__name__} {state}>"


class Consumer(_Handle):
    """One consumer shard: a receive slab and the control server of its TP rank.

    ``slab`` is a writable C-contiguous numpy array or torch tensor of any
    dtype, in host memory or on a CUDA device; items land in it and
    :meth:`view` reads them without copying.
    """

    kind = "consumer"

    def __init__(self, config: dict | str, slab: Any):
        super().__init__()
        ptr, nbytes, device = memory_of(slab, writable=True)
        self._slab = slab
        self.device = "cpu" if device < 0 else f"cuda:{device}"
        encoded = _encode(with_auth_default(with_metadata_token(with_mooncake_library(config))), "consumer config")
        if device < 0:
            self._bytes = np.asarray(_Region(slab, ptr, nbytes))
            self._open("ecm_consumer_open", encoded, c_void_p(ptr), c_uint64(nbytes))
            return
        # A flat byte view of the whole slab, on its device.
        torch = sys.modules["torch"]
        self._bytes = slab.reshape(-1).view(torch.uint8)
        self._open(
            "ecm_consumer_open_device",
            encoded,
            c_void_p(ptr),
            c_uint64(nbytes),
            c_int32(device),
        )

    @property
    def slab_nbytes(self) -> int:
        return int(self._bytes.nbytes)

    def info(self) -> dict:
        return _call("ecm_consumer_info", self.handle, out=True)

    def acquire(self, mm_hashes: list[str]) -> list[dict]:
        """Pins ready items; each dict has mm_hash, offset, nbytes, error."""
        body = _encode({"mm_hashes": list(mm_hashes)}, "acquire")
        return _call("ecm_consumer_acquire", self.handle, body, out=True)["items"]

    def release(self, mm_hashes: list[str]) -> list[dict]:
        body = _encode({"mm_hashes": list(mm_hashes)}, "release")
        return _call("ecm_consumer_release", self.handle, body, out=True)["items"]

    def view(self, offset: int, nbytes: int) -> Any:
        """A zero-copy uint8 view of ``[offset, offset+nbytes)`` of the slab:
        a numpy array for a host slab, a torch tensor on the slab's device
        for a CUDA one."""
        self._check_open()
        if offset < 0 or nbytes < 0 or offset + nbytes > self._bytes.nbytes:
            raise EcmInvalid(
                f"region [{offset}, {offset + nbytes}) lies outside the "
                f"{self._bytes.nbytes}-byte slab"
            )
        return self._bytes[offset : offset + nbytes]


class Producer(_Handle):
    """The encoder side: announces pushes, hands over sources, reports outcomes."""

    kind = "producer"

    def __init__(self, config: dict | str):
        super().__init__()
        self._sources: dict[int, Any] = {}
        self._open("ecm_producer_open", _encode(with_auth_default(with_mooncake_library(config)), "producer config"))

    def submit(self, pushes: list[dict]) -> list[dict]:
        """Announces pushes (dicts of transfer_id, mm_hash, nbytes, consumer
        and optionally meta) in one call; per-item dicts carry transfer_id,
        and error when that push was refused."""
        pushes = list(pushes)
        _trace.stamp_all("submit", (p.get("mm_hash") for p in pushes))
        body = pack_pushes(pushes)
        reasons = _call("ecm_producer_submit_packed", self.handle, len(pushes), body, len(body), out=True, optional=True)
        if reasons is None:
            return [{"transfer_id": p.get("transfer_id")} for p in pushes]
        if not isinstance(reasons, list) or len(reasons) != len(pushes):
            raise EcmInternal(f"ecm_producer_submit_packed: {len(pushes)} pushes but reasons {reasons!r:.200}")
        return [
            {"transfer_id": p.get("transfer_id"), "error": why} if why else {"transfer_id": p.get("transfer_id")}
            for p, why in zip(pushes, reasons)
        ]

    def source(self, mm_hash: str, array: Any) -> int:
        """Hands over the encoder output of ``mm_hash``; returns its source id.

        ``array`` is kept alive until :meth:`poll` reports the id released.
        """
        return self.sources([(mm_hash, array)])[0]

    def sources(self, items: list[tuple[str, Any]], stream: Any = None) -> list[int]:
        """Hands over several encoder outputs in one call, so that they go
        out as one write batch per consumer shard; returns their source ids.

        Outputs may be CUDA tensors: the library then reads each only after
        the work queued so far on ``stream`` (a torch.cuda.Stream or a raw
        cudaStream_t; by default the tensor device's current stream) has
        completed. The call does not wait for that work.

        When the library refuses some, the call raises, and the ones it took
        are still held until :meth:`poll` reports them released.
        """
        items = list(items)
        _trace.stamp_all("hand_over", (h for h, _ in items))
        n = len(items)
        if n == 0:
            return []
        body = pack_sources(items, stream)
        out = (c_uint64 * n)()
        try:
            _call("ecm_producer_sources_packed", self.handle, n, body, len(body), out)
        finally:
            # One slice turns the ids into ints in C; iterating the ctypes
            # array converts each in a Python-level call, twice.
            ids = out[:]
            for source_id, (_, array) in zip(ids, items):
                if source_id:
                    self._sources[source_id] = array
        return ids

    @property
    def held_sources(self) -> int:
        """Sources the library may still read."""
        return len(self._sources)

    def cancel(self, transfer_ids: list[str]) -> None:
        body = _encode({"transfer_ids": list(transfer_ids)}, "cancel")
        _call("ecm_producer_cancel", self.handle, body)

    def poll(self, timeout_ms: int = 0) -> dict:
        """Outcomes since the last poll: done, failed, released, pending."""
        out = _call("ecm_producer_poll", self.handle, c_int32(timeout_ms), out=True)
        for source_id in out.get("released") or ():
            self._sources.pop(int(source_id), None)
        return out

    def _drop_memory(self) -> None:
        self._sources.clear()


class Scheduler(_Handle):
    """The consumer instance's engine-core view: which items can load now."""

    kind = "scheduler"

    def __init__(self, config: dict | str):
        super().__init__()
        # The library stores the table's generation here after every change
        # that can alter an answer (ecm_scheduler_watch), until close:
        # reading it is a memory load, not a call.
        self.generation_counter = c_uint64(0)
        self._poll_out = c_int32(0)  # poll's answer, allocated once
        self._open("ecm_scheduler_open", _encode(with_auth_default(config), "scheduler config"))
        try:
            _call("ecm_scheduler_watch", self._h, byref(self.generation_counter))
        except BaseException:
            self.close()
            raise

    def generation(self) -> int:
        """The table's generation: answers given at it stand until it moves.
        A step's answer names its own as ``"generation"``."""
        return self.generation_counter.value

    def step(self, request: dict | str) -> dict:
        return _call(
            "ecm_scheduler_step", self.handle, _encode(request, "step"), out=True
        )

    def has(self, mm_hash: str) -> bool:
        out = c_int32(0)
        _call("ecm_scheduler_has", self.handle, mm_hash.encode("utf-8"), byref(out))
        return bool(out.value)

    def poll(self) -> int:
        """Applies the same-host shards' events that have arrived, on this
        thread, without waiting; returns how many (ecm_scheduler_poll)."""
        _call("ecm_scheduler_poll", self.handle, byref(self._poll_out))
        return self._poll_out.value

    def wait(self, transfer_ids: list[str], timeout_ms: int) -> dict:
        """Blocks until each transfer is available or failed, or the timeout."""
        body = _encode({"transfer_ids": list(transfer_ids)}, "wait")
        return _call(
            "ecm_scheduler_wait", self.handle, body, c_int32(timeout_ms), out=True
        )


class MetadataServer(_Handle):
    """A Mooncake-compatible metadata store (``GET/PUT/DELETE /metadata?key=K``,
    ``GET /health``) for TransferEngines in HTTP metadata mode, served in the
    background until :meth:`close`.

    ``port=0`` picks a free port; :attr:`url` is the metadata connection
    string an engine on this host uses. Every /metadata request must carry
    ``Authorization: Bearer <token>`` (what Mooncake sends when
    MC_METADATA_HTTP_TOKEN is set); without a token the store refuses to
    start unless ``open=True`` (served to anybody, logged loudly). It listens on loopback unless
    ``host`` says otherwise. ``max_keys``, ``max_value_bytes`` and
    ``max_total_bytes`` bound it (0: 65536 keys, 16 MiB, 256 MiB); a value
    too large gets 413, a PUT into a full store 507. ``max_conns`` and
    ``max_conns_per_peer`` (0: 1024, 256) bound its connections: at a limit
    an idle connection that has sent no request with the token makes room.
    """

    kind = "metadata server"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8080,
        token: str | None = None,
        *,
        open: bool = False,
        max_keys: int = 0,
        max_value_bytes: int = 0,
        max_total_bytes: int = 0,
        max_conns: int = 0,
        max_conns_per_peer: int = 0,
    ):
        super().__init__()
        config: dict[str, Any] = {
            "host": host,
            "port": int(port),
            "max_keys": int(max_keys),
            "max_value_bytes": int(max_value_bytes),
            "max_total_bytes": int(max_total_bytes),
            "max_conns": int(max_conns),
            "max_conns_per_peer": int(max_conns_per_peer),
        }
        if token:
            config["token"] = token
        if open:
            config["open"] = True
        self._open("ecm_metadata_server_open", _encode(config, "metadata server config"))

    @property
    def address(self) -> str:
        """host:port it listens on."""
        return str(self.stats()["addr"])

    @property
    def url(self) -> str:
        """``http://host:port/metadata``."""
        return str(self.stats()["url"])


__all__ = [
    "Consumer",
    "EcmError",
    "EcmHandleError",
    "EcmIOError",
    "EcmInternal",
    "EcmInvalid",
    "EcmStateError",
    "EcmTimeout",
    "EcmUnavailable",
    "ERRORS",
    "MetadataServer",
    "Producer",
    "Scheduler",
    "buffer_of",
    "configure",
    "error_for",
    "gpu_info",
    "memory_of",
    "mooncake_info",
    "with_metadata_token",
    "with_mooncake_library",
    "mooncake_wheel",
]
