"""The connector with CUDA tensors on a host where vLLM cannot be installed:
its scheduler roles in this process and its worker roles where vLLM runs
them (the encoder in a spawned process; the PD's model runner in this
process at TP 1, as vLLM's uni executor runs it in its engine core, and in
a spawned process per rank at TP > 1), driven through the hooks in the
order vLLM's scheduler and model runner call them (see
tests/python/vllm_engine.py, which does the same with vLLM's own objects).

Only what vLLM itself would provide is a stand-in here: the base class the
connector subclasses, the config objects, requests, the scheduler output
and the measured encoder output width. Everything of the connector and the
library is the real thing. tests/python/test_connector_gpu.py and the
connector benchmark (``python -m ecmooncake.tools.connector_gpu``, run by
``bash build/gpu_run.sh run``) use it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import statistics
import sys
import time
import types
import zlib
from dataclasses import dataclass, field
from typing import Any

from .. import trace
from ..connector.hooks import _Connector
from ..connector.metadata import _WorkerReport
from ..connector.names import OPTIONAL_HOOKS
from .worker import InProcess, Worker

MiB = 1 << 20


# --- stand-ins for vLLM ------------------------------------------------------


class _Role:
    def __init__(self, name: str):
        self.name = name


class _StandInBase:
    """What vLLM's ECConnectorBase gives the connector: the bound metadata."""

    def __init__(self, vllm_config: Any, role: Any):
        self._vllm_config = vllm_config
        self._role = role
        self._connector_metadata = None

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None


def connector(vllm_config: Any, role: str) -> Any:
    """The connector class vLLM would build (every optional hook present),
    on the stand-in base."""
    cls = type("ECMooncakeConnector", (_Connector, _StandInBase), {"_hooks": dict.fromkeys(OPTIONAL_HOOKS, True)})
    return cls(vllm_config, _Role(role))


def vllm_config(role: str, *, port: int, device: str = "cuda", tp_size: int = 1, rank: int = 0, buffer_size: int = 1 << 30, extra: dict | None = None) -> Any:
    ec = types.SimpleNamespace(
        is_ec_producer=role == "ec_producer",
        is_ec_consumer=role == "ec_consumer",
        ec_ip="127.0.0.1",
        ec_port=port,
        ec_buffer_size=buffer_size,
        ec_buffer_device=device,
        ec_connector_extra_config=dict(extra or {}),
    )
    pc = types.SimpleNamespace(tensor_parallel_size=tp_size, pipeline_parallel_size=1, data_parallel_size=1, rank=rank, data_parallel_rank=0)
    model = types.SimpleNamespace(dtype="bfloat16")
    return types.SimpleNamespace(ec_transfer_config=ec, parallel_config=pc, model_config=model)


@dataclass
class _Position:
    offset: int
    length: int

    def get_num_embeds(self) -> int:
        return self.length


@dataclass
class _Feature:
    identifier: str
    modality: str
    mm_position: _Position


@dataclass
class Request:
    """The parts of vLLM's Request the connector reads."""

    request_id: str
    mm_features: list
    ec_transfer_params: dict | None
    num_computed_tokens: int = 0

    def get_num_encoder_embeds(self, index: int) -> int:
        return self.mm_features[index].mm_position.length


@dataclass(frozen=True)
class Item:
    """One image (or video) of a chat request, with its encoder output
    shape; its identifier is a sha256 as vLLM's mm_hash is. The vLLM
    engine tests (tests/python/vllm_engine.py) use it too."""

    name: str
    num_embeds: int
    width: int
    modality: str = "image"

    @property
    def identifier(self) -> str:
        return hashlib.sha256(self.name.encode()).hexdigest()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_embeds, self.width)

    @property
    def nbytes(self) -> int:
        return self.num_embeds * self.width * 2


def make_request(request_id: str, items: list[Item], params: dict | None) -> Request:
    features, offset = [], 4
    for it in items:
        features.append(_Feature(it.identifier, it.modality, _Position(offset, it.num_embeds)))
        offset += it.num_embeds + 4
    return Request(request_id, features, params)


