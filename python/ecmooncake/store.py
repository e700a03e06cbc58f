"""An optional second tier in Mooncake Store: encoder outputs put there
after they complete, and got from there by a PD that needs an item no push
will bring, instead of encoding it again.

Why Python, over the wheel's ``MooncakeDistributedStore``: the Store's
client is C++ behind a pybind11 module (``mooncake/store.so``) whose calls
release the GIL; it exports no C API, and binding its C++ classes from Go
(as the transport's shim does for the TransferEngine) would tie us to the
client's class layout, which changes between releases. The pybind API
(``setup``, ``register_buffer``, ``put_from``, ``get_into``) is what vLLM's
and Mooncake's own connectors use, and is stable across the wheels we
support. Its calls block (a call to a master that is gone takes about 4 s
before it fails), so every call runs on a daemon thread of this module and
the caller waits at most its deadline.

What the tier promises its caller (the connector):

- Nothing raises. :meth:`StoreTier.get_into` answers a :class:`GetResult`;
  :meth:`StoreTier.put_async` answers whether the put was taken. Every
  outcome is counted (:meth:`StoreTier.stats`); fallbacks are logged, at
  most once per reason per interval.
- A get waits at most ``get_timeout_s`` (or the caller's shorter deadline):
  :meth:`StoreTier.get_into` on a worker thread, or
  :meth:`StoreTier.start_get` and a ticket polled without waiting (for a
  scheduler, which never blocks).
  The Store writes into staging memory this tier registered once, never
  into the caller's buffer: the copy into the caller's buffer happens only
  while the caller still waits, so a get that answers late writes nothing
  the caller may already have reused.
- A put copies the caller's bytes into registered staging memory on a
  worker thread (the caller's ``release`` callback then runs), so the
  caller's ready path pays no copy. Bytes in flight are bounded by
  ``put_inflight_bytes`` and the rate by ``put_rate_bytes_s``: a put beyond
  either is dropped, counted, never queued.
- After a call fails or runs past its deadline, every call falls back at
  once for ``retry_after_s`` (the master may be gone); then calls go to the
  Store again.
- Buffers are host memory: a PD whose slab is GPU memory gets into host
  memory and copies to the GPU itself (a CUDA wheel's ``get_into`` of GPU
  memory is not tested here).
- Nothing of Mooncake loads until :meth:`StoreTier.open`, which a process
  calls after vLLM forked it (the client starts threads).

Keys: :func:`item_key` joins the ``mm_hash`` with everything that makes an
encoder output valid for a PD, so that two PDs share an entry only when the
bytes would be the same. A PD knows no dtype or shape ahead, so each output
has an index beside it (:func:`index_key`, :func:`encode_index`), which the
PD gets first (:meth:`StoreTier.fetch`) and checks as untrusted input
(:func:`decode_index`).
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import json
import logging
import mmap
import os
import queue
import threading
import time
import urllib.parse
from collections import OrderedDict
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from .ec_config import ConfigError, StoreSettings  # noqa: F401 - re-exported

logger = logging.getLogger("vllm.ecmooncake.store")

KEY_VERSION = "ecm1"
INDEX_KEY_VERSION = "ecm1i"
INDEX_FORMAT = 1
# An index is a few dozen bytes; what the Store answers beyond this is refused unread.
INDEX_MAX_BYTES = 512
INDEX_MAX_DIMS = 4
# Bytes per element of each dtype an index may name (the connector's DTYPES).
ITEMSIZES = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8,
}
# Mooncake's codes (mooncake-store/include/types.h) that the tier tells
# apart: a miss, and a caller's buffer of the wrong size.
OBJECT_NOT_FOUND = -704
BUFFER_OVERFLOW = -600
# Staging extents are aligned like the consumer's slab.
ALIGN = 256
LOG_EVERY_S = 10.0
RECENT_PUTS = 4096


# ----------------------------------------------------------------------------
# Settings


# StoreSettings lives in ec_config, beside the connector's other settings
# (which check the ``store`` object without importing this module).


# ----------------------------------------------------------------------------
# Keys


def _check_common(what: str, mm_hash: Any, model: Any, tp_size: Any, tp_layout: Any) -> None:
    if not isinstance(mm_hash, str) or not mm_hash:
        raise ValueError(f"{what}: mm_hash = {mm_hash!r}; want a non-empty string")
    if not isinstance(model, str) or not model:
        raise ValueError(f"{what}: model = {model!r}; want a non-empty string")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"{what}: tp_size = {tp_size!r}; want an integer of at least 1")
    if not isinstance(tp_layout, str) or not tp_layout:
        raise ValueError(f"{what}: tp_layout = {tp_layout!r}; want a non-empty string")


def _encoder_text(what: str, encoder_config: Any) -> str:
    if isinstance(encoder_config, Mapping):
        try:
            return json.dumps(encoder_config, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{what}: encoder_config is not plain JSON: {exc}") from None
    if isinstance(encoder_config, str):
        return encoder_config
    raise ValueError(f"{what}: encoder_config = {encoder_config!r}; want a mapping or a string")


def _key(prefix: str, mm_hash: str, variant: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(variant, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
    name = urllib.parse.quote(mm_hash, safe="-_.~")
    if len(name) > 128:
        name = "sha256-" + hashlib.sha256(mm_hash.encode()).hexdigest()[:40]
    return f"{prefix}/{name}/{digest}"


def _layout(tp_size: int, tp_layout: str) -> dict[str, Any]:
    layout: dict[str, Any] = {"tp_layout": tp_layout}
    if tp_layout != "replicated":
        layout["tp_size"] = tp_size
    return layout


def item_key(
    mm_hash: str,
    *,
    model: str,
    encoder_config: Mapping[str, Any] | str,
    dtype: str,
    shape: Sequence[int],
    tp_size: int = 1,
    tp_layout: str = "replicated",
) -> str:
    """The Store key of one encoder output: ``ecm1/<mm_hash>/<variant>``.

    ``mm_hash`` names the content (readable in the key, so that the Store's
    keys tell which images it holds); ``variant`` is a digest of what makes
    the bytes valid for a PD: the model (name and revision), the encoder's
    config (anything that changes its output: processor settings, pixel
    bounds), the dtype, the shape, and the TP layout of the consumer: how
    the item is laid over its shards, and, for any layout but
    ``replicated`` (every shard holds the whole item, as this connector
    sends it today), the TP size. Two PDs that differ in any of these never
    share an entry; PDs of different TP sizes share a replicated one."""
    _check_common("item_key", mm_hash, model, tp_size, tp_layout)
    if not isinstance(dtype, str) or not dtype:
        raise ValueError(f"item_key: dtype = {dtype!r}; want a non-empty string such as 'bfloat16'")
    dims = list(shape)
    if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in dims):
        raise ValueError(f"item_key: shape = {shape!r}; want positive integers")
    encoder = _encoder_text("item_key", encoder_config)
    variant = {"model": model, "encoder": encoder, "dtype": dtype, "shape": dims, **_layout(tp_size, tp_layout)}
    return _key(KEY_VERSION, mm_hash, variant)


def index_key(
    mm_hash: str,
    *,
    model: str,
    encoder_config: Mapping[str, Any] | str,
    tp_size: int = 1,
    tp_layout: str = "replicated",
) -> str:
    """The Store key of an output's index: ``ecm1i/<mm_hash>/<variant>``,
    named from what a PD knows before the output exists (no dtype, no
    shape, which only the encoder learns). Its value
    (:func:`encode_index`) tells the dtype and shape, from which the PD
    makes the output's :func:`item_key` itself: an index never names a key
    of its own, so that what the Store answers can point a PD at no other
    image's bytes and no other model's."""
    _check_common("index_key", mm_hash, model, tp_size, tp_layout)
    encoder = _encoder_text("index_key", encoder_config)
    return _key(INDEX_KEY_VERSION, mm_hash, {"model": model, "encoder": encoder, **_layout(tp_size, tp_layout)})


class ItemIndex(NamedTuple):
    """What an index object tells: the output's dtype, shape and size."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class BadIndex(ValueError):
    """An index object from the Store that is not one this module wrote."""


