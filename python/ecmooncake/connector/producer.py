"""The producer worker role: an encoder instance's native
:class:`~ecmooncake.native.Producer`, which reserves space on every consumer
shard before the encoder runs and writes each output once it exists.

A CUDA output goes to the library as device memory with the stream that
produced it: the library orders its reads after that stream's work (the
engine thread records nothing and waits for nothing), copies device to
device with ``cuda_ipc`` into a GPU slab on this host, and for the network
transports stages it in the library: through a registered GPU staging slab
for ``mooncake`` with an engine that registers GPU memory (a CUDA build),
through page-locked host buffers for ``tcp``, ``shm`` and a non-CUDA
``mooncake`` engine. Python copies no encoder output anywhere.

With ``store`` on, each output handed over is also offered to Mooncake
Store (:mod:`.tier`): a CPU output is copied by the tier's own thread after
the hand-over, a CUDA output first into the tier's pinned pool on a stream
of its own ordered after the output's."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from .. import ec_config, trace
from ..errors import EcmError
from ..native import Producer
from .dtypes import DTYPES, dtype_name, import_torch
from .lifecycle import close_bounded, configure_process
from .log import logger, throttle
from .metadata import PushSpec, _WorkerReport
from .stats import _Recorder
from .tier import make as make_tier

# --- worker side: producer ---------------------------------------------------


@dataclass
class _Push:
    spec: PushSpec
    announced: float
    submitted: bool = False
    sourced: bool = False
    # When the encoder output was handed over: the push time starts here.
    sourced_at: float = 0.0


# Transfer ids of pushes that ended, remembered so that announcing one again
# (a proxy reusing an id) cannot create a push the library will never report
# on: it treats a known id as a no-op.
MAX_ENDED_PUSHES = 1 << 16


class _ProducerWorker:
    """The encoder's worker: reserve before encoding, write once encoded."""

    def __init__(self, cfg: ec_config.ECMooncakeConfig, vllm_config: Any = None):
        self._cfg = cfg
        # Opened in start, after vLLM forked this worker.
        self._tier = make_tier(cfg, vllm_config)
        self._native: Producer | None = None
        # Guards the native producer and everything below. Held only for
        # non-blocking native calls.
        self._lock = threading.Lock()
        self._pushes: dict[str, _Push] = {}
        self._by_hash: dict[str, set[str]] = {}
        self._ready: dict[str, Any] = {}
        self._done: set[str] = set()
        self._failed: dict[str, str] = {}
        # The stream each CUDA output in _ready was produced on, captured in
        # save_caches: later work queued on another stream is no concern of
        # the library's.
        self._streams: dict[str, Any] = {}
        self._said_path = False
        push_wait = float(cfg.value("push_wait_timeout_s"))
        control = float(cfg.extra.get("control_timeout_s", 30.0))
        # Every state of a push has a deadline in the library; past the sum
        # of them (and a margin) no outcome will come.
        self._give_up_s = 3 * push_wait + 2 * control + 30.0
        self._ended: dict[str, None] = {}
        self._closed = False
        self.recorder = _Recorder()

    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise EcmError("producer: connector is shut down")
            if self._native is None:
                configure_process(self._cfg, worker=True)
                self._native = Producer(self._cfg.producer_settings())
                if self._tier is not None:
                    self._tier.open()

    def announce(self, pushes: list[PushSpec], encoder_cache: dict[str, Any] | None) -> None:
        self.start()
        new = [s for s in pushes if s.transfer_id not in self._pushes]
        if not new:
            return
        now = time.monotonic()
        with self._lock:
            for spec in new:
                if spec.transfer_id in self._ended:
                    self._failed[spec.transfer_id] = "transfer id already used by an earlier push"
                    self.recorder.push_failed()
                    continue
                self._pushes[spec.transfer_id] = _Push(spec, now)
                self._by_hash.setdefault(spec.mm_hash, set()).add(spec.transfer_id)
            self._submit_locked([self._pushes[s.transfer_id] for s in new if s.nbytes and s.transfer_id in self._pushes])
        if encoder_cache:
            # Outputs the encoder cache already holds are not encoded again,
            # so save_caches will not see them: hand them over now.
            for h in dict.fromkeys(s.mm_hash for s in new):
                if h in encoder_cache:
                    self.capture(h, encoder_cache[h])

    def _submit_locked(self, pushes: list[_Push]) -> None:
        if not pushes or self._native is None:
            return
        body = [
            {
                "transfer_id": p.spec.transfer_id,
                "mm_hash": p.spec.mm_hash,
                "nbytes": p.spec.nbytes,
                "consumer": p.spec.consumer,
                "meta": p.spec.describe(),
            }
            for p in pushes
        ]
        try:
            answers = self._native.submit(body)
        except EcmError as exc:
            answers = [{"transfer_id": p.spec.transfer_id, "error": str(exc)} for p in pushes]
        for push, answer in zip(pushes, answers):
            if answer.get("error"):
                self._fail_locked(push.spec.transfer_id, answer["error"])
            else:
                push.submitted = True

    def wants(self, mm_hash: str) -> bool:
        return bool(self._by_hash.get(mm_hash))

    def capture(self, mm_hash: str, tensor: Any) -> None:
        """Takes the encoder output of mm_hash for every push that wants it."""
        if not self.wants(mm_hash):
            return
        trace.stamp("save_caches", mm_hash)
        device = tensor.device.type
        with self._lock:
            if device not in ("cpu", "cuda"):
                reason = f"encoder output on {tensor.device}: only CPU and CUDA memory can be sent"
                self._abandon_locked(list(self._by_hash.get(mm_hash, ())), reason)
                return
            now = time.monotonic()
            for tid in self._by_hash.get(mm_hash, ()):
                self._pushes[tid].sourced = True
                self._pushes[tid].sourced_at = now
            if device == "cpu":
                self._ready[mm_hash] = tensor
                return
            self._say_path(tensor)
            # Made contiguous here, on the engine thread, so that the copy
            # is queued on the output's own stream behind its kernels;
            # nothing waits for either.
            self._ready[mm_hash] = tensor if tensor.is_contiguous() else tensor.contiguous()
            self._streams[mm_hash] = import_torch().cuda.current_stream(tensor.device)

    def _say_path(self, tensor: Any) -> None:
        """Logs once how CUDA outputs leave this encoder."""
        if self._said_path:
            return
        self._said_path = True
        logger.info(
            "ecmooncake: encoder outputs on %s go to the library as device memory: cuda_ipc into GPU "
            "slabs on this host, %s (staged by the library where it needs host memory) to any other "
            "(ecm_transfer_bytes_total{transport} counts each)",
            tensor.device,
            self._cfg.value("transport"),
        )

    def flush(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, {}
            if ready:
                self._hand_over_locked(ready)

    def _hand_over_locked(self, ready: dict[str, Any]) -> None:
        if self._native is None:
            # Shut down: nobody to hand the outputs to.
            return
        sources = []
        puts: list[tuple[str, Any, Any]] = []
        late: list[_Push] = []
        for h, tensor in ready.items():
            stream = self._streams.pop(h, None)
            pushes = [self._pushes[tid] for tid in self._by_hash.get(h, ())]
            if not pushes:
                continue
            dtype, shape = dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape)
            wrong = [p for p in pushes if p.spec.shape is not None and (p.spec.dtype, tuple(p.spec.shape)) != (dtype, shape)]
            for p in wrong:
                announced = f"{list(p.spec.shape)} {p.spec.dtype}"
                self._abandon_locked([p.spec.transfer_id], f"encoder output is {list(shape)} {dtype}, the push announced {announced}")
            for p in pushes:
                if p.spec.shape is None and not p.submitted and dtype in DTYPES and len(shape) == 2:
                    p.spec.dtype, p.spec.shape = dtype, shape
                    late.append(p)
            if any(p.submitted for p in pushes if p not in wrong) or late:
                sources.append((h, tensor if tensor.is_contiguous() else tensor.contiguous(), stream))
            if self._tier is not None:
                puts.append((h, tensor, stream))
        self._submit_locked(late)
        # One call per producing stream (in practice one per step), so that
        # each output's reads are ordered after its own stream's work. The
        # library holds each tensor (Producer keeps it referenced) until poll
        # reports it released, so the caching allocator cannot reuse it
        # under a copy.
        groups: dict[int, tuple[Any, list[tuple[str, Any]]]] = {}
        for h, tensor, stream in sources:
            key = None if stream is None else int(stream.cuda_stream)
            groups.setdefault(key, (stream, []))[1].append((h, tensor))
        for stream, items in groups.values():
            try:
                self._native.sources(items, stream=stream)
            except EcmError as exc:
                # The library fails the pushes it could not source and reports
                # them through poll; the ones it took are already on their way.
                throttle.warn("sources", "ecmooncake: encoder outputs refused by the producer: %s", exc)
        # After the pushes: the Store is a second copy, never ahead of them.
        for h, tensor, stream in puts:
            self._tier.put(h, tensor, stream)

    def _fail_locked(self, tid: str, reason: str) -> None:
        push = self._pushes.pop(tid, None)
        if push is None:
            return
        logger.warning(
            "ecmooncake: push of %s (transfer %s, request %s) to %s failed: %s",
            push.spec.mm_hash,
            tid,
            push.spec.request_id,
            push.spec.consumer,
            reason,
        )
        self._failed[tid] = reason
        self.recorder.push_failed()
        self._forget_locked(push)

    def _forget_locked(self, push: _Push) -> None:
        self._ended[push.spec.transfer_id] = None
        if len(self._ended) > MAX_ENDED_PUSHES:
            del self._ended[next(iter(self._ended))]
        tids = self._by_hash.get(push.spec.mm_hash)
        if tids is not None:
            tids.discard(push.spec.transfer_id)
            if not tids:
                del self._by_hash[push.spec.mm_hash]
                self._ready.pop(push.spec.mm_hash, None)
                self._streams.pop(push.spec.mm_hash, None)

    def _abandon_locked(self, tids: list[str], reason: str) -> None:
        """Fails pushes for good, and frees what the library holds for them."""
        submitted = [tid for tid in tids if tid in self._pushes and self._pushes[tid].submitted]
        for tid in tids:
            self._fail_locked(tid, reason)
        self._cancel_locked(submitted)

    def _cancel_locked(self, tids: list[str]) -> None:
        if tids and self._native is not None:
            self._native.cancel(tids)

    def finish(self, finished_req_ids: set[str] | None) -> None:
        """End-of-step work: hand over outputs, drop pushes of finished
        requests that never got one, collect outcomes."""
        if self._native is None:
            return
        self.flush()
        with self._lock:
            if finished_req_ids:
                orphans = [
                    p for p in self._pushes.values() if p.spec.request_id in finished_req_ids and not p.sourced
                ]
                for p in orphans:
                    self._pushes.pop(p.spec.transfer_id, None)
                    self._forget_locked(p)
                self._cancel_locked([p.spec.transfer_id for p in orphans if p.submitted])
            out = self._native.poll(0)
            now = time.monotonic()
            for tid in out.get("done") or ():
                push = self._pushes.pop(tid, None)
                if push is not None:
                    self.recorder.pushed(now - (push.sourced_at or push.announced), push.spec.nbytes or 0)
                    self._forget_locked(push)
                self._done.add(tid)
            for failure in out.get("failed") or ():
                tid = failure.get("transfer_id") or ""
                if tid in self._pushes:
                    self._fail_locked(tid, failure.get("reason") or "failed")
            limit = time.monotonic() - self._give_up_s
            for tid in [tid for tid, p in self._pushes.items() if p.announced < limit]:
                self._fail_locked(tid, f"no outcome from the library after {self._give_up_s:.0f}s")

    def report(self, report: _WorkerReport) -> None:
        with self._lock:
            report.pushes_done |= self._done
            report.pushes_failed.update(self._failed)
            # Held sources keep the engine stepping too: only a poll lets
            # the library hand them back.
            held = self._native is not None and self._native.held_sources > 0
            pending = bool(self._pushes or self._ready or held)
            report.pending_pushes = report.pending_pushes or pending
            self._done, self._failed = set(), {}

    def stats(self) -> dict[str, Any]:
        out = self._native.stats() if self._native is not None else {}
        if self._tier is not None:
            out = {**out, "store": self._tier.stats()}
        return out

    def store_increments(self) -> dict[str, int]:
        """The Store tier's counters that moved since the last call."""
        return self._tier.increments() if self._tier is not None else {}

    def close(self) -> None:
        self.flush()
        with self._lock:
            native, self._native = self._native, None
            self._closed = True
        if native is not None:
            close_bounded(native)
        if self._tier is not None:
            self._tier.close()
