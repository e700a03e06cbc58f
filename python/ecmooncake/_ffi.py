"""Raw ctypes prototypes of libecmooncake.so, one to one with include/ecmooncake.h.

Nothing here loads the library at import: vLLM imports this package in
processes that later fork, and a Go runtime started before a fork is broken
in the child. The first call to :func:`lib` loads it.

Out-parameters that receive strings from the library (``out_json``, ``err``)
are declared as ``void **`` rather than ``char **`` so that the caller keeps
the raw pointer and can hand it back to ``ecm_free``; ctypes would otherwise
copy the text into a Python bytes object and lose the pointer.

Two handles of the one library: which a function is called through decides
whether the calling thread lets go of the GIL while the library runs.

- ``ctypes.CDLL`` releases the GIL for the call and takes it back after.
  Taking it back waits for whichever Python thread took it meanwhile to
  reach its switch interval (5 ms by default): behind a busy Python thread
  a call of one microsecond takes milliseconds. Every call that can wait
  (a poll or a scheduler wait with a timeout, opens that dial or resolve,
  close, anything that reads a socket or takes a lock held across I/O)
  goes through it, so that the other Python threads run meanwhile.
- ``ctypes.PyDLL`` keeps the GIL. Only the functions of :data:`HOLD_GIL`
  go through it: each returns in microseconds without waiting on I/O, on
  another thread, or on a lock that anything holds across I/O, so that no
  Python thread can be left waiting on them. The encoder's two per-batch
  calls decode their records, hand them to the producer under its lock
  (never held across I/O; the network work runs on the library's own
  threads) and return; recording a CUDA event queues it on the stream and
  does not wait for the stream. The PD scheduler's step, poll and has
  read the same-host shards' sockets without waiting and answer from the
  table. What the producer and the scheduler log under their locks is
  queued for a goroutine of its own to write (core/internal/logqueue), so
  that a stderr pipe that no one drains holds up none of them.

:func:`function` returns a function through the handle its name calls for;
:func:`lib` is the CDLL, with every function, for callers that must not
hold the GIL whatever they call (tests, tools).
"""

from __future__ import annotations

import ctypes
import os
import threading
from ctypes import POINTER, c_char_p, c_int, c_int32, c_uint64, c_void_p
from pathlib import Path
from typing import Any

ABI_VERSION = 3

ECM_OK = 0
ECM_ERR_INVALID = 1
ECM_ERR_HANDLE = 2
ECM_ERR_STATE = 3
ECM_ERR_IO = 4
ECM_ERR_TIMEOUT = 5
ECM_ERR_INTERNAL = 6
ECM_ERR_UNAVAILABLE = 7

ECM_MAX_SOURCES = 65536

LIBRARY_NAME = "libecmooncake.so"
LIBRARY_ENV = "ECMOONCAKE_LIBRARY"

ecm_handle_t = c_uint64
c_str_out = POINTER(c_void_p)

