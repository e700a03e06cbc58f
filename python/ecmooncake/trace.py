"""A trace of the ready path: every hop of an item's way from the encoder's
output to the PD's ``encoder_cache``, stamped with CLOCK_MONOTONIC
(``time.monotonic_ns``) in the process where it happens.

Each process holds two bounded rings: this module's, for the hops Python
sees (``save_caches``, ``submit``, ``hand_over``, ``available``,
``encoder_cache``), and the library's (core/trace, read through ``ecm_trace``)
for the hops Go sees. CLOCK_MONOTONIC is one clock for every process of a
host, so the stamps of an encoder, a shard and a PD scheduler on one host
compare; ``ecmooncake.native.trace_enable`` and ``trace_drain`` handle
both rings of a process, and :func:`table` turns them into p50/p99 per hop, which the
benchmarks print beside the floors of the same run.

Off by default: :func:`stamp` is then one global load and a return. Turn it
on in a process's environment with ``ECMOONCAKE_TRACE=N`` (N entries per
ring; ``1`` for the default 65,536), which both rings read at start, or
with :func:`enable`. A full ring overwrites its oldest stamps and counts
them (``dropped``), so a process left tracing holds bounded memory.

Where nobody can drain a process (a ``vllm serve`` instance),
``ECMOONCAKE_TRACE_LOG=1`` also logs each Python stamp as one line,
"ecmooncake item-trace HOP mm_hash=H t_ns=N", on the ``vllm.ecmooncake``
logger: the encoder's ``save_caches`` and the PD's ``encoder_cache`` lines
of an mm_hash give its time from the encoder's output to the PD's cache.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from typing import Any, Iterable

ENV = "ECMOONCAKE_TRACE"
LOG_ENV = "ECMOONCAKE_TRACE_LOG"
LOG_PREFIX = "ecmooncake item-trace"
DEFAULT_CAPACITY = 1 << 16
MAX_CAPACITY = 1 << 22

# Every hop, in the order an item meets them on a plane that completes by
# message (shm, cuda_ipc, mooncake), with the process that stamps it. Over
# TCP the item is ready at the shard before the producer sees its write
# end (its frames carry the completion) and no complete is sent. The
# reserve hops are off the ready path where the push was announced early
# (the connector announces before the encoder runs).
HOPS: tuple[tuple[str, str, str], ...] = (
    ("save_caches", "producer, Python", "vLLM hands the connector an encoder output"),
    ("submit", "producer, Python", "Producer.submit entered: the push announced"),
    ("reserve_sent", "producer, Go", "reserve_batch sent"),
    ("reserve_received", "shard, Go", "reserve_batch taken by the shard's handler"),
    ("reserve_replied", "shard, Go", "its grants made, the reply about to go"),
    ("reserve_answered", "producer, Go", "its grant back"),
    ("hand_over", "producer, Python", "Producer.sources entered: the output handed to the library"),
    ("sources_entered", "producer, Go", "the hand-over's batch decoded in the library"),
    ("sources_checked", "producer, Go", "its GPU sources checked, their readiness events recorded"),
    ("write_enqueued", "producer, Go", "the write (copy) handed to the data plane"),
    ("write_started", "producer, Go", "cuda_ipc: the items announced, their copies and ready words queued, in the hand-over"),
    ("write_ended", "producer, Go", "the data plane says the write ended (host side; cuda_ipc: its copy's event completed)"),
    ("complete_sent", "producer, Go", "complete_batch sent"),
    ("ready_word_seen", "shard, Go", "cuda_ipc: the ready word the producer's GPU stored after the copies seen"),
    ("ready", "shard, Go", "region READY, readiness published"),
    ("complete_answered", "producer, Go", "complete_batch answered"),
    ("event_delivered", "PD scheduler, Go", "the shard's ready event applied"),
    ("available", "PD scheduler, Python", "has_cache_item / ensure_cache_available first true"),
    ("encoder_cache", "PD worker, Python", "the item's view put into vLLM's encoder_cache"),
)
HOP_NAMES = tuple(h for h, _, _ in HOPS)
PROCESS = {h: p for h, p, _ in HOPS}


class Ring:
    """A bounded ring of (hop, key, ns): appends from any thread (a deque
    with maxlen appends atomically under the GIL), the oldest overwritten
    when full and counted at the next :meth:`drain`."""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"trace ring capacity {capacity}: must be positive")
        self.capacity = min(int(capacity), MAX_CAPACITY)
        self._entries: deque = deque(maxlen=self.capacity)
        self._written = itertools.count()  # next() is atomic: adds from any thread
        self._peeks = 0  # numbers drain took from _written
        self._taken = 0  # entries drains popped
        self._lost = 0  # entries counted as overwritten so far
        # (hop, key) already stamped by stamp_first; bounded like the ring.
        self._first: set = set()

    def add(self, hop: str, key: str, ns: int) -> None:
        self._entries.append((hop, key, ns))
        next(self._written)

    def add_first(self, hop: str, key: str, ns: int) -> None:
        mark = (hop, key)
        if mark in self._first:
            return
        if len(self._first) >= self.capacity:
            self._first.clear()
        self._first.add(mark)
        self.add(hop, key, ns)

    def drain(self) -> dict:
        """The stamps since the last drain, oldest first, and how many were
        overwritten before it. One drainer at a time (adds may run beside)."""
        out = []
        entries = self._entries
        while True:
            try:
                out.append(entries.popleft())
            except IndexError:
                break
        # count() has no peek: take a number, which no add owns, and count it.
        adds = next(self._written) - self._peeks
        self._peeks += 1
        self._taken += len(out)
        lost = max(self._lost, adds - self._taken - len(entries))
        dropped, self._lost = lost - self._lost, lost
        return {"capacity": self.capacity, "dropped": dropped, "stamps": [list(e) for e in out]}


def capacity_from_env(value: str | None) -> int:
    """ECMOONCAKE_TRACE's capacity: 0 (off) when empty, not a number or not
    positive; 1 means DEFAULT_CAPACITY."""
    try:
        n = int(value or 0)
    except ValueError:
        return 0
    if n <= 0:
        return 0
    return DEFAULT_CAPACITY if n == 1 else min(n, MAX_CAPACITY)


class _LoggedRing(Ring):
    """A ring that also logs each stamp (ECMOONCAKE_TRACE_LOG=1)."""

    def add(self, hop: str, key: str, ns: int) -> None:
        super().add(hop, key, ns)
        logging.getLogger("vllm.ecmooncake").info("%s %s mm_hash=%s t_ns=%d", LOG_PREFIX, hop, key, ns)


def _ring_of(capacity: int) -> Ring | None:
    if capacity <= 0:
        return None
    return _LoggedRing(capacity) if os.environ.get(LOG_ENV) == "1" else Ring(capacity)


# ECMOONCAKE_TRACE_LOG=1 alone turns tracing on, at the default capacity.
_ring: Ring | None = _ring_of(capacity_from_env(os.environ.get(ENV)) or (DEFAULT_CAPACITY if os.environ.get(LOG_ENV) == "1" else 0))


def enabled() -> bool:
    return _ring is not None


def stamp(hop: str, key: str) -> None:
    """Records hop of the item key (its mm_hash) now, when tracing is on."""
    ring = _ring
    if ring is not None:
        ring.add(hop, key, time.monotonic_ns())


def stamp_all(hop: str, keys: Iterable[str]) -> None:
    """Records hop of several items at one time."""
    ring = _ring
    if ring is not None:
        now = time.monotonic_ns()
        for key in keys:
            ring.add(hop, key, now)


def stamp_first(hop: str, key: str) -> None:
    """Records hop of key the first time only (a hook vLLM asks again and
    again: its first true answer is the hop)."""
    ring = _ring
    if ring is not None:
        ring.add_first(hop, key, time.monotonic_ns())


def enable(capacity: int = DEFAULT_CAPACITY) -> None:
    """Starts a fresh Python ring of ``capacity`` entries in this process
    (0: off). ecmooncake.native.trace_enable starts the library's too."""
    global _ring
    _ring = _ring_of(capacity)


