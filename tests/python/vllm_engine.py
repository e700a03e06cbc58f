"""An engine-shaped driver of encoder-cache connectors, for the connector tests.

It calls a connector's hooks in the order vLLM 0.33's scheduler
(``v1/core/sched/scheduler.py``) and model runner (``v1/worker/gpu/
ec_connector.py``) do, and only those the installed vLLM calls
(ecmooncake.connector.calls: on 0.26 neither worker reports nor
take_unavailable_requests, has_pending_push_work or the stats hooks), with vLLM's own objects wherever they run without a
GPU: ``VllmConfig``/``ECTransferConfig``/``ModelConfig`` (from a tiny model
config written to disk), ``Request``, ``EncoderCacheManager``,
``SchedulerOutput``, ``ECConnectorOutput``, ``ModelRunnerOutput`` and
``ECOutputAggregator``. Only the model itself is replaced: the "encoder"
produces deterministic bf16 tensors from each item's identifier, and the
"gather" checks every loaded tensor bit for bit against the same recipe.

As in vLLM, the scheduler-role connector lives in the engine's process and
each worker-role connector in a worker process of its own (spawned, so that
no Go runtime crosses a fork); scheduler metadata and worker output cross
the pipe pickled, as they cross vLLM's message queues.
"""

from __future__ import annotations

import copy
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ecmooncake.connector.calls import read_calls
from ecmooncake.tools.connector_gpu import Item
from ecmooncake.tools.worker import Worker

CONNECTOR = "ECMooncakeConnector"

# What the installed vLLM calls; the driver calls nothing more.
CALLS = read_calls()


def require_vllm() -> None:
    """Skips the calling test module when vLLM is not importable (fails it
    when ECMOONCAKE_REQUIRE_VLLM=1)."""
    try:
        import vllm  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        reason = f"vLLM is not importable ({exc}); install tests/python/requirements-vllm.txt"
        if os.environ.get("ECMOONCAKE_REQUIRE_VLLM") == "1":
            pytest.fail(reason + " (ECMOONCAKE_REQUIRE_VLLM=1)", pytrace=False)
        pytest.skip(reason, allow_module_level=True)


# --- configs -----------------------------------------------------------------

HIDDEN = 512


def tiny_model(directory: Path, hidden: int = HIDDEN) -> Path:
    """A Qwen2.5-VL-shaped config.json: enough for vLLM's ModelConfig."""
    from ecmooncake.tools.bench_vllm import tiny_model_config

    return tiny_model_config(directory, hidden)


def make_config(
    role: str,
    *,
    model_dir: Path | None,
    port: int,
    tp_size: int = 1,
    buffer_size: int = 256 << 20,
    extra: dict | None = None,
    widths: dict[str, int] | None = None,
    connector: str = CONNECTOR,
    module_path: str | None = None,
    device: str = "cpu",
) -> Any:
    """A real VllmConfig for one instance of an EPD deployment."""
    from vllm.config import DeviceConfig, ECTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    ec = ECTransferConfig(
        ec_connector=connector,
        ec_role=role,
        ec_buffer_device=device,
        ec_buffer_size=buffer_size,
        ec_ip="127.0.0.1",
        ec_port=port,
        ec_connector_extra_config=dict(extra or {}),
        ec_connector_module_path=module_path,
    )
    if widths:
        # What vLLM's engine core measures at startup on a producer.
        ec.mm_encoder_output_widths = dict(widths)
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16") if model_dir else None
    return VllmConfig(
        model_config=model,
        ec_transfer_config=ec,
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
    )


# --- requests and tensors ----------------------------------------------------


def make_request(request_id: str, items: list[Item], params: dict | None, max_tokens: int = 2) -> Any:
    """A vLLM Request whose prompt places each item's embeddings."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    features = []
    offset = 4
    for item in items:
        features.append(
            MultiModalFeatureSpec(
                data=None,
                modality=item.modality,
                identifier=item.identifier,
                mm_position=PlaceholderRange(offset=offset, length=item.num_embeds),
            )
        )
        offset += item.num_embeds + 4
    extra = {"ec_transfer_params": params} if params is not None else None
    sampling = SamplingParams(max_tokens=max_tokens, extra_args=extra)
    return Request(request_id, list(range(offset)), sampling, None, mm_features=features)


_tensor_cache: dict[tuple[str, tuple[int, int]], Any] = {}


def encoder_output(identifier: str, shape: tuple[int, int]) -> Any:
    """The stand-in encoder: deterministic bf16 from the item's identifier."""
    import torch

    key = (identifier, tuple(shape))
    if key not in _tensor_cache:
        gen = torch.Generator().manual_seed(int(identifier[:15], 16))
        _tensor_cache[key] = torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    return _tensor_cache[key]


