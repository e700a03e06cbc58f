"""``python -m ecmooncake bench-hooks``: the consumer's scheduler hooks,
timed inside vLLM's own scheduler.

This process is a PD instance's engine core: vLLM's real ``Scheduler``
(``vllm/v1/core/sched/scheduler.py``) with ECMooncakeConnector in the
scheduler role, built from a real ``VllmConfig`` over a tiny model config,
a one-group ``KVCacheConfig`` and vLLM's ``EncoderCacheManager``. Only the
multimodal budget is given instead of measured (measuring it needs the
model's HF processor) and the model runner is replaced: every scheduled
request samples one token, and every load the connector asks for is
reported done.

A consumer shard and a producer run as two spawned processes. All requests
(one image each, with its transfer id) are added at once; a thread pushes
their encoder outputs in small batches while the engine steps, so that on
every schedule pass many requests wait for an item that has not arrived and
readiness events keep landing. Every call of ``has_cache_item``,
``ensure_cache_available`` and of vLLM's own
``EncoderCacheManager.check_and_update_cache`` (the reference: a dictionary
lookup in Python, called from the same loop) is timed with the same
wrapper, and the summary prints p50/p99 of each beside the number of native
calls the connector made.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

from .cli import add_options

KiB = 1 << 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(
        parser,
        ("--requests", 320, "requests, one image each"), ("--item-kb", 64.0, "encoder output per image, KiB"),
        ("--arrive", 2, "items per push batch"), ("--gap-ms", 5.0, "pause between push batches, ms"),
        ("--max-tokens", 2, "tokens each request decodes"), ("--timeout", 120.0, "seconds allowed for the run"),
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


class _Timed:
    """Times every call of one bound method into a list of nanoseconds.
    ``inside`` (one flag for every _Timed) says whether a timed hook is
    running, for _GcWatch."""

    inside = False

    def __init__(self, fn: Any):
        self.fn = fn
        self.ns: list[int] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        _Timed.inside = True
        try:
            return self.fn(*args, **kwargs)
        finally:
            _Timed.inside = False
            self.ns.append(time.perf_counter_ns() - start)


class _GcWatch:
    """Python's garbage collections during the run (gc.callbacks): how
    many of each generation, their longest pause, and how many began while
    a timed hook was running, so that a hook's worst call can be told from
    a collection that stopped the interpreter under it."""

    def __init__(self) -> None:
        self.runs = [0, 0, 0]
        self.during_hooks = [0, 0, 0]
        self.longest_us = 0.0
        self._t0 = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        gen = min(2, int(info.get("generation", 0)))
        if phase == "start":
            self._t0 = time.perf_counter_ns()
            self.runs[gen] += 1
            if _Timed.inside:
                self.during_hooks[gen] += 1
        elif self._t0:
            self.longest_us = max(self.longest_us, (time.perf_counter_ns() - self._t0) / 1000.0)

    def summary(self) -> dict[str, Any]:
        return {"runs": self.runs, "during_hooks": self.during_hooks, "longest_us": round(self.longest_us, 1)}


def _freeze_heap() -> None:
    """What vLLM's engine core does once it is built (freeze_gc_heap): the
    objects of startup move to the permanent generation, which collections
    no longer walk."""
    try:
        from vllm.utils.gc_utils import freeze_gc_heap
    except ImportError:  # a vLLM without it: the same steps
        gc.collect()
        gc.freeze()
        return
    freeze_gc_heap()


class _CountingNative:
    """Counts the connector's calls into the native scheduler."""

    def __init__(self, native: Any):
        self._native = native
        self.steps = 0
        self.lookups = 0
        self.polls = 0

    def poll(self) -> int:
        self.polls += 1
        return self._native.poll()

    def step(self, body: Any) -> Any:
        self.steps += 1
        return self._native.step(body)

    def has(self, mm_hash: str) -> bool:
        self.lookups += 1
        return self._native.has(mm_hash)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)


def _percentiles(ns: list[int]) -> dict[str, Any]:
    if not ns:
        return {"calls": 0, "p50_us": None, "p99_us": None}
    s = sorted(ns)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))] / 1000.0  # noqa: E731
    return {"calls": len(s), "p50_us": round(pick(0.50), 2), "p99_us": round(pick(0.99), 2), "max_us": round(s[-1] / 1000.0, 1)}