def drain() -> dict:
    """Python's stamps since the last drain: {"capacity", "dropped",
    "stamps": [[hop, key, ns], ...]}. ecmooncake.native.trace_drain adds
    the library's."""
    ring = _ring
    return ring.drain() if ring is not None else {"capacity": 0, "dropped": 0, "stamps": []}


def _percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def first_stamps(stamps: Iterable[Any], keys: Iterable[str] | None = None) -> dict[str, dict[str, int]]:
    """{key: {hop: its first stamp}} of the items in keys (all without)."""
    wanted = None if keys is None else set(keys)
    by_key: dict[str, dict[str, int]] = {}
    for hop, key, ns in stamps:
        if wanted is not None and key not in wanted:
            continue
        hops = by_key.setdefault(key, {})
        if hop not in hops or ns < hops[hop]:
            hops[hop] = int(ns)
    return by_key


def table(stamps: Iterable[Any], keys: Iterable[str] | None = None) -> dict:
    """Per hop, over the items traced: how long after the hop before it
    (the previous row that the item has) and after the item's first stamp,
    p50 and p99 in µs. Rows go in the order of their median time from the
    first stamp, so a plane's own order shows (over TCP ``ready`` comes
    before ``write_ended``); ties keep HOPS's order.

    {"items", "rows": [{"hop", "process", "count", "p50_us", "p99_us",
    "from_start_p50_us", "from_start_p99_us"}]}; the first row's deltas
    are 0."""
    by_key = first_stamps(stamps, keys)
    from_start: dict[str, list[float]] = {}
    for hops in by_key.values():
        start = min(hops.values())
        for hop, ns in hops.items():
            from_start.setdefault(hop, []).append((ns - start) / 1e3)
    rank = {h: i for i, h in enumerate(HOP_NAMES)}
    order = sorted(from_start, key=lambda h: (_percentile(from_start[h], 50), rank.get(h, len(rank)), h))
    rows = []
    for i, hop in enumerate(order):
        deltas = []
        for hops in by_key.values():
            if hop not in hops:
                continue
            prev = next((hops[p] for p in reversed(order[:i]) if p in hops), None)
            deltas.append(0.0 if prev is None else (hops[hop] - prev) / 1e3)
        rows.append(
            {
                "hop": hop,
                "process": PROCESS.get(hop, "?"),
                "count": len(deltas),
                "p50_us": _percentile(deltas, 50),
                "p99_us": _percentile(deltas, 99),
                "from_start_p50_us": _percentile(from_start[hop], 50),
                "from_start_p99_us": _percentile(from_start[hop], 99),
            }
        )
    return {"items": len(by_key), "rows": rows}


def format_table(t: dict, indent: str = "  ") -> list[str]:
    """The table's lines: hop, process, items, µs since the row before
    (p50/p99), µs since the item's first stamp (p50/p99)."""
    if not t.get("rows"):
        return [f"{indent}(no stamps)"]
    lines = [
        f"{indent}{'hop':<18} {'process':<21} {'items':>6} {'+us p50':>9} {'+us p99':>9} "
        f"{'total p50':>10} {'total p99':>10}"
    ]
    for r in t["rows"]:
        lines.append(
            f"{indent}{r['hop']:<18} {r['process']:<21} {r['count']:>6} {r['p50_us']:>9.1f} {r['p99_us']:>9.1f} "
            f"{r['from_start_p50_us']:>10.1f} {r['from_start_p99_us']:>10.1f}"
        )
    return lines
