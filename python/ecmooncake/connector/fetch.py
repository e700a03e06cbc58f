"""A PD's gets from Mooncake Store (``store`` on a consumer instance).

When the proxy tells a PD that an item comes from the Store (its
``ec_items`` entry says ``"source": "store"``; see
:func:`.request.store_items`), the PD's scheduler registers the item's
transfer as it registers a push an encoder will make, and hands the item to
this module's :class:`_StoreFetcher`: a thread of the engine-core process
that gets the item's index and bytes from the Store into host memory
(:meth:`.tier._Tier.fetch`) and pushes them to this instance's own shards
through the library's native producer, as an encoder does. The item then
arrives in the slab as any push does, and ``has_cache_item``,
``ensure_cache_available`` and the workers' loads work unchanged.

The scheduler never waits: it hands a fetch over without blocking (a full
queue is a fallback) and takes the fetches that failed when it next asks.
A get waits at most the Store's ``get_timeout_s``; the push to this
instance's own shards at most ``PUSH_WAIT_S`` more; a fetch still queued
past its deadline is dropped unstarted. Every fallback is counted
(``fetch_*`` beside the tier's ``get_*`` counters) and logged, and the
scheduler then lets the engine encode the item itself.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from .. import ec_config
from ..errors import EcmError
from ..native import Producer
from .lifecycle import CLOSE_WAIT_S, close_bounded
from .log import logger, throttle
from .metadata import _description
from .tier import _Tier
from .tier import make as make_tier

# Fetches waiting for the thread; more fall back at once.
MAX_QUEUED = 256
# The most a push to this instance's own shards may take once its bytes
# are here (a loopback or same-host write; the library's own deadlines are
# longer, for pushes across a network).
PUSH_WAIT_S = 5.0
# How often the thread asks the native producer for outcomes while pushes
# are in flight.
POLL_S = 0.002


@dataclass
class _Job:
    transfer_id: str
    mm_hash: str
    deadline: float


@dataclass
class _Pushing:
    mm_hash: str
    deadline: float


class _StoreFetcher:
    """The gets from the Store of one PD instance's engine core."""

    def __init__(self, cfg: ec_config.ECMooncakeConfig, vllm_config: Any, tier: _Tier | None = None):
        self._cfg = cfg
        self._tier = tier if tier is not None else make_tier(cfg, vllm_config)
        self.get_timeout_s = float(cfg.store.get_timeout_s)
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=MAX_QUEUED)
        self._lock = threading.Lock()
        self._failed: dict[str, str] = {}  # transfer id -> why, until the scheduler takes it
        self._native: Producer | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # Fetches taken (written by the scheduler's thread alone) and ended
        # (by the fetch thread alone): unequal while one is in flight.
        self._taken = 0
        self._ended = 0

    @property
    def deadline_s(self) -> float:
        """The most a fetch takes from hand-over to arrival: the scheduler's
        own deadline for an item from the Store."""
        return self.get_timeout_s + PUSH_WAIT_S

    def start(self) -> None:
        """Opens the Store client and the native producer, and starts the
        thread (in the engine core, at the connector's creation)."""
        if self._thread is not None:
            return
        self._tier.open(puts=False)
        self._native = Producer(self._cfg.producer_settings())
        self._thread = threading.Thread(target=self._run, name="ecm-store-fetch", daemon=True)
        self._thread.start()

    def fetch(self, transfer_id: str, mm_hash: str, deadline: float) -> bool:
        """Hands a fetch to the thread; never waits. False (counted) when it
        cannot be taken: the caller falls back at once."""
        if self._closed or self._thread is None:
            return False
        try:
            self._jobs.put_nowait(_Job(transfer_id, mm_hash, deadline))
            self._taken += 1
        except queue.Full:
            self._count("fetch_queue_full")
            throttle.warn("store-fetch-full", "ecmooncake: Store fetch of %s not made: %d fetches queued already",
                          mm_hash, MAX_QUEUED)
            return False
        return True

    def take_failed(self) -> dict[str, str]:
        """Fetches that failed since the last call: transfer id -> why."""
        with self._lock:
            out, self._failed = self._failed, {}
        return out

    def _count(self, name: str) -> None:
        self._tier._count(name)

    def busy(self, counts: bool = True) -> bool:
        """Whether a fetch is in flight, or (with counts: where vLLM takes
        the connector's stats) a count it made is not reported yet. vLLM
        sends a connector's stats with each step and steps only while it
        has work, so that an engine whose last request ended before its
        fetch's outcome must step once more for the count to reach its
        /metrics (has_pending_push_work). A fetch thread that is gone ends
        nothing more: it keeps no engine stepping."""
        if self._thread is None or not self._thread.is_alive():
            return False
        return self._taken != self._ended or (counts and self._tier.moved())

    def _fail(self, job_tid: str, mm_hash: str, counter: str, why: str) -> None:
        self._count(counter)
        self._ended += 1
        with self._lock:
            self._failed[job_tid] = why
        throttle.warn(f"store-{counter}", "ecmooncake: item %s (transfer %s) not got from Mooncake Store: %s; "
                      "the engine encodes it itself", mm_hash, job_tid, why)

    # -- the thread -----------------------------------------------------------

    def _run(self) -> None:
        pushing: dict[str, _Pushing] = {}
        while True:
            try:
                job = self._jobs.get(timeout=POLL_S if pushing else None)
            except queue.Empty:
                job = False
            if job is None or self._closed:
                return
            if job:
                self._one(job, pushing)
            if pushing:
                self._poll(pushing)

    def _one(self, job: _Job, pushing: dict[str, _Pushing]) -> None:
        left = job.deadline - time.monotonic() - PUSH_WAIT_S
        if left <= 0:
            self._fail(job.transfer_id, job.mm_hash, "fetch_expired", "it waited for the fetch thread past its deadline")
            return
        got = self._tier.fetch(job.mm_hash, timeout=left)
        if not got.ok:
            self._fail(job.transfer_id, job.mm_hash, "fetch_get_failed", f"the {got.stage} get answered {got.reason}")
            return
        import numpy as np

        array = np.frombuffer(got.data, dtype=np.uint8)
        push = {"transfer_id": job.transfer_id, "mm_hash": job.mm_hash, "nbytes": got.index.nbytes,
                "consumer": self._cfg.consumer_endpoint, "meta": _description(got.index.dtype, got.index.shape)}
        submitted = False
        try:
            answer = self._native.submit([push])[0]
            if answer.get("error"):
                raise EcmError(answer["error"])
            submitted = True
            self._native.sources([(job.mm_hash, array)])
        except EcmError as exc:
            if submitted:
                # Announced but given no bytes: free its reservations now
                # rather than at the library's deadline.
                try:
                    self._native.cancel([job.transfer_id])
                except EcmError as cancel_exc:
                    logger.warning("ecmooncake: cancelling Store push %s: %s", job.transfer_id, cancel_exc)
            self._fail(job.transfer_id, job.mm_hash, "fetch_push_failed", f"the push to this instance failed: {exc}")
            return
        pushing[job.transfer_id] = _Pushing(job.mm_hash, time.monotonic() + PUSH_WAIT_S)

    def _poll(self, pushing: dict[str, _Pushing]) -> None:
        try:
            out = self._native.poll(0)
        except EcmError as exc:
            out = {"failed": [{"transfer_id": tid, "reason": str(exc)} for tid in pushing]}
        for tid in out.get("done") or ():
            if pushing.pop(tid, None) is not None:
                self._count("fetch_pushed")
                self._ended += 1
        for failure in out.get("failed") or ():
            tid = failure.get("transfer_id") or ""
            p = pushing.pop(tid, None)
            if p is not None:
                self._fail(tid, p.mm_hash, "fetch_push_failed", f"the push to this instance failed: {failure.get('reason')}")
        now = time.monotonic()
        late = [tid for tid, p in pushing.items() if p.deadline <= now]
        if late:
            try:
                self._native.cancel(late)
            except EcmError as exc:
                logger.warning("ecmooncake: cancelling Store pushes %s: %s", late, exc)
            for tid in late:
                p = pushing.pop(tid)
                self._fail(tid, p.mm_hash, "fetch_push_failed", f"the push to this instance ran past {PUSH_WAIT_S} s")

    # -- counters and life ------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """The tier's counters and the fetches' (tier.OWN_COUNTERS)."""
        return self._tier.stats()

    def increments(self) -> dict[str, int]:
        """The counters that moved since the last call, by how much."""
        return self._tier.increments()

    def close(self) -> None:
        self._closed = True
        try:
            self._jobs.put_nowait(None)
        except queue.Full:
            pass  # the thread sees _closed after its fetch in hand
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT_S)
        if self._native is not None:
            close_bounded(self._native)
        self._tier.close()


def make(cfg: ec_config.ECMooncakeConfig, vllm_config: Any) -> _StoreFetcher | None:
    """The PD's fetcher, or None when ``store`` is off."""
    return _StoreFetcher(cfg, vllm_config) if cfg.store.enabled else None