def _scheduler(model_dir: Path, port: int, slab_bytes: int, num_reqs: int) -> Any:
    import torch
    import vllm.v1.core.sched.scheduler as vllm_scheduler
    from vllm.config import CacheConfig, DeviceConfig, ECTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from .. import plugin

    ec = ECTransferConfig(
        ec_connector="ECMooncakeConnector",
        ec_role="ec_consumer",
        ec_buffer_device="cpu",
        ec_buffer_size=slab_bytes,
        ec_ip="127.0.0.1",
        ec_port=port,
        ec_connector_extra_config={"log_level": "warn"},
    )
    max_len = 8192
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_len)
    # Room for every request at once: each schedule pass scans every waiting
    # request, which is where ensure_cache_available is called.
    seqs = max(num_reqs, 64)
    sched = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=1 << 16, max_model_len=max_len, is_encoder_decoder=False)
    blocks = 1 << 16
    cache = CacheConfig(block_size=16, enable_prefix_caching=False)
    cache.num_gpu_blocks = blocks
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, ec_transfer_config=ec, device_config=DeviceConfig(device="cpu"))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])

    class Budget:
        """What vLLM would measure with the model's processor."""

        def __init__(self, *args: Any, **kwargs: Any):
            self.encoder_compute_budget = 1 << 16
            self.encoder_cache_size = 1 << 20
            self.mm_max_toks_per_item = {"image": 4096}

    plugin.register()
    with mock.patch.object(vllm_scheduler, "MultiModalBudget", Budget):
        return vllm_scheduler.Scheduler(
            vllm_config=config,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(config),
            block_size=16,
            log_stats=False,
        )


def _request(request_id: str, identifier: str, rows: int, transfer_id: str, max_tokens: int) -> Any:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    feature = MultiModalFeatureSpec(data=None, modality="image", identifier=identifier, mm_position=PlaceholderRange(offset=4, length=rows))
    params = {"ec_items": [{"mm_hash": identifier, "transfer_id": transfer_id}]}
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"ec_transfer_params": params})
    return Request(request_id, list(range(rows + 8)), sampling, None, mm_features=[feature])


