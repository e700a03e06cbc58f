"""Python objects that own the library's handles.

Each class wraps one kind of native object: it opens the handle, turns every
failed status into an :class:`EcmError` carrying the library's message, keeps
alive the memory the library reads or writes, and closes the handle exactly
once. Structured values cross the boundary as JSON, and Python validates none
of what Go validates: a config dict goes through as it is.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import sys
import weakref
from ctypes import byref, c_char_p, c_int32, c_uint64, c_void_p
from typing import Any, Callable

import numpy as np

from . import _ffi
from .auth import with_auth_default


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


# Refusals of a reservation that a producer reports by name, at the start
# of a failed push's reason ("reserve refused: over_quota: ..."), as the
# shard names them (core/wire GrantInProgress, GrantOverQuota).
REFUSED_IN_PROGRESS = "in_progress"  # another producer holds this transfer's write grant
REFUSED_OVER_QUOTA = "over_quota"  # this producer holds its share of the shard's reservations
REFUSALS = (REFUSED_IN_PROGRESS, REFUSED_OVER_QUOTA)


def refusal_of(reason: str) -> str | None:
    """The named refusal of a failed push's reason, or None."""
    head = reason.removeprefix("reserve refused: ")
    name, sep, _ = head.partition(":")
    return name if sep and head is not reason and name in REFUSALS else None


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
        message = message or f"failed with status {rc}"
        # Checks at the boundary already name the export.
        if not message.startswith(f"{name}: "):
            message = f"{name}: {message}"
        raise error_for(rc, message)
    if not out:
        return None
    if text is None:
        raise EcmInternal(f"{name}: returned no JSON")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise EcmInternal(f"{name}: returned undecodable JSON: {exc}") from exc


MOONCAKE_LIBRARY_ENV = "ECMOONCAKE_MOONCAKE_LIBRARY"


def with_mooncake_library(config: Any) -> Any:
    """Fills ``mooncake_library`` from $ECMOONCAKE_MOONCAKE_LIBRARY.

    Only for an object whose ``transport`` is ``"mooncake"`` and whose
    settings leave the key out. Go reads no environment variables (it sees
    only the environment the process started with), so Python passes the
    path down as a setting. Anything else is returned unchanged.
    """
    return _fill_from_env(
        config, MOONCAKE_LIBRARY_ENV, "mooncake_library", lambda c: c.get("transport") == "mooncake"
    )


def _fill_from_env(config: Any, env: str, key: str, applies: Callable[[dict], Any]) -> Any:
    """config with key set from $env, where applies(config) and the key is
    not given; a config that does not parse is left for the library to
    report."""
    value = os.environ.get(env)
    if not value:
        return config
    parsed = config
    if isinstance(config, (str, bytes)):
        try:
            parsed = json.loads(config)
        except ValueError:
            return config
    if not isinstance(parsed, dict) or not applies(parsed) or key in parsed:
        return config
    return {**parsed, key: value}


METADATA_TOKEN_ENV = "MC_METADATA_HTTP_TOKEN"


def with_metadata_token(config: Any) -> Any:
    """Fills ``mooncake_metadata_token`` from $MC_METADATA_HTTP_TOKEN.

    Only for a consumer that serves a metadata store
    (``mooncake_metadata_server``) and leaves the key out: Mooncake's
    engines read the same variable and send it with every metadata request,
    so the store it serves then refuses everyone else. Go reads no
    environment variables, so Python passes it down. Anything else is
    returned unchanged.
    """
    return _fill_from_env(
        config, METADATA_TOKEN_ENV, "mooncake_metadata_token", lambda c: c.get("mooncake_metadata_server")
    )


def configure(**settings: Any) -> None:
    """Process-wide settings, e.g. ``configure(gomaxprocs=2, log_level="warn")``.

    Call before opening objects; later calls change only the log level.
    """
    _call("ecm_configure", _encode(settings, "settings"))


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


def memory_of(obj: Any, writable: bool = False) -> tuple[int, int, int]:
    """(data pointer, nbytes, device) of a C-contiguous numpy array or a
    contiguous torch tensor in host or CUDA memory.

    device is -1 for host memory, else the CUDA device ordinal; the calls
    that take memory with a device (a Consumer's slab, Producer.sources)
    accept both. The caller keeps ``obj`` alive for as long as the library
    may touch it.
    """
    if _is_tensor(obj) and obj.device.type == "cuda":
        if not obj.is_contiguous():
            raise EcmInvalid(
                f"tensor of shape {tuple(obj.shape)} is not contiguous; "
                "pass t.contiguous()"
            )
        index = getattr(obj.device, "index", None)
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), int(index or 0)
    if _is_tensor(obj) and obj.device.type != "cpu":
        raise EcmInvalid(f"tensor is on {obj.device}; the library takes host or CUDA memory")
    ptr, nbytes = buffer_of(obj, writable)
    return ptr, nbytes, -1