def scheduler_output(freed: list[str] | None = None) -> Any:
    return types.SimpleNamespace(free_encoder_mm_hashes=list(freed or ()), scheduled_encoder_inputs={}, finished_req_ids=set())


def expected(identifier: str, shape: tuple[int, int], device: Any) -> Any:
    """The stand-in encoder's output: deterministic bf16 from the identifier,
    the same on every device (made by integer arithmetic on the GPU)."""
    import torch

    seed = zlib.crc32(identifier.encode())
    n = shape[0] * shape[1]
    x = torch.arange(n, device=device, dtype=torch.int64)
    bits = ((x * 2654435761 + seed) ^ (x >> 7)) & 0x7FFF
    # Clear the exponent's top bit: finite values only, never NaN, so that
    # a bitwise comparison is a comparison of values too.
    bits = bits & 0x3FFF
    return bits.to(torch.int16).view(torch.bfloat16).view(shape)


def bit_equal(got: Any, want: Any) -> bool:
    import torch

    return got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape) and bool(torch.equal(got.contiguous().view(torch.int16), want.view(torch.int16)))


# --- worker processes --------------------------------------------------------


class EncoderHost:
    """The encoder's model runner: one worker-role connector on a GPU."""

    def __init__(self, config: bytes, device: str, trace: int = 0):
        import torch

        from ..native import trace_enable

        if trace:
            trace_enable(trace)
        self.torch = torch
        torch.cuda.set_device(torch.device(device))
        self.device = torch.device(device)
        self.connector = connector(pickle.loads(config), "WORKER")
        self.connector.start_worker_services()
        self.cache: dict[str, Any] = {}

    def ready(self) -> dict:
        return {"device": str(self.device)}

    def op_step(self, meta: bytes, encode: list, finished: list, free: list, sleep_cycles: int = 0) -> dict:
        """One model step: bind, start_save_caches, the encoder (each output
        written on the current stream, behind a long kernel when
        sleep_cycles is set), save_caches per output, the end-of-step hooks.
        Returns the worker report and, per output, whether its stream was
        still running when save_caches returned."""
        torch, c = self.torch, self.connector
        for h in free:
            self.cache.pop(h, None)
        m = pickle.loads(meta)
        c.bind_connector_metadata(m)
        c.start_save_caches(encoder_cache=self.cache)
        sources = {h: expected(h, tuple(shape), self.device) for h, shape in encode}
        # Without a long kernel the outputs exist before the clock starts,
        # so that the time measured is the connector's alone.
        outs = {} if sleep_cycles else {h: t.clone() for h, t in sources.items()}
        if encode:
            torch.cuda.synchronize(self.device)
        stream = torch.cuda.current_stream(self.device)
        busy: dict[str, bool] = {}
        t0 = time.monotonic()
        for h, _ in encode:
            out = outs.pop(h, None)
            if out is None:
                out = torch.zeros_like(sources[h])
                # The encoder's last kernel still runs when save_caches
                # returns: the library must read `out` only after it.
                torch.cuda._sleep(int(sleep_cycles))
                out.copy_(sources[h])
            self.cache[h] = out
            c.save_caches(encoder_cache=self.cache, mm_hash=h)
            busy[h] = not stream.query()
        saved = time.monotonic()
        sources.clear()
        c.get_finished(set(finished))
        report = c.build_connector_worker_meta()
        c.clear_connector_metadata()
        return {"report": pickle.dumps(report), "busy": busy, "t0": t0, "saved": saved}

    def op_stats(self) -> dict:
        return self.connector.native_stats()

    def op_trace(self) -> dict:
        """This process's ready-path stamps since the last call (ecmooncake.trace)."""
        from ..native import trace_drain

        return trace_drain()

    def close(self) -> None:
        self.connector.shutdown()