def _model_output(scheduler_output: Any, report: Any) -> Any:
    from vllm.v1.outputs import ECConnectorOutput, ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids],
        ec_connector_output=ECConnectorOutput(ec_connector_worker_meta=report),
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from .bench_vllm import tiny_model_config
    from .harness import Worker, free_port_range, stop_all

    hidden = 512
    rows = max(1, int(args.item_kb * KiB) // (hidden * 2))
    nbytes = rows * hidden * 2
    port = free_port_range(1)
    slab_bytes = max(64 << 20, 2 * args.requests * nbytes)
    settings = {"log_level": "warn"}
    consumer = Worker(
        "consumer",
        "consumer",
        config={"ec_ip": "127.0.0.1", "ec_port": port, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "transport": "tcp"},
        slab_bytes=slab_bytes,
        settings=settings,
    )
    producer = Worker("producer", "producer", config={"transport": "tcp"}, settings=settings)
    workers = [consumer, producer]
    with tempfile.TemporaryDirectory(prefix="ecm-bench-hooks-") as tmp:
        try:
            for w in workers:
                w.wait_ready(60)
            sched = _scheduler(tiny_model_config(Path(tmp) / "model", hidden), port, slab_bytes, args.requests)
            try:
                return _drive(args, sched, producer, port, rows, nbytes)
            finally:
                sched.shutdown()
        finally:
            stop_all(workers)


def _drive(args: argparse.Namespace, sched: Any, producer: Any, port: int, rows: int, nbytes: int) -> dict[str, Any]:
    import hashlib

    connector = sched.ec_connector
    native = _CountingNative(connector._consumer_sched._native)
    connector._consumer_sched._native = native
    has = connector.has_cache_item = _Timed(connector.has_cache_item)
    ensure = connector.ensure_cache_available = _Timed(connector.ensure_cache_available)
    manager = sched.encoder_cache_manager
    reference = manager.check_and_update_cache = _Timed(manager.check_and_update_cache)
    report_cls = connector._report_cls

    items = []
    for n in range(args.requests):
        ident = hashlib.sha256(f"bench-hooks/{n}".encode()).hexdigest()
        items.append({"transfer_id": f"bh-{n}", "mm_hash": ident, "nbytes": nbytes, "seed": n + 1})
        sched.add_request(_request(f"req-{n}", ident, rows, f"bh-{n}", args.max_tokens))

    pushed: list[float] = []
    failures: list[str] = []

    def push() -> None:
        try:
            for i in range(0, len(items), args.arrive):
                out = producer.call("push", 60, items=items[i : i + args.arrive], consumer=f"tcp://127.0.0.1:{port}", timeout_s=30, fill="zeros")
                if out["failed"] or out["timed_out"]:
                    failures.append(json.dumps({"failed": out["failed"], "timed_out": out["timed_out"]}))
                pushed.append(time.monotonic())
                time.sleep(args.gap_ms / 1000.0)
        except Exception as exc:  # reported in the summary
            failures.append(f"{type(exc).__name__}: {exc}")

    pusher = threading.Thread(target=push, name="ecm-bench-pusher", daemon=True)
    _freeze_heap()
    watch = _GcWatch()
    gc.callbacks.append(watch)
    try:
        steps, schedule_ns, elapsed = _loop(args, sched, pusher, report_cls)
    finally:
        gc.callbacks.remove(watch)
    unfinished = len(sched.requests)
    return {
        "machine": f"{platform.machine()}, {_cores()} cores",
        "requests": args.requests,
        "item_bytes": nbytes,
        "steps": steps,
        "seconds": round(elapsed, 3),
        "unfinished": unfinished,
        "push_failures": failures[:5],
        "has_cache_item": _percentiles(has.ns),
        "ensure_cache_available": _percentiles(ensure.ns),
        "check_and_update_cache": _percentiles(reference.ns),
        "schedule_pass": _percentiles(schedule_ns),
        "native_steps_from_hooks": native.steps,
        "native_lookups_from_has": native.lookups,
        "socket_reads_from_hooks": native.polls,
        "gc": watch.summary(),
    }


def _loop(args: argparse.Namespace, sched: Any, pusher: threading.Thread, report_cls: Any) -> tuple[int, list[int], float]:
    """vLLM's engine loop over the scheduler while the pusher pushes:
    passes, each pass's time, and the seconds it took."""
    steps = 0
    schedule_ns: list[int] = []
    started = time.monotonic()
    pusher.start()
    deadline = started + args.timeout
    while sched.has_requests() and time.monotonic() < deadline:
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        schedule_ns.append(time.perf_counter_ns() - t0)
        loads = getattr(out.ec_connector_metadata, "loads", ())
        report = report_cls(loaded={spec.transfer_id for spec in loads if not spec.error})
        sched.update_from_output(out, _model_output(out, report))
        steps += 1
        if not out.num_scheduled_tokens:
            time.sleep(0.0002)  # nothing to run: an idle engine loop spins too
    elapsed = time.monotonic() - started
    pusher.join(5)
    return steps, schedule_ns, elapsed


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def _row(name: str, p: dict[str, Any]) -> str:
    if not p["calls"]:
        return f"  {name:<34} no calls"
    return f"  {name:<34} p50 {p['p50_us']:8.2f} µs   p99 {p['p99_us']:8.2f} µs   worst {p['max_us']:9.1f} µs   ({p['calls']} calls)"


def format_summary(r: dict[str, Any]) -> str:
    ref = r["check_and_update_cache"]
    lines = [
        f"ecmooncake bench-hooks: vLLM's Scheduler, {r['requests']} requests of one {r['item_bytes'] // KiB} KiB image, "
        f"{r['steps']} steps in {r['seconds']} s ({r['machine']})",
        _row("has_cache_item", r["has_cache_item"]),
        _row("ensure_cache_available", r["ensure_cache_available"]),
        _row("check_and_update_cache (reference)", ref),
        _row("schedule() pass", r["schedule_pass"]),
        f"  native calls from the hooks: {r['native_steps_from_hooks']} steps for "
        f"{r['ensure_cache_available']['calls']} ensure_cache_available, {r['native_lookups_from_has']} lookups for "
        f"{r['has_cache_item']['calls']} has_cache_item; {r['socket_reads_from_hooks']} reads of the shards' "
        f"sockets (Scheduler.poll) in {r['steps']} passes",
    ]
    if "gc" in r:
        g = r["gc"]
        lines.append(
            f"  garbage collections (startup heap frozen, as vLLM's engine core does): {g['runs']} of generations 0/1/2, "
            f"{g['during_hooks']} of them begun inside a hook call; the longest {g['longest_us']} µs"
        )
    if ref["calls"]:
        for name in ("has_cache_item", "ensure_cache_available"):
            p = r[name]
            if p["calls"]:
                lines.append(f"  {name} p50 is {p['p50_us'] / ref['p50_us']:.1f}x the reference's")
    if r["unfinished"] or r["push_failures"]:
        lines.append(f"  unfinished requests: {r['unfinished']}; push failures: {r['push_failures']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_summary(result))
    return 1 if result["unfinished"] or result["push_failures"] else 0