def shared_slab(nbytes: int) -> tuple[np.ndarray, int]:
    """A receive slab in shared memory, for a Consumer on the ``shm`` transport.

    Returns ``(array, fd)``: a writable uint8 array of ``nbytes`` bytes,
    mapped shared from a new memfd, and that memfd's descriptor, to pass as
    ``"slab_fd"`` in the consumer's config. The shard hands the descriptor
    to producers on this host over a Unix socket (never a path), so there
    is no file in /dev/shm and nothing is left behind when the process is
    killed. Every page is allocated now, so that running out of memory
    fails here, and the memfd is sealed against shrinking, so that no
    producer's copy can meet a truncated slab. The descriptor is closed
    once the array (and every view of it) is gone; the memory is freed
    when the last mapping of it, in any process, goes.
    """
    nbytes = int(nbytes)
    if nbytes <= 0:
        raise EcmInvalid(f"shared_slab: nbytes = {nbytes}; want a positive size")
    try:
        fd = os.memfd_create("ecmooncake-slab", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise EcmIOError(f"shared_slab: cannot create a memfd: {exc}") from exc
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            raise EcmIOError(
                f"shared_slab: cannot allocate {nbytes} bytes of shared memory: {exc}; "
                "see `free -b` and the memory limit of this process's cgroup"
            ) from exc
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mapped, os.close, fd)
    return np.frombuffer(mapped, dtype=np.uint8), fd


def gpu_info() -> dict:
    """Whether this process can use GPU memory: available, reason,
    driver_version, devices. Opens the CUDA driver on first use."""
    return _call("ecm_gpu_info", out=True)


def mooncake_info(library: str | None = None) -> dict:
    """Whether Mooncake's TransferEngine serves the mooncake transport here:
    library, available, reason, symbols (the functions it needs).

    ``library`` defaults to $ECMOONCAKE_MOONCAKE_LIBRARY, then
    libtransfer_engine.so on the loader's search path, as for a consumer
    or producer. Loads the library; creates no engine."""
    if library is None:
        library = os.environ.get(MOONCAKE_LIBRARY_ENV, "")
    return _call("ecm_mooncake_info", _encode({"library": library}, "mooncake_info"), out=True)


def _stream_handle(stream: Any, tensor: Any) -> int:
    """The cudaStream_t whose queued work produces ``tensor``: ``stream``
    (a torch.cuda.Stream or a raw handle), else the tensor device's current
    stream."""
    if stream is None:
        torch = sys.modules["torch"]
        return int(torch.cuda.current_stream(tensor.device).cuda_stream)
    if isinstance(stream, int):
        return stream
    return int(stream.cuda_stream)


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
        """Announces pushes; per-item dicts carry transfer_id and error."""
        body = _encode({"pushes": list(pushes)}, "submit")
        return _call("ecm_producer_submit", self.handle, body, out=True)["items"]

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
        n = len(items)
        if n == 0:
            return []
        buffers = [memory_of(array) for _, array in items]
        hashes = (c_char_p * n)(*[h.encode("utf-8") for h, _ in items])
        ptrs = (c_void_p * n)(*[ptr for ptr, _, _ in buffers])
        sizes = (c_uint64 * n)(*[nbytes for _, nbytes, _ in buffers])
        ids = (c_uint64 * n)()
        devices = (c_int32 * n)(*[device for _, _, device in buffers])
        handles: dict[int, int] = {}
        for (_, array), (_, _, device) in zip(items, buffers):
            if device >= 0 and device not in handles:
                handles[device] = _stream_handle(stream, array)
        streams = (c_uint64 * n)(*[handles.get(device, 0) for _, _, device in buffers])
        try:
            _call(
                "ecm_producer_sources_device",
                self.handle,
                c_uint64(n),
                hashes,
                ptrs,
                sizes,
                devices,
                streams,
                ids,
            )
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
        # The library stores the table's generation here after every change
        # that can alter an answer (ecm_scheduler_watch), until close:
        # reading it is a memory load, not a call.
        self.generation_counter = c_uint64(0)
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
    too large gets 413, a PUT into a full store 507.
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
    ):
        super().__init__()
        config: dict[str, Any] = {
            "host": host,
            "port": int(port),
            "max_keys": int(max_keys),
            "max_value_bytes": int(max_value_bytes),
            "max_total_bytes": int(max_total_bytes),
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
]