class PDHost:
    """One PD TP rank's model runner: a worker-role connector whose slab
    lives on this rank's GPU (vLLM sets the current device per rank)."""

    def __init__(self, config: bytes, device: str, rank: int, trace: int = 0):
        import torch

        from ..native import trace_enable

        if trace:
            trace_enable(trace)
        self.torch = torch
        torch.cuda.set_device(torch.device(device))
        self.device = torch.device(device)
        cfg = pickle.loads(config)
        cfg.parallel_config.rank = rank
        self.connector = connector(cfg, "WORKER")
        self.connector.start_worker_services()
        self.cache: dict[str, Any] = {}

    def ready(self) -> dict:
        return {"device": str(self.device)}

    def op_step(self, meta: Any, gather: list, free: list, check: bool = True) -> dict:
        torch, c = self.torch, self.connector
        for h in free:
            self.cache.pop(h, None)
        # Pickled to a rank's process; the object itself in the scheduler's.
        m = pickle.loads(meta) if isinstance(meta, bytes) else meta
        c.bind_connector_metadata(m)
        c.start_load_caches(self.cache)
        loaded = time.monotonic()
        verdicts: dict[str, str] = {}
        where: dict[str, str] = {}
        views: dict[str, bool] = {}
        slab = self.connector._consumer_worker._slab
        lo = slab.data_ptr()
        hi = lo + slab.numel() * slab.element_size()
        for h, shape in gather:
            got = self.cache.get(h)
            if got is None:
                verdicts[h] = "missing"
                continue
            where[h] = str(got.device)
            # A view of the slab, not a copy of it (a pinned host slab's
            # loads are copies on the GPU: False there).
            views[h] = got.device == slab.device and lo <= got.data_ptr() < hi
            if check:
                verdicts[h] = "ok" if bit_equal(got, expected(h, tuple(shape), got.device)) else "differs"
            else:
                verdicts[h] = "ok"
        c.get_finished(set())
        report = c.build_connector_worker_meta()
        c.clear_connector_metadata()
        return {"report": pickle.dumps(report), "verdicts": verdicts, "where": where, "views": views, "loaded": loaded}

    def op_device_copy(self, nbytes: int, batch: int, reps: int) -> float:
        """Median seconds of torch's device-to-device copy of a batch."""
        torch = self.torch
        src = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(batch)]
        dst = [torch.empty_like(s) for s in src]
        times = []
        for _ in range(reps + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for d, s in zip(dst, src):
                d.copy_(s)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times[2:])

    def op_slab(self) -> dict:
        w = self.connector._consumer_worker
        return {"memory": w.slab_memory, "device": str(w._slab.device)}

    def op_stats(self) -> dict:
        return self.connector.native_stats()

    def op_trace(self) -> dict:
        """This process's ready-path stamps since the last call (ecmooncake.trace)."""
        from ..native import trace_drain

        return trace_drain()

    def close(self) -> None:
        self.connector.shutdown()


# --- the deployment ----------------------------------------------------------