def encode_index(dtype: str, shape: Sequence[int], nbytes: int) -> bytes:
    """The value of an index object: ``{"v":1,"dtype":..,"shape":[..],"nbytes":..}``."""
    index = _check_index(dtype, list(shape), nbytes, max_nbytes=None)
    raw = json.dumps({"v": INDEX_FORMAT, "dtype": index.dtype, "shape": list(index.shape), "nbytes": index.nbytes},
                     separators=(",", ":")).encode()
    if len(raw) > INDEX_MAX_BYTES:
        raise ValueError(f"encode_index: {len(raw)} bytes; an index holds at most {INDEX_MAX_BYTES}")
    return raw


def decode_index(raw: bytes, *, max_nbytes: int) -> ItemIndex:
    """An index object's value as the Store answered it, checked: the Store
    is shared, so its answer is untrusted. Raises :class:`BadIndex` for
    anything :func:`encode_index` would not have written, and for an
    output larger than max_nbytes (the caller's staging bound)."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise BadIndex(f"index is {type(raw).__name__}, not bytes")
    if len(raw) > INDEX_MAX_BYTES:
        raise BadIndex(f"index of {len(raw)} bytes; at most {INDEX_MAX_BYTES}")
    try:
        value = json.loads(bytes(raw).decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadIndex(f"index is not JSON: {str(exc)[:80]}") from None
    if not isinstance(value, dict) or set(value) != {"v", "dtype", "shape", "nbytes"}:
        raise BadIndex(f"index is not an object of v, dtype, shape and nbytes: {str(value)[:80]!r}")
    if value["v"] != INDEX_FORMAT or isinstance(value["v"], bool):
        raise BadIndex(f"index format {str(value['v'])[:20]!r}; this build reads {INDEX_FORMAT}")
    try:
        return _check_index(value["dtype"], value["shape"], value["nbytes"], max_nbytes=max_nbytes)
    except ValueError as exc:
        raise BadIndex(str(exc)) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _check_index(dtype: Any, shape: Any, nbytes: Any, max_nbytes: int | None) -> ItemIndex:
    size = ITEMSIZES.get(dtype) if isinstance(dtype, str) else None
    if size is None:
        raise ValueError(f"index dtype {str(dtype)[:40]!r} is none of {sorted(ITEMSIZES)}")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= INDEX_MAX_DIMS
            or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape)):
        raise ValueError(f"index shape {str(shape)[:80]!r}; want 1 to {INDEX_MAX_DIMS} positive integers")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"index nbytes {str(nbytes)[:40]!r}; want a positive integer")
    if max_nbytes is not None and nbytes > max_nbytes:
        raise ValueError(f"index nbytes {nbytes} exceeds the {max_nbytes} bytes this PD stages")
    elements = 1
    for d in shape:
        elements *= d
        if elements * size > nbytes:
            break
    if elements * size != nbytes:
        raise ValueError(f"index nbytes {nbytes} is not shape {shape} of {dtype}")
    return ItemIndex(dtype, tuple(shape), nbytes)


# ----------------------------------------------------------------------------
# Staging memory


class Extents:
    """First-fit allocation of aligned extents of one region; no I/O."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), by offset
        self.used = 0

    def alloc(self, nbytes: int) -> int | None:
        need = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                self.used += need
                return off
        return None

    def free(self, off: int, nbytes: int) -> None:
        need = -(-max(nbytes, 1) // ALIGN) * ALIGN
        i = bisect.bisect(self._free, (off, 0))
        self._free.insert(i, (off, need))
        self.used -= need
        # Coalesce with the neighbours.
        if i + 1 < len(self._free) and off + need == self._free[i + 1][0]:
            self._free[i] = (off, need + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]


class _Region:
    """Anonymous page-aligned host memory, registered with the Store once."""

    def __init__(self, size: int):
        self.map = mmap.mmap(-1, size)
        self.view = (ctypes.c_char * size).from_buffer(self.map)
        self.addr = ctypes.addressof(self.view)
        self.size = size
        self.extents = Extents(size)


# ----------------------------------------------------------------------------
# The tier


class GetResult(NamedTuple):
    """``ok`` when the caller's buffer holds the item; else ``reason`` says
    why the caller falls back (miss, timeout, error, unavailable, busy,
    not_ready, disabled, too_large, invalid, cancelled, size_mismatch)."""

    ok: bool
    reason: str
    nbytes: int = 0


COUNTERS = (
    "get_hit", "get_hit_bytes", "get_miss", "get_timeout", "get_error", "get_size_mismatch",
    "get_unavailable", "get_busy", "get_not_ready", "get_too_large", "get_invalid", "get_cancelled", "get_late",
    "get_index_invalid",
    "put_ok", "put_bytes", "put_error", "put_timeout", "put_duplicate",
    "put_dropped_full", "put_dropped_rate", "put_dropped_unavailable", "put_dropped_not_ready", "put_dropped_invalid",
    # Index objects (put_async's index), apart so that put_ok counts outputs.
    "index_put_ok", "index_put_failed",
    "setup_failed", "breaker_trips",
)


class Fetched(NamedTuple):
    """What :meth:`StoreTier.fetch` got: ``ok`` with the output's index
    and bytes, or ``reason`` (a :class:`GetResult` reason, or
    ``index_invalid``) and ``stage`` (``index`` or ``item``): which get
    fell back."""

    ok: bool
    reason: str
    stage: str = ""
    index: "ItemIndex | None" = None
    data: bytearray | None = None


class GetTicket:
    """A get in flight (see :meth:`StoreTier.start_get`)."""

    def __init__(self, tier: "StoreTier", g: "_Get | None", done: GetResult | None):
        self._tier, self._g, self._done = tier, g, done

    def remaining(self) -> float:
        """Seconds until the deadline (0 once passed or answered)."""
        if self._done is not None or self._g is None:
            return 0.0
        return max(self._g.deadline - time.monotonic(), 0.0)

    def result(self, wait: float = 0.0) -> GetResult | None:
        """The get's result, waiting at most wait seconds (never past the
        deadline); None while it runs and its deadline has not passed."""
        if self._done is not None:
            return self._done
        g = self._g
        g.done.wait(min(max(wait, 0.0), self.remaining()))
        with g.lock:
            if g.result is not None:
                self._done = g.result
                return self._done
        if time.monotonic() < g.deadline:
            return None
        self._done = self._tier._give_up(g, "timeout") or g.result
        return self._done

    def cancel(self) -> None:
        """Gives the get up: the caller's buffer is not written after this
        returns (counted as get_cancelled unless it had already ended)."""
        if self._done is None and self._g is not None:
            self._done = self._tier._give_up(self._g, "cancelled") or self._g.result


class _Get:
    """One get: the caller and the worker settle under the get's own lock
    who finishes it, so that the caller's buffer is written only while the
    caller waits."""

    __slots__ = ("key", "dest", "nbytes", "off", "deadline", "exact", "lock", "done", "abandoned", "result")

    def __init__(self, key: str, dest: int, nbytes: int, off: int, deadline: float, exact: bool = True):
        self.key, self.dest, self.nbytes, self.off, self.deadline = key, dest, nbytes, off, deadline
        self.exact = exact
        # Its own lock, so that the copy into dest holds up no other call.
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.abandoned = False
        self.result: GetResult | None = None


class StoreTier:
    """The Store client of one process. ``backend_factory`` makes the
    Store client (default: the wheel's ``MooncakeDistributedStore``); tests
    pass an in-memory fake (:class:`MemoryStore`)."""

    def __init__(
        self,
        settings: StoreSettings,
        backend_factory: Callable[[], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.settings = settings
        self._factory = backend_factory or load_store_class()
        self._clock = clock
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._state = "closed"  # closed -> opening -> ready | failed; any -> closing
        self._backend: Any = None
        self._get_region: _Region | None = None
        self._put_region: _Region | None = None
        self._gets_in_flight = 0
        self._puts: dict[int, tuple[str, float]] = {}  # put id -> (key, started)
        self._put_seq = 0
        self._retry_at = 0.0
        self._tokens = float(settings.put_rate_bytes_s)
        self._tokens_at = clock()
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._logged: dict[str, float] = {}
        self._get_q: queue.SimpleQueue = queue.SimpleQueue()
        self._put_q: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        # Calls inside the Store client now; close waits for them, for
        # closing the client under a call would free what the call uses.
        self._calls = 0
        self._idle = threading.Condition(self._lock)

    # -- life ---------------------------------------------------------------

    def open(self) -> None:
        """Starts the client on a thread of its own: until it is set up,
        gets and puts fall back (not_ready), counted. Never raises."""
        with self._lock:
            if self._state != "closed" or not self.settings.enabled:
                return
            self._state = "opening"
        threading.Thread(target=self._setup, name="ecm-store-setup", daemon=True).start()

    def wait_ready(self, timeout: float) -> bool:
        """For tests and tools: whether setup finished within timeout."""
        return self._ready.wait(timeout) and self.state == "ready"

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def _setup(self) -> None:
        s = self.settings
        try:
            backend = self._factory()
            rc = backend.setup(s.local_hostname, s.metadata_address, s.segment_bytes, s.local_buffer_bytes,
                               s.mooncake_protocol, "", s.master_address)
            if rc != 0:
                raise RuntimeError(f"setup answered {rc}")
            get_region, put_region = _Region(s.get_staging_bytes), _Region(s.put_inflight_bytes)
            for what, region in (("get", get_region), ("put", put_region)):
                rc = backend.register_buffer(region.addr, region.size)
                if rc != 0:
                    raise RuntimeError(f"registering {region.size} bytes of {what} staging answered {rc}")
        except Exception as exc:  # noqa: BLE001 - a failed setup is a counted fallback, never raised
            with self._lock:
                self._counts["setup_failed"] += 1
                if self._state == "opening":
                    self._state = "failed"
            logger.error("Mooncake Store at %s (metadata %s) is not used: %s; every item is encoded locally",
                         s.master_address, s.metadata_address, exc)
            self._ready.set()
            return
        with self._lock:
            if self._state != "opening":
                # Closed while setting up: nobody will use this client.
                threading.Thread(target=backend.close, name="ecm-store-close", daemon=True).start()
                self._ready.set()
                return
            self._backend, self._get_region, self._put_region = backend, get_region, put_region
            self._state = "ready"
        for i in range(s.max_gets):
            threading.Thread(target=self._serve, args=(self._get_q,), name=f"ecm-store-get-{i}", daemon=True).start()
        threading.Thread(target=self._serve, args=(self._put_q,), name="ecm-store-put", daemon=True).start()
        logger.info("Mooncake Store tier ready: master %s, metadata %s, %s", s.master_address, s.metadata_address, s.mooncake_protocol)
        self._ready.set()

    def close(self, timeout: float = 5.0) -> bool:
        """Stops taking calls and closes the client, waiting at most
        timeout (a client whose master is gone takes seconds to close).
        Whether it closed in time; a client with a call still inside it
        then is left to the process's exit. Never raises."""
        end = time.monotonic() + timeout
        with self._lock:
            backend, self._backend = self._backend, None
            self._state = "closing"
            while self._calls and time.monotonic() < end:
                self._idle.wait(end - time.monotonic())
            busy = self._calls
        for _ in range(self.settings.max_gets):
            self._get_q.put(None)
        self._put_q.put(None)
        if backend is None:
            return True
        if busy:
            logger.warning("Mooncake Store client left open: %d call(s) still inside it after %.1f s", busy, timeout)
            return False
        done = threading.Event()

        def _close() -> None:
            try:
                backend.close()
            except Exception as exc:  # noqa: BLE001
                logger.warning("closing the Mooncake Store client: %s", exc)
            done.set()

        threading.Thread(target=_close, name="ecm-store-close", daemon=True).start()
        return done.wait(max(end - time.monotonic(), 0.0))

    def _enter(self) -> bool:
        """Counts a call into the client; False once the tier is closing."""
        with self._lock:
            if self._state != "ready":
                return False
            self._calls += 1
            return True

    def _leave(self) -> None:
        """Under the lock."""
        self._calls -= 1
        if not self._calls:
            self._idle.notify_all()

    def _serve(self, q: queue.SimpleQueue) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - a job's own failure is counted inside it
                logger.exception("Mooncake Store worker")

    # -- counting -----------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Every counter, and the bytes of puts and gets in flight."""
        with self._lock:
            out = dict(self._counts)
            out["fallbacks"] = sum(out[k] for k in out if k.startswith("get_") and k not in ("get_hit", "get_hit_bytes", "get_late"))
            out["put_inflight_bytes"] = self._put_region.extents.used if self._put_region else 0
            out["get_inflight_bytes"] = self._get_region.extents.used if self._get_region else 0
            return out

    def _count(self, name: str, n: int = 1) -> None:
        self._counts[name] += n

    def _note(self, reason: str, msg: str, *args: Any) -> None:
        """Logs a fallback, at most once per reason per LOG_EVERY_S."""
        now = self._clock()
        if now - self._logged.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[reason] = now
            logger.warning(msg, *args)

    def _trip(self, why: str) -> None:
        """Calls fall back at once for retry_after_s. Under the lock."""
        self._retry_at = self._clock() + self.settings.retry_after_s
        self._count("breaker_trips")
        self._note("breaker", "Mooncake Store: %s; calls fall back to local encodes for %.1f s",
                   why, self.settings.retry_after_s)

    def _unusable(self) -> str | None:
        """Why a call cannot go to the Store now, or None. Under the lock."""
        if not self.settings.enabled:
            return "disabled"
        if self._state in ("closed", "opening"):
            return "not_ready"
        if self._state != "ready":
            return "unavailable"
        now = self._clock()
        # Puts are kept in the order they started: the oldest first.
        for pid, (key, started) in list(self._puts.items()):
            if now - started <= self.settings.put_timeout_s:
                break
            # A put still running past its deadline: the master may be gone.
            del self._puts[pid]
            self._count("put_timeout")
            self._trip(f"a put of {key} ran past put_timeout_s")
        if now < self._retry_at:
            return "unavailable"
        return None

    # -- get ----------------------------------------------------------------

    def get_into(self, key: str, dest: int, nbytes: int, timeout: float | None = None, exact: bool = True) -> GetResult:
        """Gets the item of key into host memory at address dest, which must
        hold exactly nbytes (or, not exact, at most nbytes: the result's
        nbytes tells how many came). Waits at most ``get_timeout_s`` (or timeout,
        if shorter): for a worker thread, never the scheduler's (which polls
        a :meth:`start_get` ticket instead). Never raises; the caller falls
        back unless ok."""
        ticket = self.start_get(key, dest, nbytes, timeout, exact)
        return ticket.result(wait=ticket.remaining())

    def start_get(self, key: str, dest: int, nbytes: int, timeout: float | None = None,
                  exact: bool = True) -> "GetTicket":
        """Starts a get and returns at once; the ticket's ``result()``
        answers None while the get runs, then its result, or a timeout once
        its deadline (``get_timeout_s``, or timeout if shorter) passed.
        dest must stay valid until the ticket answers or is cancelled."""
        with self._lock:
            why = self._unusable()
            if why is None and (nbytes <= 0 or not dest):
                why = "invalid"
            if why is None and self._gets_in_flight >= self.settings.max_gets:
                why = "busy"
            if why is None and nbytes > self.settings.get_staging_bytes:
                why = "too_large"
            off = None
            if why is None:
                off = self._get_region.extents.alloc(nbytes + 1)
                if off is None:
                    why = "busy"
            if why is not None:
                if why != "disabled":
                    self._count(f"get_{why}")
                    self._note(f"get_{why}", "Mooncake Store get of %s falls back: %s", key, why)
                return GetTicket(self, None, GetResult(False, why))
            self._gets_in_flight += 1
            region = self._get_region
            backend = self._backend
        wait = self.settings.get_timeout_s if timeout is None else min(timeout, self.settings.get_timeout_s)
        g = _Get(key, dest, nbytes, off, time.monotonic() + max(wait, 0.0), exact)
        self._get_q.put(lambda: self._run_get(g, backend, region))
        return GetTicket(self, g, None)

    def _give_up(self, g: _Get, reason: str) -> GetResult | None:
        """Abandons g unless it has its result: the Store's answer, when it
        comes, is then dropped. None when g already had a result."""
        with g.lock:
            if g.result is not None:
                return None
            g.abandoned = True
        with self._lock:
            self._count(f"get_{reason}")
            if reason == "timeout":
                self._trip(f"a get of {g.key} ran past its deadline")
        return GetResult(False, reason)

    def _run_get(self, g: _Get, backend: Any, region: _Region) -> None:
        # One byte more than the key implies, so that a larger object
        # shows as one rather than as a hit.
        err = None
        entered = self._enter()
        if not entered:
            rc, err = None, "the tier is closing"
        else:
            try:
                rc = backend.get_into(g.key, region.addr + g.off, g.nbytes + 1)
            except Exception as exc:  # noqa: BLE001
                rc, err = None, exc
        with g.lock:
            late = g.abandoned
            if late:
                res = None
            elif err is not None or not isinstance(rc, int):
                res = GetResult(False, "error")
            elif rc == OBJECT_NOT_FOUND:
                res = GetResult(False, "miss")
            elif rc == g.nbytes or (not g.exact and 0 < rc <= g.nbytes):
                ctypes.memmove(g.dest, region.addr + g.off, rc)
                res = GetResult(True, "hit", rc)
            elif rc >= 0 or rc == BUFFER_OVERFLOW:
                res = GetResult(False, "size_mismatch")
            else:
                res = GetResult(False, "error")
            g.result = res
        with self._lock:
            if entered:
                self._leave()
            region.extents.free(g.off, g.nbytes + 1)
            self._gets_in_flight -= 1
            if late:
                self._count("get_late")
            elif res.ok:
                self._count("get_hit")
                self._count("get_hit_bytes", res.nbytes)
            else:
                self._count(f"get_{res.reason}")
                if res.reason == "error":
                    self._trip(f"a get of {g.key} failed: {err if err is not None else rc}")
                elif res.reason == "size_mismatch":
                    self._note("get_size_mismatch", "Mooncake Store holds %s with %s bytes, not the %d its key implies",
                               g.key, rc if rc >= 0 else "more", g.nbytes)
        g.done.set()

    def fetch(self, index: str, item_key_of: Callable[["ItemIndex"], str], timeout: float | None = None) -> Fetched:
        """Gets an output named only by its index key: the index first (at
        most INDEX_MAX_BYTES, checked by :func:`decode_index`, its size
        bounded by ``get_staging_bytes``), then the output under the key
        item_key_of makes from the index, into host memory of this call.
        Both gets together wait at most ``get_timeout_s`` (or timeout, if
        shorter): for a worker thread, never a scheduler's. Never raises;
        every fallback is counted (an index that is not one is
        get_index_invalid, logged)."""
        wait = self.settings.get_timeout_s if timeout is None else min(timeout, self.settings.get_timeout_s)
        deadline = time.monotonic() + max(wait, 0.0)
        buf = (ctypes.c_char * INDEX_MAX_BYTES)()
        got = self.get_into(index, ctypes.addressof(buf), INDEX_MAX_BYTES, timeout=wait, exact=False)
        if not got.ok:
            return Fetched(False, got.reason, "index")
        try:
            idx = decode_index(buf.raw[:got.nbytes], max_nbytes=self.settings.get_staging_bytes)
            key = item_key_of(idx)
        except ValueError as exc:
            with self._lock:
                self._count("get_index_invalid")
                self._note("get_index_invalid", "Mooncake Store index %s refused: %s", index, exc)
            return Fetched(False, "index_invalid", "index")
        data = bytearray(idx.nbytes)
        dest = (ctypes.c_char * idx.nbytes).from_buffer(data)
        got = self.get_into(key, ctypes.addressof(dest), idx.nbytes, timeout=max(deadline - time.monotonic(), 0.0))
        del dest  # the bytearray may be resized (handed on) only without a view into it
        if not got.ok:
            return Fetched(False, got.reason, "item", idx)
        return Fetched(True, "hit", "item", idx, data)

    # -- put ----------------------------------------------------------------

    def admit(self, key: str) -> bool:
        """Whether a put of key now would be taken as far as the tier can
        tell without its bytes (enabled, ready, no breaker, not put
        lately), so that a caller skips copying out bytes the tier would
        drop; when not, the drop is counted as put_async would count it.
        Never raises, never waits."""
        with self._lock:
            why = self._unusable()
            if why is None and key in self._recent:
                self._recent.move_to_end(key)
                self._count("put_duplicate")
                return False
            if why is not None and why != "disabled":
                self._count(f"put_dropped_{why}")
                self._note(f"put_{why}", "Mooncake Store put of %s dropped: %s", key, why)
            return why is None

    def put_async(self, key: str, src: int, nbytes: int, release: Callable[[], None] | None = None,
                  index: bool = False) -> bool:
        """Takes a put of nbytes at host address src, or drops it (counted).
        Taken, src must stay valid until release() is called, which a
        worker does once the bytes are copied (or the put is given up);
        dropped, release is not called and src is the caller's again.
        An index object (index) is counted apart (index_put_ok,
        index_put_failed), so that the put counters count outputs.
        Never raises, never waits."""
        if index:
            return self._put_index(key, src, nbytes, release)
        with self._lock:
            why = self._unusable()
            if why is None and (nbytes <= 0 or not src):
                why = "invalid"
            if why is None and key in self._recent:
                self._recent.move_to_end(key)
                self._count("put_duplicate")
                return False
            if why is None and self.settings.put_rate_bytes_s:
                now = self._clock()
                rate = self.settings.put_rate_bytes_s
                self._tokens = min(float(rate), self._tokens + (now - self._tokens_at) * rate)
                self._tokens_at = now
                # An item larger than a second's worth passes on a full bucket.
                if self._tokens < min(nbytes, rate):
                    why = "rate"
            off = None
            if why is None:
                off = self._put_region.extents.alloc(nbytes) if nbytes <= self._put_region.size else None
                if off is None:
                    why = "full"
            if why is not None:
                if why != "disabled":
                    self._count(f"put_dropped_{why}")
                    self._note(f"put_{why}", "Mooncake Store put of %s dropped: %s", key, why)
                return False
            if self.settings.put_rate_bytes_s:
                self._tokens -= nbytes
            self._put_seq += 1
            pid = self._put_seq
            self._puts[pid] = (key, self._clock())
            self._recent[key] = None
            while len(self._recent) > RECENT_PUTS:
                self._recent.popitem(last=False)
            backend, region = self._backend, self._put_region
        self._put_q.put(lambda: self._run_put(pid, key, src, nbytes, off, release, backend, region))
        return True

    def _put_index(self, key: str, src: int, nbytes: int, release: Callable[[], None] | None) -> bool:
        """An index object's put: after the output's own put on the one put
        thread (so that a PD that finds the index finds the output unless
        that put failed), outside the rate (it is tens of bytes), and not
        remembered as put lately (a second output of the same image under
        another shape must be able to replace it)."""
        with self._lock:
            why = self._unusable()
            if why is None and not 0 < nbytes <= INDEX_MAX_BYTES:
                why = "invalid"
            off = None
            if why is None:
                off = self._put_region.extents.alloc(nbytes)
                if off is None:
                    why = "full"
            if why is not None:
                if why != "disabled":
                    self._count("index_put_failed")
                return False
            self._put_seq += 1
            pid = self._put_seq
            self._puts[pid] = (key, self._clock())
            backend, region = self._backend, self._put_region
        self._put_q.put(lambda: self._run_put(pid, key, src, nbytes, off, release, backend, region, index=True))
        return True

    def _run_put(self, pid: int, key: str, src: int, nbytes: int, off: int,
                 release: Callable[[], None] | None, backend: Any, region: _Region, index: bool = False) -> None:
        ctypes.memmove(region.addr + off, src, nbytes)
        if release is not None:
            try:
                release()
            except Exception:  # noqa: BLE001
                logger.exception("Mooncake Store: a put's release callback failed")
        with self._lock:
            gone = self._state != "ready" or self._clock() < self._retry_at
            if not gone:
                self._calls += 1
        if gone:
            rc, err = None, "the Store was unavailable when the put's turn came"
        else:
            try:
                rc, err = backend.put_from(key, region.addr + off, nbytes), None
            except Exception as exc:  # noqa: BLE001
                rc, err = None, str(exc)
        with self._lock:
            if not gone:
                self._leave()
            region.extents.free(off, nbytes)
            timed_out = self._puts.pop(pid, None) is None
            if index:
                self._count("index_put_ok" if rc == 0 else "index_put_failed")
                if rc != 0 and not gone and not timed_out:
                    self._trip(f"a put of {key} failed: {err if err else rc}")
                return
            if rc == 0:
                self._count("put_ok")
                self._count("put_bytes", nbytes)
                return
            self._recent.pop(key, None)
            if gone:
                self._count("put_dropped_unavailable")
                return
            if not timed_out:  # a put past its deadline was counted then
                self._count("put_error")
                self._trip(f"a put of {key} failed: {err if err else rc}")


# ----------------------------------------------------------------------------
# The wheel's client, and a fake of it


def load_store_class() -> Callable[[], Any]:
    """The wheel's ``MooncakeDistributedStore``, imported on first use.
    Wheels before 0.3.13 link ``libcudart.so.12`` even in their non-CUDA
    build; it is loaded from PyPI's ``nvidia-cuda-runtime-cu12`` (beside
    the wheel or on sys.path) into this process only, so no loader path of
    the process changes."""

    def factory() -> Any:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            if "libcudart.so.12" not in str(exc) or not preload_cudart():
                raise
            from mooncake.store import MooncakeDistributedStore
        return MooncakeDistributedStore()

    return factory


def cudart_dir() -> str | None:
    """The folder of ``libcudart.so.12`` that PyPI's nvidia-cuda-runtime-cu12
    installs, looked up beside the mooncake package and on sys.path."""
    import importlib.util
    import sys

    roots = []
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        roots += [os.path.dirname(p) for p in spec.submodule_search_locations]
    roots += [p for p in sys.path if p]
    for root in roots:
        lib = os.path.join(root, "nvidia", "cuda_runtime", "lib")
        if os.path.isfile(os.path.join(lib, "libcudart.so.12")):
            return lib
    return None


def preload_cudart() -> bool:
    lib = cudart_dir()
    if lib is None:
        return False
    ctypes.CDLL(os.path.join(lib, "libcudart.so.12"), mode=ctypes.RTLD_GLOBAL)
    return True


def master_binary() -> str | None:
    """The wheel's ``mooncake_master`` beside its ``mooncake`` package
    (found without importing it), or None."""
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "mooncake_master")
        if os.access(path, os.X_OK):
            return path
    return None


def master_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment to start ``mooncake_master`` with: where a wheel
    before 0.3.13 needs ``libcudart.so.12``, its folder joins
    LD_LIBRARY_PATH of that one process."""
    out = dict(os.environ if env is None else env)
    lib = cudart_dir()
    if lib is not None:
        out["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [lib, out.get("LD_LIBRARY_PATH")]))
    return out


class MemoryStore:
    """An in-memory stand-in for ``MooncakeDistributedStore`` with the
    calls the tier uses and the same return codes; ``gate``, when set to a
    threading.Event, holds every get and put until it is set (a master that
    does not answer), and ``fail`` makes calls answer that code."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.registered: list[tuple[int, int]] = []
        self.gate: threading.Event | None = None
        self.fail: int | None = None
        self.closed = False
        self.setup_args: tuple = ()

    def setup(self, *args: Any) -> int:
        self.setup_args = args
        return 0

    def register_buffer(self, addr: int, size: int) -> int:
        self.registered.append((addr, size))
        return 0

    def _registered(self, addr: int, size: int) -> bool:
        return any(a <= addr and addr + size <= a + n for a, n in self.registered)

    def _wait(self) -> None:
        if self.gate is not None:
            self.gate.wait()

    def put_from(self, key: str, addr: int, size: int) -> int:
        self._wait()
        if self.fail is not None:
            return self.fail
        assert self._registered(addr, size), "put_from of memory that was not registered"
        self.objects[key] = ctypes.string_at(addr, size)
        return 0

    def get_into(self, key: str, addr: int, size: int) -> int:
        self._wait()
        if self.fail is not None:
            return self.fail
        assert self._registered(addr, size), "get_into of memory that was not registered"
        data = self.objects.get(key)
        if data is None:
            return OBJECT_NOT_FOUND
        if len(data) > size:
            return BUFFER_OVERFLOW
        ctypes.memmove(addr, data, len(data))
        return len(data)

    def close(self) -> int:
        self.closed = True
        return 0