# name -> (restype, argtypes), in header order.
PROTOTYPES: dict[str, tuple[object, tuple[object, ...]]] = {
    "ecm_abi_version": (c_int, (POINTER(c_int32), c_str_out)),
    "ecm_free": (None, (c_void_p,)),
    "ecm_configure": (c_int, (c_char_p, c_str_out)),
    "ecm_gpu_info": (c_int, (c_str_out, c_str_out)),
    "ecm_mooncake_info": (c_int, (c_char_p, c_str_out, c_str_out)),
    "ecm_stats": (c_int, (ecm_handle_t, c_str_out, c_str_out)),
    "ecm_close": (c_int, (ecm_handle_t, c_str_out)),
    "ecm_trace": (c_int, (c_char_p, c_str_out, c_str_out)),
    "ecm_consumer_open": (
        c_int,
        (c_char_p, c_void_p, c_uint64, POINTER(ecm_handle_t), c_str_out),
    ),
    "ecm_consumer_open_device": (
        c_int,
        (c_char_p, c_void_p, c_uint64, c_int32, POINTER(ecm_handle_t), c_str_out),
    ),
    "ecm_consumer_info": (c_int, (ecm_handle_t, c_str_out, c_str_out)),
    "ecm_consumer_acquire": (c_int, (ecm_handle_t, c_char_p, c_str_out, c_str_out)),
    "ecm_consumer_release": (c_int, (ecm_handle_t, c_char_p, c_str_out, c_str_out)),
    "ecm_producer_open": (c_int, (c_char_p, POINTER(ecm_handle_t), c_str_out)),
    "ecm_producer_submit_packed": (
        c_int,
        (ecm_handle_t, c_uint64, c_void_p, c_uint64, c_str_out, c_str_out),
    ),
    "ecm_producer_sources_packed": (
        c_int,
        (ecm_handle_t, c_uint64, c_void_p, c_uint64, POINTER(c_uint64), c_str_out),
    ),
    "ecm_noop": (c_int, (ecm_handle_t, c_uint64, c_void_p, c_uint64, POINTER(c_uint64), c_str_out)),
    "ecm_producer_cancel": (c_int, (ecm_handle_t, c_char_p, c_str_out)),
    "ecm_producer_poll": (c_int, (ecm_handle_t, c_int32, c_str_out, c_str_out)),
    "ecm_scheduler_open": (c_int, (c_char_p, POINTER(ecm_handle_t), c_str_out)),
    "ecm_scheduler_step": (c_int, (ecm_handle_t, c_char_p, c_str_out, c_str_out)),
    "ecm_scheduler_has": (
        c_int,
        (ecm_handle_t, c_char_p, POINTER(c_int32), c_str_out),
    ),
    "ecm_scheduler_watch": (c_int, (ecm_handle_t, POINTER(c_uint64), c_str_out)),
    "ecm_scheduler_poll": (c_int, (ecm_handle_t, POINTER(c_int32), c_str_out)),
    "ecm_scheduler_wait": (
        c_int,
        (ecm_handle_t, c_char_p, c_int32, c_str_out, c_str_out),
    ),
    "ecm_proxy_open": (c_int, (c_char_p, POINTER(ecm_handle_t), c_str_out)),
    "ecm_registrar_open": (c_int, (c_char_p, POINTER(ecm_handle_t), c_str_out)),
    "ecm_metrics_text": (c_int, (c_str_out, c_str_out)),
    "ecm_metadata_server_open": (c_int, (c_char_p, POINTER(ecm_handle_t), c_str_out)),
}


# The functions called with the GIL held (see the module's docstring): each
# returns without waiting on I/O, on another thread or on a lock held across
# I/O. Every other function releases the GIL while it runs.
HOLD_GIL: frozenset[str] = frozenset(
    {
        "ecm_free",
        "ecm_noop",
        "ecm_producer_submit_packed",
        "ecm_producer_sources_packed",
        # The PD engine loop's calls, made many times a schedule pass while
        # vLLM's output thread is busy: the step reads what the same-host
        # shards' sockets hold without waiting (as poll does), applies it and
        # the step's changes to the table under a lock never held across
        # I/O, and answers; what it logs is queued (core/internal/logqueue).
        "ecm_scheduler_step",
        "ecm_scheduler_poll",
        "ecm_scheduler_has",
    }
)


class LibraryError(OSError):
    """The library could not be found, loaded, or is of the wrong ABI."""


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
# Every function of PROTOTYPES by name, through the handle HOLD_GIL picks.
_functions: dict[str, Any] = {}
# The process that loaded the library. A Go runtime does not survive
# fork (its threads stay in the parent), so a child must not call in.
_pid: int | None = None
# True in a child forked after the library was loaded: os.register_at_fork
# says so, so that lib() need not ask the kernel for the pid (a system
# call, microseconds on a virtual machine) at every call. A child forked
# from C without Python's fork hooks is still refused by the library
# itself, which checks on every call.
_forked = False