@dataclass
class Deployment:
    """An encoder and a PD instance of tp_size ranks; the scheduler roles
    here, and at TP 1 the PD's one rank too (an InProcess)."""

    port: int
    encoder: Worker
    ranks: list[Worker | InProcess]
    enc_sched: Any
    pd_sched: Any
    width: int
    held: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def start(cls, *, port: int, tp_size: int = 1, encoder_device: str = "cuda:0", pd_devices: list[str] | None = None, extra: dict | None = None, pd_extra: dict | None = None, enc_extra: dict | None = None, buffer_size: int = 1 << 30, width: int = 2048, trace: int = 0) -> "Deployment":
        base = {"push_wait_timeout_s": 60, "log_level": "info", **(extra or {})}
        pd_cfg = vllm_config("ec_consumer", port=port, tp_size=tp_size, buffer_size=buffer_size, extra={**base, **(pd_extra or {})})
        enc_cfg = vllm_config("ec_producer", port=port, extra={**base, **(enc_extra or {})})
        pd_devices = pd_devices or [f"cuda:{r}" for r in range(tp_size)]
        encoder = Worker(EncoderHost, "encoder", timeout=120, config=pickle.dumps(enc_cfg), device=encoder_device, trace=trace)
        if trace:
            # The scheduler roles run here: the PD scheduler's hops.
            from ..native import trace_enable

            trace_enable(trace)
        # As vLLM lays out the PD's engine core: at TP 1 its model runner
        # in the scheduler's process (the uni executor), a step's metadata
        # handed over by reference; at TP > 1 a process per rank.
        host = InProcess if tp_size == 1 else Worker
        try:
            ranks = [host(PDHost, f"pd-rank{r}", timeout=120, config=pickle.dumps(pd_cfg), device=pd_devices[r], rank=r, trace=trace) for r in range(tp_size)]
        except BaseException:
            encoder.kill()
            raise
        try:
            for w in [*ranks, encoder]:
                w.wait_ready(180)
            pd_sched = connector(pd_cfg, "SCHEDULER")
            enc_sched = connector(enc_cfg, "SCHEDULER")
        except BaseException:
            for w in [*ranks, encoder]:
                w.kill()
            raise
        # What vLLM's engine core measures at startup on an encoder
        # (get_encoder_output_width), which needs the model.
        enc_sched._producer_sched._widths["image"] = width
        return cls(port, encoder, ranks, enc_sched, pd_sched, width)

    def close(self) -> None:
        for c in (self.enc_sched, self.pd_sched):
            try:
                c.shutdown()
            except Exception:
                pass
        for w in [self.encoder, *self.ranks]:
            try:
                w.stop(20)
            except Exception:
                w.kill()

    def encode(self, tag: str, items: list[Item], sleep_cycles: int = 0, wait_s: float = 120.0, on_sent: Any = None) -> dict:
        """One encoder request through the encoder's hooks, then steps while
        it has push work (as vLLM's engine does); returns the first step's
        answer and the params request_finished gave the proxy."""
        s = self.enc_sched
        tids = [f"{tag}-t{i}" for i in range(len(items))]
        req = make_request(f"enc-{tag}", items, {"consumer": f"127.0.0.1:{self.port}", "ec_items": [{"transfer_id": t} for t in tids]})
        assert s.ensure_cache_available(req, 0)
        for i in range(len(items)):
            assert not s.has_cache_item(items[i].identifier)
            s.update_state_after_alloc(req, i)
        meta = pickle.dumps(s.build_connector_meta(scheduler_output()))
        self.encoder.send("step", meta=meta, encode=[(it.identifier, it.shape) for it in items], finished=[], free=[], sleep_cycles=sleep_cycles)
        if on_sent is not None:
            on_sent()
        first = self.encoder.result(120)
        self._enc_output(first)
        _, params = s.request_finished(req)
        # The request finished in its step, and vLLM's scheduler evicts its
        # entries from the encoder cache in a later one.
        finished, freed = [req.request_id], [it.identifier for it in items]
        deadline = time.monotonic() + wait_s
        while s.has_pending_push_work() or freed:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tag}: pushes still pending after {wait_s:.0f}s")
            meta = pickle.dumps(s.build_connector_meta(scheduler_output(freed)))
            out = self.encoder.call("step", meta=meta, encode=[], finished=finished, free=freed)
            finished, freed = [], []
            self._enc_output(out)
            time.sleep(0.001)
        failed = s.take_unavailable_requests()
        return {**first, "params": params, "failed": failed}

    def trace(self) -> list:
        """Every process's stamps since the last call: the encoder's, each
        rank's and this one's (the scheduler roles)."""
        from ..native import trace_drain

        rings = [w.call("trace", 30) for w in (self.encoder, *self.ranks)] + [trace_drain()]
        return [s for r in rings for s in r["stamps"]]

    def _enc_output(self, out: dict) -> None:
        report = pickle.loads(out["report"])
        if report is not None:
            self.enc_sched.update_connector_output(types.SimpleNamespace(ec_connector_worker_meta=report))

    def wait_available(self, tag: str, items: list[Item], timeout: float = 120.0) -> Request:
        tids = [f"{tag}-t{i}" for i in range(len(items))]
        req = make_request(f"pd-{tag}", items, {"ec_items": [{"mm_hash": it.identifier, "transfer_id": t} for it, t in zip(items, tids)]})
        deadline = time.monotonic() + timeout
        # As vLLM's engine loop while a request waits: passes without pause,
        # each ended by build_connector_meta (its metadata, with nothing to
        # load, goes nowhere here), so each reads the arrived events anew.
        while not self.pd_sched.ensure_cache_available(req, 0):
            if req.request_id in self.pd_sched.take_unavailable_requests():
                raise RuntimeError(f"{tag}: the PD failed the request")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tag}: items not available within {timeout:.0f}s")
            self.pd_sched.build_connector_meta(scheduler_output())
        return req

    def load(self, req: Request, items: list[Item], check: bool = True) -> list[dict]:
        """The PD step that gathers the request's items on every rank."""
        s = self.pd_sched
        for i, it in enumerate(items):
            assert s.has_cache_item(it.identifier), f"{it.identifier}: the scheduler does not have it"
            s.update_state_after_alloc(req, i)
        meta = _for_ranks(self.ranks, s.build_connector_meta(scheduler_output()))
        for w, m in zip(self.ranks, meta):
            w.send("step", meta=m, gather=[(it.identifier, it.shape) for it in items], free=[], check=check)
        results = [w.result(120) for w in self.ranks]
        self._pd_output(results)
        self.held[req.request_id] = [it.identifier for it in items]
        return results

    def free(self, req: Request) -> None:
        """vLLM finishing the request and evicting its entries."""
        s = self.pd_sched
        s.request_finished(req)
        hashes = self.held.pop(req.request_id, [])
        meta = _for_ranks(self.ranks, s.build_connector_meta(scheduler_output(hashes)))
        for w, m in zip(self.ranks, meta):
            w.send("step", meta=m, gather=[], free=hashes)
        self._pd_output([w.result(120) for w in self.ranks])

    def _pd_output(self, results: list[dict]) -> None:
        reports = [pickle.loads(r["report"]) for r in results]
        reports = [r for r in reports if isinstance(r, _WorkerReport)]
        if not reports:
            return
        merged = reports[0]
        for r in reports[1:]:
            merged = merged.aggregate(r)
        self.pd_sched.update_connector_output(types.SimpleNamespace(ec_connector_worker_meta=merged))