def bit_equal(got: Any, want: Any) -> bool:
    import torch

    return (
        got.dtype == want.dtype
        and tuple(got.shape) == tuple(want.shape)
        and torch.equal(got.contiguous().view(torch.int16), want.view(torch.int16))
    )


# --- worker processes --------------------------------------------------------


class WorkerHost:
    """A worker-role connector and its encoder cache, as vLLM's model runner
    holds them (V2 runner, ``ActiveECConnector.maybe_get_output``)."""

    def __init__(self, config: bytes, rank: int):
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

        from ecmooncake import plugin

        vllm_config = pickle.loads(config)
        vllm_config.parallel_config.rank = rank  # as vLLM's WorkerBase does
        plugin.register()  # vLLM runs the general plugins in every worker
        self.connector = ECConnectorFactory.create_connector(vllm_config, ECConnectorRole.WORKER)
        if CALLS.hooks["start_worker_services"]:
            self.connector.start_worker_services()
        self.cache: dict[str, Any] = {}
        self._step: dict[str, Any] | None = None

    def ready(self) -> dict:
        return {"pid": os.getpid()}

    def op_begin(self, payload: bytes) -> None:
        """Everything of a step up to the model's forward."""
        step = pickle.loads(payload)
        for h in step["free"]:
            self.cache.pop(h, None)
        self._step = step
        meta = step["meta"]
        if meta is None:
            return
        c = self.connector
        c.bind_connector_metadata(meta)
        if c.is_producer and CALLS.hooks["start_save_caches"]:
            c.start_save_caches(encoder_cache=self.cache)
        if c.is_consumer:
            c.start_load_caches(self.cache)

    def op_end(self) -> bytes:
        """The forward (encode, gather) and the end-of-step hooks."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ECConnectorOutput, ModelRunnerOutput

        step, self._step = self._step, None
        assert step is not None, "end without begin"
        gathered: dict[str, str] = {}
        meta = step["meta"]
        if meta is None:
            return pickle.dumps((EMPTY_MODEL_RUNNER_OUTPUT, gathered))
        c = self.connector
        output = ECConnectorOutput()
        before = set(self.cache)
        try:
            for h, shape in step["encode"]:
                if h not in self.cache:
                    self.cache[h] = encoder_output(h, shape)
            for h, shape in step["gather"]:
                got = self.cache.get(h)
                if got is None:
                    gathered[h] = "missing"
                else:
                    gathered[h] = "ok" if bit_equal(got, encoder_output(h, shape)) else "differs"
            if c.is_producer:
                for h in self.cache.keys() - before:
                    c.save_caches(encoder_cache=self.cache, mm_hash=h)
        finally:
            output.finished_sending, output.finished_recving = c.get_finished(step["finished"])
            if CALLS.hooks["get_ec_connector_stats"]:
                output.ec_connector_stats = c.get_ec_connector_stats()
            if CALLS.outcomes:
                output.ec_connector_worker_meta = c.build_connector_worker_meta()
            c.clear_connector_metadata()
        if hasattr(ModelRunnerOutput, "with_ec_conn_output"):
            result = ModelRunnerOutput.with_ec_conn_output(EMPTY_MODEL_RUNNER_OUTPUT, output)
        else:  # vLLM 0.26
            result = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
            result.ec_connector_output = output
        return pickle.dumps((result, gathered), protocol=pickle.HIGHEST_PROTOCOL)

    def op_step(self, payload: bytes) -> bytes:
        self.op_begin(payload)
        return self.op_end()

    def op_stats(self) -> dict:
        return self.connector.native_stats()

    def op_cache_keys(self) -> list[str]:
        return sorted(self.cache)

    def close(self) -> None:
        self.connector.shutdown()


class WorkerProc(Worker):
    """A spawned process holding one worker-role connector (a WorkerHost)."""

    def __init__(self, name: str, config: Any, rank: int = 0):
        super().__init__(WorkerHost, name, config=pickle.dumps(config), rank=rank)


# --- the engine --------------------------------------------------------------


@dataclass
class Outcome:
    status: str  # "done", "error" or "aborted"
    params: dict | None
    gathered: dict[str, str] = field(default_factory=dict)
    steps_waited: int = 0


@dataclass
class _Running:
    request: Any
    decoded: int = 0
    gathered: dict[str, str] = field(default_factory=dict)


class Engine:
    """One vLLM instance driven step by step, synchronously (no batch queue).

    ``connector`` is the scheduler-role connector; ``workers`` its TP ranks.
    An encode-only instance finishes each request in the step that encoded
    it, as vLLM does; any other runs ``max_tokens - 1`` decode steps after
    the prefill step that gathers every item.
    """

    def __init__(self, name: str, connector: Any, workers: list[WorkerProc], *, encode_only: bool, cache_embeds: int, budget_embeds: int = 1 << 20):
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

        self.name = name
        self.connector = connector
        self.workers = workers
        self.encode_only = encode_only
        self.cache = EncoderCacheManager(cache_embeds)
        self.budget = budget_embeds
        self.waiting: list[Any] = []
        self.running: dict[str, _Running] = {}
        self.outcomes: dict[str, Outcome] = {}
        self.freed_log: list[str] = []
        self.loads_log: list[str] = []
        self.encoded_log: list[str] = []
        self.widths: dict[str, int] = {}
        # Each step's ec_connector_stats as the engine core sends them to
        # vLLM's front end (SchedulerStats, msgpack), for its stat loggers.
        self.stats_log: list[dict] = []
        self._finished_ids: set[str] = set()
        self._waited: dict[str, int] = {}
        self.steps = 0

    def add(self, request: Any, widths: dict[str, int]) -> None:
        for f in request.mm_features:
            self.widths[f.identifier] = widths[f.identifier]
        self.waiting.append(request)

    def has_requests(self) -> bool:
        pending = CALLS.hooks["has_pending_push_work"] and self.connector.has_pending_push_work()
        return bool(self.waiting or self.running or pending)

    def abort(self, request_id: str) -> None:
        """vLLM's finish_requests(..., ABORTED)."""
        self._end(request_id, "aborted")

    def _end(self, request_id: str, status: str) -> None:
        """Finishes a request wherever it is, waiting or running."""
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                self._finish(req, status, {})
        run = self.running.pop(request_id, None)
        if run is not None:
            self._finish(run.request, status, run.gathered)

    def _shape(self, feature: Any) -> tuple[int, int]:
        return (feature.mm_position.get_num_embeds(), self.widths[feature.identifier])

    def schedule(self) -> tuple[Any, dict]:
        c = self.connector
        prefills: dict[str, Any] = {}
        encoder_inputs: dict[str, list[int]] = {}
        budget = self.budget
        if CALLS.ensure_paths > 1:  # 0.26 to 0.29: the waiting path only
            for run in self.running.values():
                c.ensure_cache_available(run.request, run.request.num_computed_tokens)
        for req in list(self.waiting):
            if not c.ensure_cache_available(req, 0):
                self._waited[req.request_id] = self._waited.get(req.request_id, 0) + 1
                continue
            compute, external, duplicate = [], [], []
            in_step: dict[str, int] = {}
            scheduled = 0
            fits = True
            for i, f in enumerate(req.mm_features):
                n = f.mm_position.get_num_embeds()
                if f.identifier in in_step:
                    duplicate.append(i)
                    continue
                if self.cache.check_and_update_cache(req, i):
                    continue
                if not self.cache.can_allocate(req, i, budget, scheduled):
                    fits = False
                    break
                if c.has_cache_item(f.identifier):
                    external.append(i)
                else:
                    compute.append(i)
                    budget -= n
                in_step[f.identifier] = n
                scheduled += n
            if not fits:
                continue
            for i in compute + external:
                self.cache.allocate(req, i)
                c.update_state_after_alloc(req, i)
            for i in duplicate:
                self.cache.check_and_update_cache(req, i)
            self.waiting.remove(req)
            self.running[req.request_id] = _Running(req)
            prefills[req.request_id] = req
            if compute:
                encoder_inputs[req.request_id] = compute
        from vllm.v1.core.sched.output import SchedulerOutput

        out = SchedulerOutput.make_empty()
        out.scheduled_encoder_inputs = encoder_inputs
        out.num_scheduled_tokens = {rid: run.request.num_tokens for rid, run in self.running.items()}
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.finished_req_ids, self._finished_ids = self._finished_ids, set()
        out.free_encoder_mm_hashes = self.cache.get_freed_mm_hashes()
        self.freed_log += out.free_encoder_mm_hashes
        out.ec_connector_metadata = c.build_connector_meta(out)
        self.loads_log += [spec.mm_hash for spec in getattr(out.ec_connector_metadata, "loads", ())]
        return out, prefills

    def payload(self, out: Any, prefills: dict) -> bytes:
        encode, gather = [], []
        for rid, req in prefills.items():
            for i in out.scheduled_encoder_inputs.get(rid, ()):
                f = req.mm_features[i]
                encode.append((f.identifier, self._shape(f)))
            if not self.encode_only:
                gather += [(f.identifier, self._shape(f)) for f in req.mm_features]
        self.encoded_log += [h for h, _ in encode]
        step = {
            "meta": out.ec_connector_metadata,
            "free": out.free_encoder_mm_hashes,
            "finished": out.finished_req_ids,
            "encode": encode,
            "gather": gather,
        }
        return pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)

    def begin(self) -> tuple[Any, dict]:
        out, prefills = self.schedule()
        body = self.payload(out, prefills)
        for w in self.workers:
            w.send("begin", payload=body)
        for w in self.workers:
            w.result(120)
        return out, prefills

    def end(self, out: Any, prefills: dict) -> None:
        for w in self.workers:
            w.send("end")
        results = [pickle.loads(w.result(120)) for w in self.workers]
        try:
            from vllm.distributed.ec_transfer.ec_connector.utils import ECOutputAggregator
        except ImportError:  # vLLM < 0.30: rank 0's output, as its executor takes
            merged = results[0][0]
        else:
            merged = ECOutputAggregator().aggregate([r for r, _ in results], output_rank=0)
        gathered: dict[str, list[str]] = {}
        for _, g in results:
            for h, verdict in g.items():
                gathered.setdefault(h, []).append(verdict)
        self.update_from_output(out, prefills, gathered, merged)

    def step(self) -> None:
        out, prefills = self.begin()
        self.end(out, prefills)

    def update_from_output(self, out: Any, prefills: dict, gathered: dict, merged: Any) -> None:
        self.steps += 1
        c = self.connector
        for rid in list(self.running):
            run = self.running[rid]
            req = run.request
            if rid in prefills:
                run.gathered = {h: ",".join(v) for h, v in gathered.items() if h in {f.identifier for f in req.mm_features}}
                req.num_computed_tokens = req.num_tokens
                for i in sorted(self.cache.get_cached_input_ids(req)):
                    self.cache.free_encoder_input(req, i)
                    if hasattr(c, "update_state_after_free"):  # since vLLM 0.30
                        c.update_state_after_free(req, i)
                if self.encode_only:
                    del self.running[rid]
                    self._finish(req, "done", run.gathered)
                    continue
            else:
                run.decoded += 1
            if run.decoded + 1 >= req.max_tokens:
                del self.running[rid]
                self._finish(req, "done", run.gathered)
        if CALLS.hooks["take_unavailable_requests"]:
            for rid in c.take_unavailable_requests():
                self._end(rid, "error")
        ec_output = merged.ec_connector_output if merged is not None else None
        if ec_output is not None and CALLS.hooks["update_connector_output"]:
            c.update_connector_output(ec_output)
        if CALLS.hooks["get_ec_connector_stats"]:
            self._collect_stats(ec_output)

    def _collect_stats(self, ec_output: Any) -> None:
        """The workers' stats merged with the scheduler's, as vLLM's
        Scheduler.update_from_output and make_stats do."""
        from vllm.v1.metrics.stats import SchedulerStats
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        stats = ec_output.ec_connector_stats if ec_output is not None else None
        scheduler_stats = self.connector.get_ec_connector_stats()
        if scheduler_stats is not None and not scheduler_stats.is_empty():
            stats = stats.aggregate(scheduler_stats) if stats is not None else scheduler_stats
        if stats is not None:
            wire = MsgpackEncoder().encode(SchedulerStats(ec_connector_stats=stats.data))
            self.stats_log.append(MsgpackDecoder(SchedulerStats).decode(wire).ec_connector_stats)

    def _finish(self, req: Any, status: str, gathered: dict) -> None:
        _, params = self.connector.request_finished(req)
        self.cache.free(req)
        self._finished_ids.add(req.request_id)
        self.outcomes[req.request_id] = Outcome(status, params, gathered, self._waited.pop(req.request_id, 0))


def run_until(engines: list[Engine], done: Any, timeout: float, what: str) -> None:
    """Steps every engine that has work until done() holds; fails on timeout."""
    deadline = time.monotonic() + timeout
    while not done():
        busy = False
        for engine in engines:
            if engine.has_requests():
                engine.step()
                busy = True
        if not busy and done():
            return
        if time.monotonic() >= deadline:
            pytest.fail(f"{what}: not reached within {timeout:.0f}s")
        # An engine waiting for a push steps continuously in vLLM; a short
        # pause here only spares the two shared cores.
        time.sleep(0.002)
