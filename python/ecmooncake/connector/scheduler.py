"""The scheduler role (vLLM's engine-core process).

On a consumer (prefill/decode) instance :class:`_ConsumerScheduler` owns a
native :class:`~ecmooncake.native.Scheduler` and answers ``has_cache_item``
and ``ensure_cache_available`` from memory; on a producer (encoder) instance
:class:`_ProducerScheduler` is plain bookkeeping: which pushes to announce,
and what ``request_finished`` tells the proxy."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .. import ec_config, trace
from ..errors import EcmError
from ..native import Scheduler
from .dtypes import DTYPES, dtype_name
from .lifecycle import close_bounded, configure_process
from .log import logger, throttle
from .metadata import LoadSpec, PushSpec, _StepMetadata, _WorkerReport
from .request import consumer_address, from_store, num_embeds_of, transfer_ids, unconsumed
from .stats import _Recorder

# --- scheduler side: consumer ------------------------------------------------


@dataclass
class _Expected:
    index: int
    transfer_id: str
    mm_hash: str
    # The proxy said the item comes from Mooncake Store: this instance gets
    # it itself (.fetch), no encoder pushes it.
    store: bool = False


@dataclass
class _LoadPlan:
    num_embeds: int
    modality: str
    requests: set[str] = field(default_factory=set)


@dataclass
class _Inflight:
    mm_hash: str
    requests: set[str]
    deadline: float


class _ConsumerScheduler:
    """Consumer instance, engine core: what may load, from Go-side state."""

    def __init__(self, cfg: ec_config.ECMooncakeConfig, ensure_hook: bool, outcomes: bool = True, can_fail: bool = True,
                 fetcher: Any = None, stats_hook: bool = True):
        self._cfg = cfg
        # Whether this vLLM takes the connector's stats each step
        # (get_ec_connector_stats): only then does a count wait for a step.
        self._stats_hook = stats_hook
        # Gets items from Mooncake Store (.fetch._StoreFetcher), or None.
        # Its fetches start from ensure_cache_available: without that hook
        # (vLLM < 0.26) an item from the Store is encoded by the engine.
        self._fetcher = fetcher if ensure_hook else None
        # transfer id -> (request id, mm_hash) of fetches not yet ended.
        self._fetching: dict[str, tuple[str, str]] = {}
        # request id -> when its items from the Store are given up.
        self._store_deadline: dict[str, float] = {}
        # request id -> why one of its items from the Store will not come.
        self._store_lost: dict[str, str] = {}
        # Without ensure_cache_available (older vLLM) expectations are
        # registered from update_state_after_alloc instead.
        self._ensure_hook = ensure_hook
        # Without the workers' report (vLLM < 0.30: no worker metadata, or
        # no update_connector_output) a load counts as done once its step
        # is built: the worker loads from its own shard what the table saw
        # arrive there, and would fill the entry with a stand-in otherwise.
        self._outcomes = outcomes
        # Without take_unavailable_requests (vLLM < 0.30) a request cannot
        # be failed: one whose items will not come is let through with them
        # missing, and the engine encodes them itself from the request's
        # media (the proxy sends it to such a PD instance).
        self._can_fail = can_fail
        self._local_encodes: list[str] = []
        self._given_up: set[str] = set()
        self._load_timeout_s = float(cfg.value("load_timeout_s"))
        configure_process(cfg, worker=False)
        self._native = Scheduler(cfg.scheduler_settings())
        if self._fetcher is not None:
            try:
                self._fetcher.start()
            except EcmError as exc:
                # The PD serves without it: items from the Store are encoded
                # by the engine (logged with each, counted as local encodes).
                logger.error("ecmooncake: consumer %s gets nothing from Mooncake Store: its fetcher did not start: %s",
                             cfg.consumer_endpoint, exc)
                self._fetcher.close()
                self._fetcher = None
        self._requests: dict[str, list[_Expected]] = {}
        self._registered: set[str] = set()
        self._refused: set[str] = set()
        self._to_register: dict[str, list[_Expected]] = {}
        # What the engine holds in its encoder cache, from alloc and free
        # notices: such items need nothing from the network.
        self._local: set[str] = set()
        self._said_yes: set[str] = set()
        self._to_load: dict[str, _LoadPlan] = {}
        self._inflight: dict[str, _Inflight] = {}
        self._loading: dict[str, str] = {}  # mm_hash -> transfer id in flight
        self._reports: list[dict[str, Any]] = []
        self._freed: list[str] = []
        self._deferred_free: set[str] = set()
        self._finished: list[str] = []
        self._unavailable: set[str] = set()
        # Answers remembered at one generation of the native table, which
        # the library keeps current in _counter: vLLM asks the same
        # questions for every waiting request on every schedule pass, and
        # while the generation stands the answers do (sched.Generation).
        self._counter = self._native.generation_counter
        # Whether this scheduling pass read the shards' sockets: the first
        # hook of a pass applies the events already there (Scheduler.poll),
        # so an arrival costs the engine's loop, which steps without pause
        # while a request waits, no wake of the library's reader thread.
        self._polled = False
        self._at = -1  # the generation of _has and _failed; -1: none
        # mm_hash -> has_cache_item's answer at _at: every item of every
        # registered request (a snapshot, then what moved since), and
        # hashes asked one by one.
        self._has: dict[str, bool] = {}
        # request id -> failures at _at, for every registered request
        # (absent: none).
        self._failed: dict[str, list[dict[str, Any]]] = {}
        self.recorder = _Recorder()
        # mm_hash -> when a request first asked for it, for the wait statistic.
        self._asked_at: dict[str, float] = {}

    @property
    def endpoints(self) -> str:
        return self._cfg.consumer_endpoint

    def _expected(self, request: Any) -> list[_Expected]:
        rid = request.request_id
        items = self._requests.get(rid)
        if items is None:
            store = from_store(request)
            items = [
                _Expected(i, tid, request.mm_features[i].identifier, store[i])
                for i, tid in enumerate(transfer_ids(request))
                if tid is not None
            ]
            self._requests[rid] = items
            now = time.monotonic()
            for it in items:
                self._asked_at.setdefault(it.mm_hash, now)
        return items

    def _poll(self) -> None:
        if not self._polled:
            self._polled = True
            self._native.poll()

    def has_cache_item(self, identifier: str) -> bool:
        self._poll()
        generation = self._counter.value
        found = self._has.get(identifier) if generation == self._at else None
        if found is False:
            return False
        if found is None:
            found = self._native.has(identifier)
            # Remembered only at the generation of the rest: the next
            # catch-up brings those up to date from there.
            if generation == self._at:
                self._has[identifier] = found
        if found:
            self._said_yes.add(identifier)
            trace.stamp_first("available", identifier)
        return found

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        rid = request.request_id
        if rid in self._given_up:
            return True
        if rid in self._refused or rid in self._unavailable:
            return self._give_up(request) if not self._can_fail else False
        items = self._expected(request)
        remaining = {
            it.mm_hash
            for it in items
            if it.mm_hash not in self._local and unconsumed(request, it.index, num_computed_tokens)
        }
        if not remaining:
            return True
        self._poll()
        if rid not in self._registered:
            if not self._register(rid, items):
                return False
            self._start_fetches(rid, [it for it in items if it.store and it.mm_hash in remaining])
        elif self._counter.value != self._at:
            self._catch_up({})
        has = self._has
        if rid in self._store_deadline:
            lost = self._store_lost_for(rid, [h for h in remaining if not has.get(h)])
            if lost:
                return self._give_up(request, lost)
        failed = [f for f in self._failed.get(rid) or () if f.get("mm_hash") in remaining and not has.get(f.get("mm_hash"))]
        if failed:
            for f in failed:
                logger.warning(
                    "ecmooncake: request %s fails (retryable): item %s (transfer %s) from consumer %s: %s",
                    rid,
                    f.get("mm_hash"),
                    f.get("transfer_id"),
                    self.endpoints,
                    f.get("reason"),
                )
            self._unavailable.add(rid)
            return self._give_up(request) if not self._can_fail else False
        ok = all(has.get(h) for h in remaining)
        if ok and trace.enabled():
            for h in remaining:
                trace.stamp_first("available", h)
        return ok

    def _give_up(self, request: Any, why: str = "") -> bool:
        """Lets a request whose items will not arrive be scheduled without
        them: has_cache_item says no for each, so the engine encodes them
        itself from the request's media (counted: ecm_local_encodes_total).
        For an item from the Store (why) on any vLLM; for a push, where
        there is no take_unavailable_requests to fail the request. True,
        for ensure_cache_available to answer."""
        rid = request.request_id
        self._unavailable.discard(rid)
        self._given_up.add(rid)
        self._store_deadline.pop(rid, None)
        missing = sorted({it.mm_hash for it in self._requests.get(rid) or () if not self._native.has(it.mm_hash)})
        for h in missing:
            self._has[h] = False
        self._local_encodes += missing
        logger.warning(
            "ecmooncake: request %s: items %s will not arrive at consumer %s; %s, so the engine encodes them itself",
            rid,
            missing,
            self.endpoints,
            why or "this vLLM cannot fail the request (no take_unavailable_requests)",
        )
        return True

    def _start_fetches(self, rid: str, items: list[_Expected]) -> None:
        """Hands a newly registered request's items from the Store to the
        fetcher (never waits); one it cannot take is lost at once."""
        if not items:
            return
        if self._fetcher is None:
            self._store_deadline[rid] = time.monotonic()
            self._store_lost[rid] = "this instance gets nothing from Mooncake Store (its store setting is off, or its fetcher did not start)"
            return
        deadline = time.monotonic() + self._fetcher.deadline_s
        self._store_deadline[rid] = deadline
        # An image twice in one request is one transfer: one fetch.
        for it in {it.transfer_id: it for it in items}.values():
            if self._fetcher.fetch(it.transfer_id, it.mm_hash, deadline):
                self._fetching[it.transfer_id] = (rid, it.mm_hash)
            else:
                self._store_lost.setdefault(rid, f"the fetch of {it.mm_hash} from Mooncake Store was not taken")

    def _store_lost_for(self, rid: str, missing: list[str]) -> str:
        """Why an item of rid from the Store will not come (empty: none
        lost yet): a fetch that failed, or the request's Store deadline
        passed with items still missing."""
        for tid, why in (self._fetcher.take_failed() if self._fetcher is not None else {}).items():
            owner = self._fetching.pop(tid, None)
            if owner is not None:
                self._store_lost.setdefault(owner[0], f"the fetch of {owner[1]} from Mooncake Store failed: {why}")
        lost = self._store_lost.pop(rid, "")
        if not missing:
            # Every item is here (a push of the same image may have brought one).
            self._store_deadline.pop(rid, None)
            return ""
        if not lost and time.monotonic() >= self._store_deadline[rid]:
            lost = "items from Mooncake Store did not arrive within their deadline"
        return lost

    def _register(self, rid: str, items: list[_Expected]) -> bool:
        """Registers a new request and learns its answers in the same native
        step, which brings the remembered answers up to date (_catch_up).
        False when the step refused the registration."""
        # Registered first: a snapshot answers for the registered requests.
        self._registered.add(rid)
        out = self._catch_up({"expect": [self._expect_entry(rid, items)]})
        if self._note_expect_errors(out):
            self._registered.discard(rid)
            return False
        return True

    def _catch_up(self, body: dict[str, Any]) -> dict[str, Any]:
        """Runs one native step of body that also brings the remembered
        answers up to the table's generation: by what moved since the
        generation they were taken at, in proportion to what moved; by a
        snapshot of every registered request's answers when there are none
        yet, when the table no longer logs that far back, or when the
        remembered answers outgrew the registered requests (contents of
        finished requests stay until a snapshot)."""
        has_bound = 4 * (len(self._registered) + 256)
        if self._at < 0 or len(self._has) > has_bound:
            body["snapshot"] = True
        else:
            body["changes_since"] = self._at
        out = self._native.step(body)
        if out.get("incremental"):
            self._has.update(out.get("changed") or {})
            for rid, failed in (out.get("changed_failed") or {}).items():
                if failed:
                    self._failed[rid] = failed
                else:
                    self._failed.pop(rid, None)
            self._at = int(out.get("generation", -1))
        else:
            self._take(out)
        return out

    def _take(self, out: dict[str, Any]) -> None:
        """Remembers a snapshot: every registered request's answers."""
        covered = set(out.get("covered") or ())
        self._has = {it.mm_hash: it.mm_hash in covered for r in self._registered for it in self._requests.get(r) or ()}
        self._failed = out.get("failed") or {}
        # Registration moves the generation, so a snapshot covers every
        # request registered before it was taken.
        self._at = int(out.get("generation", -1))

    @staticmethod
    def _expect_entry(rid: str, items: list[_Expected]) -> dict[str, Any]:
        return {"request_id": rid, "items": [{"transfer_id": it.transfer_id, "mm_hash": it.mm_hash} for it in items]}

    def _note_expect_errors(self, out: dict[str, Any]) -> bool:
        errors = out.get("expect_errors") or {}
        for rid, reason in errors.items():
            logger.warning(
                "ecmooncake: request %s refused (retryable with new transfer ids) by consumer %s: %s",
                rid,
                self.endpoints,
                reason,
            )
            self._refused.add(rid)
            self._unavailable.add(rid)
        return bool(errors)

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        feature = request.mm_features[index]
        self._local.add(feature.identifier)
        rid = request.request_id
        if not self._ensure_hook and rid not in self._registered:
            items = self._expected(request)
            if items:
                self._to_register[rid] = items
        if feature.identifier in self._said_yes:
            plan = self._to_load.get(feature.identifier)
            if plan is None:
                plan = _LoadPlan(num_embeds_of(request, index), feature.modality)
                self._to_load[feature.identifier] = plan
            plan.requests.add(rid)

    def build(self, scheduler_output: Any, meta: _StepMetadata) -> None:
        now = time.monotonic()
        for tid, inflight in list(self._inflight.items()):
            if inflight.deadline <= now:
                # No report will come (a step whose worker output was lost);
                # the table's own load deadline has failed the transfer.
                self._drop_inflight(tid)
        for h in getattr(scheduler_output, "free_encoder_mm_hashes", None) or ():
            self._local.discard(h)
            # A free that overtakes its load's report (async scheduling)
            # waits for it: the table moves only loaded items to resident.
            if h in self._loading:
                self._deferred_free.add(h)
            else:
                self._freed.append(h)
        plans, self._to_load = self._to_load, {}
        self._said_yes.clear()
        self._polled = False
        body: dict[str, Any] = {}
        if self._to_register:
            body["expect"] = [self._expect_entry(rid, items) for rid, items in self._to_register.items()]
        if self._reports:
            body["loaded"] = self._reports
        if self._freed:
            body["freed"] = self._freed
        if self._finished:
            body["finished"] = self._finished
        if self._local_encodes:
            body["local_encodes"] = self._local_encodes
        if plans:
            body["load"] = list(plans)
        registering = list(self._to_register)
        self._to_register, self._reports, self._freed, self._finished, self._local_encodes = {}, [], [], [], []
        if not body:
            return
        try:
            out = self._native.step(body)
        except EcmError as exc:
            out = {"load": [{"mm_hash": h, "error": f"scheduler step failed: {exc}"} for h in plans]}
        self._note_expect_errors(out)
        self._registered.update(r for r in registering if r not in self._refused)
        deadline = now + self._load_timeout_s
        answered = {lo.get("mm_hash"): lo for lo in out.get("load") or ()}
        for h, plan in plans.items():
            lo = answered.get(h) or {"error": "no answer from the scheduler step"}
            tid = lo.get("transfer_id") or ""
            error = lo.get("error") or ("" if tid else "no transfer to load")
            if error:
                logger.warning(
                    "ecmooncake: load of %s for requests %s from consumer %s cannot start: %s",
                    h,
                    sorted(plan.requests),
                    self.endpoints,
                    error,
                )
                self._unavailable |= plan.requests
            else:
                if self._outcomes:
                    self._inflight[tid] = _Inflight(h, plan.requests, deadline)
                    self._loading[h] = tid
                else:
                    # No report will come: done as far as the table goes,
                    # told with the next step.
                    self._reports.append({"transfer_id": tid, "ok": True})
                asked = self._asked_at.pop(h, None)
                if asked is not None:
                    self.recorder.waited(now - asked)
            meta.loads.append(LoadSpec(h, tid, plan.num_embeds, plan.modality, error))

    def _drop_inflight(self, tid: str) -> _Inflight | None:
        inflight = self._inflight.pop(tid, None)
        if inflight is not None and self._loading.get(inflight.mm_hash) == tid:
            del self._loading[inflight.mm_hash]
            if inflight.mm_hash in self._deferred_free:
                self._deferred_free.discard(inflight.mm_hash)
                self._freed.append(inflight.mm_hash)
        return inflight

    def update_connector_output(self, report: _WorkerReport) -> None:
        for tid, reason in report.failed_loads.items():
            inflight = self._drop_inflight(tid)
            self._reports.append({"transfer_id": tid, "ok": False, "reason": reason})
            if inflight is not None:
                self._unavailable |= inflight.requests
        for tid in report.loaded - report.failed_loads.keys():
            self._drop_inflight(tid)
            self._reports.append({"transfer_id": tid, "ok": True})

    def request_finished(self, request: Any) -> None:
        rid = request.request_id
        for it in self._requests.pop(rid, None) or ():
            self._asked_at.pop(it.mm_hash, None)
            if it.store:
                self._fetching.pop(it.transfer_id, None)
        self._to_register.pop(rid, None)
        self._given_up.discard(rid)
        self._store_deadline.pop(rid, None)
        self._store_lost.pop(rid, None)
        self._refused.discard(rid)
        self._unavailable.discard(rid)
        # No catch-up names a finished request again.
        self._failed.pop(rid, None)
        if rid in self._registered:
            self._registered.discard(rid)
            self._finished.append(rid)

    def fail(self, request_id: str, reason: str) -> None:
        """Fails a request (retryable) through take_unavailable_requests."""
        if request_id not in self._unavailable:
            logger.warning("ecmooncake: request %s fails (retryable) at consumer %s: %s", request_id, self.endpoints, reason)
        self._unavailable.add(request_id)

    def take_unavailable(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def has_pending_work(self) -> bool:
        # Outcomes, frees and finished requests reach the table with the next
        # step; asking for one keeps an otherwise idle engine from sitting on
        # them (cancels of finished requests free slab space on the shards).
        # A Store fetch in flight, or its count not yet sent with a step's
        # stats, keeps the engine stepping too (_StoreFetcher.busy).
        return bool(self._reports or self._freed or self._finished or self._to_register or self._local_encodes) or (
            self._fetcher is not None and self._fetcher.busy(self._stats_hook)
        )

    def stats(self) -> dict[str, Any]:
        out = self._native.stats()
        if self._fetcher is not None:
            out = {**out, "store": self._fetcher.stats()}
        return out

    def store_increments(self) -> dict[str, int]:
        """The Store counters of this instance's fetches that moved since
        the last call."""
        return self._fetcher.increments() if self._fetcher is not None else {}

    def close(self) -> None:
        # The counter stops once closed: no remembered answer outlives it.
        self._at, self._has, self._failed = -1, {}, {}
        if self._fetcher is not None:
            self._fetcher.close()
        close_bounded(self._native)


# --- scheduler side: producer ------------------------------------------------


class _ProducerScheduler:
    """Encoder instance, engine core: announces pushes, answers the proxy."""

    def __init__(self, cfg: ec_config.ECMooncakeConfig, vllm_config: Any):
        # It holds no native object, but metrics_port promises every
        # process of an instance a port: the engine core's is metrics_port.
        configure_process(cfg, worker=False)
        self._vllm_config = vllm_config
        model_config = getattr(vllm_config, "model_config", None)
        dtype = getattr(model_config, "dtype", None)
        self._dtype = dtype_name(dtype) if dtype is not None and dtype_name(dtype) in DTYPES else None
        self._model_config = model_config
        self._resolver: Any = None
        self._widths: dict[str, int | None] = {}
        self._prepared: dict[str, PushSpec] = {}
        self._by_request: dict[str, list[str]] = {}
        self._new: list[PushSpec] = []
        self._unavailable: set[str] = set()
        self._pending = False

    def _width(self, modality: str) -> int | None:
        if modality not in self._widths:
            width = None
            try:
                from vllm.distributed.ec_transfer.ec_connector.encoder_output_width import (
                    get_encoder_output_width,
                )

                width = int(get_encoder_output_width(self._vllm_config, modality))
            except (ImportError, ValueError, AssertionError) as exc:
                logger.info(
                    "ecmooncake: no measured encoder output width for %s (%s); "
                    "its pushes reserve space once the encoder output exists",
                    modality,
                    exc,
                )
            self._widths[modality] = width
        return self._widths[modality]

    def prepare(self, request: Any, index: int) -> None:
        consumer = consumer_address(getattr(request, "ec_transfer_params", None))
        if consumer is None:
            return
        rid = request.request_id
        tid = transfer_ids(request)[index]
        if tid is None:
            # The proxy still learns this id from request_finished and can
            # hand it to the consumer.
            tid = f"{rid}:{index}"
            throttle.warn(
                "no-transfer-id",
                "ecmooncake: request %s item %d names no transfer_id in ec_items; using %s",
                rid,
                index,
                tid,
            )
        if tid in self._prepared:
            return
        feature = request.mm_features[index]
        width = self._width(feature.modality)
        spec = PushSpec(tid, feature.identifier, consumer, rid, feature.modality)
        if width is not None and self._dtype is not None:
            spec.dtype = self._dtype
            spec.shape = (num_embeds_of(request, index), width)
        self._prepared[tid] = spec
        self._by_request.setdefault(rid, []).append(tid)
        self._new.append(spec)

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> None:
        # Items the encoder cache already holds never reach
        # update_state_after_alloc, so pushes are prepared here as well.
        for index in range(len(request.mm_features)):
            if unconsumed(request, index, num_computed_tokens):
                self.prepare(request, index)

    def build(self, meta: _StepMetadata) -> None:
        meta.pushes, self._new = self._new, []

    def update_connector_output(self, report: _WorkerReport) -> None:
        self._pending = report.pending_pushes
        for tid, reason in report.pushes_failed.items():
            spec = self._prepared.get(tid)
            if spec is None:
                logger.warning("ecmooncake: push %s failed after its request finished: %s", tid, reason)
                continue
            logger.warning(
                "ecmooncake: request %s fails (retryable): push of %s (transfer %s) to %s: %s",
                spec.request_id,
                spec.mm_hash,
                tid,
                spec.consumer,
                reason,
            )
            self._unavailable.add(spec.request_id)

    def request_finished(self, request: Any) -> dict[str, Any] | None:
        rid = request.request_id
        specs = {}
        for tid in self._by_request.pop(rid, ()):
            spec = self._prepared.pop(tid, None)
            if spec is not None:
                specs[tid] = spec
        self._unavailable.discard(rid)
        features = getattr(request, "mm_features", None) or []
        if not features:
            return None
        items = self._item_metadata(features)
        for index, tid in enumerate(transfer_ids(request)):
            ident = features[index].identifier
            entry = items[ident]
            if tid is None:
                tid = f"{rid}:{index}" if f"{rid}:{index}" in specs else None
            spec = specs.get(tid) if tid else None
            if tid:
                entry["transfer_id"] = tid
            entry["mm_hash"] = ident
            if spec is not None and spec.shape is not None:
                entry.update(dtype=spec.dtype, shape=list(spec.shape), nbytes=spec.nbytes)
        return items

    def _item_metadata(self, features: list[Any]) -> dict[str, dict[str, Any]]:
        if self._model_config is not None:
            try:
                from vllm.distributed.ec_transfer.ec_connector.utils import (
                    PlaceholderMetadataResolver,
                    collect_ec_item_metadata,
                )

                if self._resolver is None:
                    self._resolver = PlaceholderMetadataResolver(self._model_config)
                items = collect_ec_item_metadata(features, self._resolver)
            except ImportError:
                items = None
        else:
            items = None
        if items is None:
            items = {}
            for index, feature in enumerate(features):
                items.setdefault(feature.identifier, {"item_indices": []})["item_indices"].append(index)
        for feature in features:
            entry = items[feature.identifier]
            # vLLM 0.32's helper leaves modality out (0.33 fills it in); the
            # proxy needs it to choose the embeds part for the PD request.
            entry.setdefault("modality", feature.modality)
            entry.setdefault("metadata", {})
        return items

    def take_unavailable(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def has_pending_work(self) -> bool:
        return bool(self._pending or self._new)