def _for_ranks(ranks: list[Any], meta: Any) -> list[Any]:
    """A step's metadata as each rank takes it: the object for a rank in
    this process, its pickle (once) for the others."""
    pickled = None
    out = []
    for w in ranks:
        if isinstance(w, InProcess):
            out.append(meta)
        else:
            pickled = pickled if pickled is not None else pickle.dumps(meta)
            out.append(pickled)
    return out


def planes(rank: Worker, transport: str = "tcp") -> dict[str, int]:
    """What each data plane carried into a PD rank's shard: frames for TCP,
    producers attached for cuda_ipc (one-sided: its writes never pass
    through the receiver)."""
    stats = rank.call("stats").get("consumer") or {}
    split = stats.get("data_planes")
    if not split:
        # A shard that serves one plane reports it under "data" alone (the
        # split is only there when it serves several). This harness runs
        # every PD on the default transport, tcp.
        return {transport: (stats.get("data") or {}).get("Frames", 0)}
    return {k: v.get("Frames", 0) or v.get("Attached", 0) for k, v in split.items()}


# A PD "on another host" for the staged TCP path: its shard reports this
# identity, so the encoder on this host does not pick cuda_ipc for it.
ELSEWHERE = {"host": "pd-elsewhere"}


# --- the benchmark -----------------------------------------------------------


# Each path: its name, the settings of both sides, the PD's own. "pinned
# host" is the path the connector took before GPU slabs: a pinned host slab
# on the PD, filled over TCP and copied to the GPU at load; measured as the
# "before" beside the GPU paths. "mooncake" is GPU to GPU through the
# engine: the PD's GPU slab registered with it, the encoder's outputs
# leaving from its GPU staging, mooncake_protocol tcp; it needs a CUDA build
# of Mooncake's engine, so only a run that names it measures it.
PATHS = (
    ("cuda_ipc", {}, {}),
    ("staged tcp", {}, ELSEWHERE),
    ("pinned host", {}, {"buffer_memory": "pinned_host"}),
    ("mooncake", {"transport": "mooncake", "mooncake_protocol": "tcp"}, {"buffer_memory": "device"}),
)


def select_paths(name: str) -> list[tuple[str, dict, dict]]:
    """The paths --paths names: one by name, or "all" but mooncake."""
    return [p for p in PATHS if name == p[0] or name == "all" and p[0] != "mooncake"]