def _mark_forked() -> None:
    global _forked
    _forked = _lib is not None


os.register_at_fork(after_in_child=_mark_forked)


def candidates() -> list[Path]:
    """Paths tried, in order: $ECMOONCAKE_LIBRARY, then the package directory."""
    paths = []
    override = os.environ.get(LIBRARY_ENV)
    if override:
        paths.append(Path(override))
    paths.append(Path(__file__).resolve().parent / LIBRARY_NAME)
    return paths


def find() -> Path | None:
    """The library that :func:`lib` would load, without loading it."""
    for path in candidates():
        if path.is_file():
            return path
    return None


def loaded() -> bool:
    return _lib is not None


def lib() -> ctypes.CDLL:
    """The loaded library, loading it on first use (thread-safe).

    Raises LibraryError in a child forked after the library was loaded:
    the child's calls would hang (the library refuses them too)."""
    dll = _lib
    if dll is not None:
        if _forked and _pid != os.getpid():
            raise LibraryError(
                f"libecmooncake was loaded in pid {_pid} and called from forked child {os.getpid()}; "
                "load it after fork (use the library only in processes that did not inherit it loaded, "
                "e.g. start workers with the 'spawn' method)"
            )
        return dll
    with _lock:
        if _lib is None:
            _load()
        return _lib  # type: ignore[return-value]


def function(name: str) -> Any:
    """The library's function ``name``, through the PyDLL handle when it is
    in :data:`HOLD_GIL`, else through the CDLL; loads the library on first
    use and refuses a forked child as :func:`lib` does."""
    lib()
    return _functions[name]


def _load() -> None:
    global _lib, _pid
    path = find()
    if path is None:
        tried = ", ".join(str(p) for p in candidates())
        raise LibraryError(
            f"{LIBRARY_NAME} not found (tried {tried}); build it with "
            f"'python build/build_lib.py' or 'pip install .', or point "
            f"{LIBRARY_ENV} at it"
        )
    try:
        dll = ctypes.CDLL(str(path))
        # The same library (dlopen hands back the loaded one), called
        # without releasing the GIL.
        held = ctypes.PyDLL(str(path))
    except OSError as exc:
        raise LibraryError(f"cannot load {path}: {exc}") from exc
    missing = [name for name in PROTOTYPES if not hasattr(dll, name)]
    if missing:
        raise LibraryError(f"{path} lacks {', '.join(missing)}: library and package differ")
    functions = {}
    for name, (restype, argtypes) in PROTOTYPES.items():
        fn = getattr(dll, name)
        fn.restype = restype
        fn.argtypes = list(argtypes)
        functions[name] = fn
        if name in HOLD_GIL:
            fn = functions[name] = getattr(held, name)
            fn.restype = restype
            fn.argtypes = list(argtypes)
    _check_abi(dll, path)
    _functions.clear()
    _functions.update(functions)
    _pid = os.getpid()
    _lib = dll


def _check_abi(dll: ctypes.CDLL, path: Path) -> None:
    version = c_int32(-1)
    err = c_void_p()
    rc = dll.ecm_abi_version(ctypes.byref(version), ctypes.byref(err))
    message = take_string(dll, err)
    if rc != ECM_OK:
        raise LibraryError(f"{path}: ecm_abi_version failed ({rc}): {message}")
    if version.value != ABI_VERSION:
        raise LibraryError(
            f"{path} speaks ABI version {version.value}, this package speaks "
            f"{ABI_VERSION}: rebuild the library or reinstall the package"
        )


def take_string(dll: ctypes.CDLL, ptr: c_void_p) -> str | None:
    """Copies a library-owned C string and frees it; None for NULL."""
    if not ptr.value:
        return None
    try:
        return ctypes.string_at(ptr.value).decode("utf-8", errors="replace")
    finally:
        # The loaded library's ecm_free keeps the GIL (HOLD_GIL).
        free = _functions["ecm_free"] if dll is _lib else dll.ecm_free
        free(ptr.value)
        ptr.value = None
