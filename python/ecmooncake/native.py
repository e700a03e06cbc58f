"""Python objects that own the library's handles.

Each class wraps one kind of native object: it opens the handle, turns every
failed status into an :class:`EcmError` carrying the library's message, keeps
alive the memory the library reads or writes, and closes the handle exactly
once. Structured values cross the boundary as JSON, and Python validates none
of what Go validates: a config dict goes through as it is.
"""

from __future__ import annotations

import json
import sys
from ctypes import byref, c_char_p, c_int32, c_uint64, c_void_p
from typing import Any

import numpy as np

from . import _ffi


class EcmError(RuntimeError):
    """A failed library call; ``code`` is the ECM_ERR_* status."""

    code = _ffi.ECM_ERR_INTERNAL

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class EcmInvalid(EcmError, ValueError):
    code = _ffi.ECM_ERR_INVALID


class EcmHandleError(EcmError):
    code = _ffi.ECM_ERR_HANDLE


class EcmStateError(EcmError):
    code = _ffi.ECM_ERR_STATE


class EcmIOError(EcmError):
    code = _ffi.ECM_ERR_IO


class EcmTimeout(EcmError, TimeoutError):
    code = _ffi.ECM_ERR_TIMEOUT


class EcmInternal(EcmError):
    code = _ffi.ECM_ERR_INTERNAL


class EcmUnavailable(EcmError):
    code = _ffi.ECM_ERR_UNAVAILABLE


ERRORS: dict[int, type[EcmError]] = {
    cls.code: cls
    for cls in (
        EcmInvalid,
        EcmHandleError,
        EcmStateError,
        EcmIOError,
        EcmTimeout,
        EcmInternal,
        EcmUnavailable,
    )
}


def error_for(code: int, message: str) -> EcmError:
    """The EcmError subclass for a status code (plain EcmError if unknown)."""
    cls = ERRORS.get(code)
    if cls is None:
        return EcmError(message, code)
    return cls(message)


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


def _call(name: str, *args: Any, out: bool = False) -> Any:
    """Calls ``name(*args[, &out_json], &err)``; returns the decoded out_json.

    Raises the EcmError for the status, with the library's message prefixed
    by the function name.
    """
    dll = _ffi.lib()
    err = c_void_p()
    out_json = c_void_p()
    if out:
        rc = getattr(dll, name)(*args, byref(out_json), byref(err))
    else:
        rc = getattr(dll, name)(*args, byref(err))
    message = _ffi.take_string(dll, err)
    text = _ffi.take_string(dll, out_json)
    if rc != _ffi.ECM_OK:
        raise error_for(rc, f"{name}: {message or f'failed with status {rc}'}")
    if not out:
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


def bench_tcp_loopback(nbytes: int, streams: int = 1) -> float:
    """Raw Go TCP loopback throughput in bytes/s: the TCP data plane's ceiling."""
    out = _call(
        "ecm_bench_tcp_loopback",
        _encode({"bytes": int(nbytes), "streams": int(streams)}, "bench"),
        out=True,
    )
    return float(out["bytes_per_sec"])


def buffer_of(obj: Any, writable: bool = False) -> tuple[int, int]:
    """(data pointer, nbytes) of a C-contiguous numpy array or CPU torch tensor.

    The caller keeps ``obj`` alive for as long as the library may touch it.
    """
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise EcmInvalid(
                f"array of shape {obj.shape} is not C-contiguous; "
                "pass np.ascontiguousarray(a)"
            )
        if writable and not obj.flags.writeable:
            raise EcmInvalid("array is read-only; the library must write into it")
        return int(obj.ctypes.data), int(obj.nbytes)
    if _is_tensor(obj):
        if obj.device.type != "cpu":
            raise EcmInvalid(
                f"tensor is on {obj.device}; only CPU memory can be passed here"
            )
        if not obj.is_contiguous():
            raise EcmInvalid(
                f"tensor of shape {tuple(obj.shape)} is not contiguous; "
                "pass t.contiguous()"
            )
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
    raise EcmInvalid(
        f"expected a numpy array or a CPU torch tensor, got {type(obj).__name__}"
    )


def _is_tensor(obj: Any) -> bool:
    # torch is optional and heavy: a tensor can exist only if torch is
    # already imported, so look it up instead of importing it.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


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

    ``slab`` is a writable C-contiguous numpy array or CPU torch tensor of any
    dtype; items land in it and :meth:`view` reads them without copying.
    """

    kind = "consumer"

    def __init__(self, config: dict | str, slab: Any):
        super().__init__()
        ptr, nbytes = buffer_of(slab, writable=True)
        self._slab = slab
        self._bytes = np.asarray(_Region(slab, ptr, nbytes))
        self._open(
            "ecm_consumer_open",
            _encode(config, "consumer config"),
            c_void_p(ptr),
            c_uint64(nbytes),
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

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A zero-copy uint8 view of ``[offset, offset+nbytes)`` of the slab."""
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
        self._open("ecm_producer_open", _encode(config, "producer config"))

    def submit(self, pushes: list[dict]) -> list[dict]:
        """Announces pushes; per-item dicts carry transfer_id and error."""
        body = _encode({"pushes": list(pushes)}, "submit")
        return _call("ecm_producer_submit", self.handle, body, out=True)["items"]

    def source(self, mm_hash: str, array: Any) -> int:
        """Hands over the encoder output of ``mm_hash``; returns its source id.

        ``array`` is kept alive until :meth:`poll` reports the id released.
        """
        return self.sources([(mm_hash, array)])[0]

    def sources(self, items: list[tuple[str, Any]]) -> list[int]:
        """Hands over several encoder outputs in one call, so that they go
        out as one write batch per consumer shard; returns their source ids.

        When the library refuses some, the call raises, and the ones it took
        are still held until :meth:`poll` reports them released.
        """
        items = list(items)
        n = len(items)
        if n == 0:
            return []
        buffers = [buffer_of(array) for _, array in items]
        hashes = (c_char_p * n)(*[h.encode("utf-8") for h, _ in items])
        ptrs = (c_void_p * n)(*[ptr for ptr, _ in buffers])
        sizes = (c_uint64 * n)(*[nbytes for _, nbytes in buffers])
        ids = (c_uint64 * n)()
        try:
            _call("ecm_producer_sources", self.handle, c_uint64(n), hashes, ptrs, sizes, ids)
        finally:
            for source_id, (_, array) in zip(ids, items):
                if source_id:
                    self._sources[source_id] = array
        return list(ids)

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
        self._open("ecm_scheduler_open", _encode(config, "scheduler config"))

    def step(self, request: dict | str) -> dict:
        return _call(
            "ecm_scheduler_step", self.handle, _encode(request, "step"), out=True
        )

    def has(self, mm_hash: str) -> bool:
        out = c_int32(0)
        _call("ecm_scheduler_has", self.handle, mm_hash.encode("utf-8"), byref(out))
        return bool(out.value)

    def wait(self, transfer_ids: list[str], timeout_ms: int) -> dict:
        """Blocks until each transfer is available or failed, or the timeout."""
        body = _encode({"transfer_ids": list(transfer_ids)}, "wait")
        return _call(
            "ecm_scheduler_wait", self.handle, body, c_int32(timeout_ms), out=True
        )


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
    "Producer",
    "Scheduler",
    "bench_tcp_loopback",
    "buffer_of",
    "configure",
    "error_for",
]