# Stamps per ring (ecmooncake.trace): one size and batch's reps, about a
# dozen hops per item, with room to spare.
TRACE_CAPACITY = 1 << 16


def bench(args: argparse.Namespace) -> dict:
    """From save_caches to the tensor in the PD's encoder_cache, per item,
    for each size and batch, against torch's device copy of the same bytes."""
    from .harness import free_port_range

    rows = []
    for path, common, pd_extra in select_paths(args.paths):
        dep = Deployment.start(
            port=free_port_range(1),
            buffer_size=args.slab_mib * MiB,
            width=2048,
            extra={"log_level": "warn", "max_resident_bytes": 1 << 20, **common},
            pd_extra=pd_extra,
            trace=TRACE_CAPACITY,
        )
        try:
            for mib in args.sizes:
                for batch in args.batches:
                    num_embeds = mib * MiB // (2048 * 2)
                    times = []
                    timed: list[str] = []
                    for rep in range(args.warmup + args.reps):
                        tag = f"{path.replace(' ', '')}-{mib}m-b{batch}-r{rep}"
                        items = [Item(f"{tag}-i{i}", num_embeds, 2048) for i in range(batch)]
                        if rep == args.warmup:
                            dep.trace()  # the warm-up's stamps are not the timed items'
                        pd: dict[str, Any] = {}

                        def load_while_encoding(tag=tag, items=items, rep=rep, pd=pd):
                            # The PD loads as soon as the items arrive, while
                            # the encoder's step is still answering.
                            pd["req"] = dep.wait_available(tag, items)
                            pd["results"] = dep.load(pd["req"], items, check=rep == 0)

                        sent = dep.encode(tag, items, on_sent=load_while_encoding)
                        if sent["failed"]:
                            raise RuntimeError(f"{tag}: pushes failed: {sent['failed']}")
                        req, results = pd["req"], pd["results"]
                        bad = {h: v for r in results for h, v in r["verdicts"].items() if v != "ok"}
                        if bad:
                            raise RuntimeError(f"{tag}: items not intact: {bad}")
                        copies = [h for r in results for h, v in r["views"].items() if not v]
                        if path == "mooncake" and copies:
                            raise RuntimeError(f"{tag}: loads are not views of the PD's GPU slab: {copies}")
                        if rep >= args.warmup:
                            times.append(max(r["loaded"] for r in results) - sent["t0"])
                            timed += [it.identifier for it in items]
                        dep.free(req)
                    copy = dep.ranks[0].call("device_copy", nbytes=mib * MiB, batch=batch, reps=args.reps)
                    median = statistics.median(times)
                    row = {"path": path, "mib": mib, "batch": batch, "batch_s": median, "per_item_s": median / batch, "device_copy_s": copy, "ratio": copy / median}
                    row["planes"] = planes(dep.ranks[0], "mooncake" if path == "mooncake" else "tcp")
                    row["slab"] = dep.ranks[0].call("slab")
                    if path == "mooncake" and not str(row["slab"].get("device", "")).startswith("cuda"):
                        raise RuntimeError(f"mooncake: the PD's slab is {row['slab']}, not GPU memory")
                    row["trace"] = trace.table(dep.trace(), timed)
                    rows.append(row)
                    print(f"{path:<11} {mib:>4} MiB x {batch}: {median * 1e3:8.2f} ms per batch, {median / batch * 1e3:8.2f} ms per item; device copy {copy * 1e3:7.3f} ms; {row['ratio']:.3f} of it", flush=True)
                    print(f"  per-hop trace of {row['trace']['items']} items, us (the device copy of the batch: {copy * 1e6:.1f} us, same run)", flush=True)
                    print("\n".join(trace.format_table(row["trace"], indent="    ")), flush=True)
        finally:
            dep.close()
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ecmooncake.tools.connector_gpu", description=bench.__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 32, 128], help="MiB per item")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--slab-mib", type=int, default=3072)
    p.add_argument("--paths", default="all", choices=["all", *(p[0] for p in PATHS)],
                   help="all: every path but mooncake, which needs a CUDA build of Mooncake's engine")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    print("ecmooncake connector GPU bench: save_caches -> tensor in the PD's encoder_cache, median of", args.reps, flush=True)
    out = bench(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
