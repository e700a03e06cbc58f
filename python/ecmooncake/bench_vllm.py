"""``python -m ecmooncake bench-vllm``: ECMooncakeConnector beside vLLM's
ECExampleConnector, through the same hook sequence.

Two spawned processes stand for the two vLLM instances, each holding a
scheduler-role and a worker-role connector as vLLM's single-process executor
does: the encoder (producer) and the PD instance (consumer). For every item
the encoder's scheduler announces the push and its worker runs
``start_save_caches`` before the "encoder" makes the tensor (as in vLLM,
where the encoder runs between those hooks); then the clock starts at
``save_caches``. The PD instance polls ``ensure_cache_available`` and
``has_cache_item`` the way its engine loop would, allocates, builds the
step's metadata, and the clock stops when ``start_load_caches`` has put the
tensor into the worker's encoder cache. Every loaded tensor is compared with
the encoder's, bit for bit, outside the timed span.

The example connector writes a safetensors file per item into a shared
directory (``/dev/shm`` by default, so no disk is involved) and loads it.
Ceilings measured in the same run: memcpy of one item, and Go's raw TCP
loopback throughput.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

KINDS = ("ECExampleConnector", "ECMooncakeConnector")
MiB = 1 << 20
_POLL_S = 0.0005


def tiny_model_config(directory: Path, hidden: int = 512) -> Path:
    """A Qwen2.5-VL-shaped ``config.json``: enough for vLLM's ``ModelConfig``
    (dtype, hidden size, multimodal) without weights or a tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "vocab_size": 65536,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
        "image_token_id": 60001,
        "video_token_id": 60002,
        "vision_start_token_id": 60003,
        "vision_end_token_id": 60004,
        "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
        "vision_config": {
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": hidden,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "in_chans": 3,
        },
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _vllm_config(
    kind: str, role: str, model_dir: Path, port: int, width: int, slab_bytes: int, shared_dir: str, transport: str
) -> Any:
    from vllm.config import DeviceConfig, ECTransferConfig, ModelConfig, VllmConfig

    if kind == "ECMooncakeConnector":
        extra: dict[str, Any] = {"log_level": "warn", "transport": transport}
    else:
        extra = {"shared_storage_path": shared_dir}
    ec = ECTransferConfig(
        ec_connector=kind,
        ec_role=role,
        ec_buffer_device="cpu",
        ec_buffer_size=slab_bytes,
        ec_ip="127.0.0.1",
        ec_port=port,
        ec_connector_extra_config=extra,
    )
    if role == "ec_producer":
        # vLLM's engine core measures this at startup on every producer.
        ec.mm_encoder_output_widths = {"image": width}
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16")
    return VllmConfig(model_config=model, ec_transfer_config=ec, device_config=DeviceConfig(device="cpu"))


def _identifier(kind: str, size: int, rep: int) -> str:
    return hashlib.sha256(f"{kind}/{size}/{rep}".encode()).hexdigest()


def _tensor(identifier: str, rows: int, width: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(int(identifier[:15], 16))
    return torch.randn((rows, width), generator=gen, dtype=torch.float32).to(torch.bfloat16)


def _request(request_id: str, identifier: str, rows: int, params: dict | None) -> Any:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    feature = MultiModalFeatureSpec(
        data=None, modality="image", identifier=identifier, mm_position=PlaceholderRange(offset=4, length=rows)
    )
    extra = {"ec_transfer_params": params} if params is not None else None
    return Request(request_id, list(range(rows + 8)), SamplingParams(max_tokens=1, extra_args=extra), None, mm_features=[feature])


class _Instance:
    """One vLLM instance's pair of connectors, driven hook by hook."""

    def __init__(self, config: Any):
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

        self.sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
        self.worker = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
        self.worker.start_worker_services()
        self.cache: dict[str, Any] = {}
        self.requests: dict[str, Any] = {}

    def step_worker(self, meta: Any, load: bool) -> None:
        """The model runner's hooks up to the forward; metadata crosses a
        pickle, as it crosses vLLM's message queue."""
        w = self.worker
        w.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
        if w.is_producer:
            w.start_save_caches(encoder_cache=self.cache)
        if load:
            w.start_load_caches(self.cache)

    def finish_worker(self) -> None:
        from vllm.v1.outputs import ECConnectorOutput

        w = self.worker
        output = ECConnectorOutput()
        output.finished_sending, output.finished_recving = w.get_finished(set())
        output.ec_connector_worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        self.sched.update_connector_output(output)

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


class _Host:
    """The child side: an encoder or PD instance for each connector kind."""

    def __init__(self, role: str, model_dir: str, port: int, width: int, slab_bytes: int, shared_dir: str, transport: str):
        self.role = role
        self.args = (Path(model_dir), port, width, slab_bytes, shared_dir, transport)
        self.instances: dict[str, _Instance] = {}
        self.width = width
        self.port = port
        if role == "ec_consumer":
            # The example connector loads onto current_platform.device_type,
            # which is empty on a host without an accelerator; its loads
            # here go to host memory, as ours do.
            from vllm.platforms import current_platform

            if not current_platform.device_type:
                current_platform.device_type = "cpu"

    def op_open(self, kind: str) -> None:
        from ecmooncake import plugin

        plugin.register()
        self.instances[kind] = _Instance(_vllm_config(kind, self.role, *self.args))

    def op_close(self, kind: str) -> None:
        self.instances.pop(kind).close()

    # encoder side

    def op_encode(self, kind: str, request_id: str, transfer_id: str, identifier: str, rows: int) -> None:
        from vllm.v1.core.sched.output import SchedulerOutput

        inst = self.instances[kind]
        params = {"consumer": f"127.0.0.1:{self.port}", "ec_items": [{"transfer_id": transfer_id}]}
        req = inst.requests[request_id] = _request(request_id, identifier, rows, params)
        inst.sched.ensure_cache_available(req, 0)
        inst.sched.has_cache_item(identifier)
        inst.sched.update_state_after_alloc(req, 0)
        meta = inst.sched.build_connector_meta(SchedulerOutput.make_empty())
        inst.step_worker(meta, load=False)
        inst.cache[identifier] = _tensor(identifier, rows, self.width)

    def op_save(self, kind: str, request_id: str, identifier: str) -> float:
        inst = self.instances[kind]
        started = time.monotonic()
        inst.worker.save_caches(encoder_cache=inst.cache, mm_hash=identifier)
        inst.finish_worker()
        inst.sched.request_finished(inst.requests.pop(request_id))
        return started

    def op_drain(self, kind: str, identifier: str, timeout_s: float) -> None:
        """Empty steps while pushes are pending, then forget the output."""
        from vllm.v1.core.sched.output import SchedulerOutput

        inst = self.instances[kind]
        deadline = time.monotonic() + timeout_s
        while inst.sched.has_pending_push_work() and time.monotonic() < deadline:
            inst.step_worker(inst.sched.build_connector_meta(SchedulerOutput.make_empty()), load=False)
            inst.finish_worker()
            time.sleep(0.001)
        inst.cache.pop(identifier, None)

    # PD side

    def op_expect(self, kind: str, request_id: str, transfer_id: str, identifier: str, rows: int) -> None:
        inst = self.instances[kind]
        params = {"ec_items": [{"mm_hash": identifier, "transfer_id": transfer_id}]}
        req = inst.requests[request_id] = _request(request_id, identifier, rows, params)
        inst.sched.ensure_cache_available(req, 0)

    def op_load(self, kind: str, request_id: str, identifier: str, rows: int, timeout_s: float) -> dict:
        import torch
        from vllm.v1.core.sched.output import SchedulerOutput

        inst = self.instances[kind]
        req = inst.requests.pop(request_id)
        s = inst.sched
        deadline = time.monotonic() + timeout_s
        while not (s.ensure_cache_available(req, 0) and s.has_cache_item(identifier)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{kind}: {identifier} did not become available within {timeout_s:.0f}s")
            time.sleep(_POLL_S)
        s.update_state_after_alloc(req, 0)
        inst.step_worker(s.build_connector_meta(SchedulerOutput.make_empty()), load=True)
        loaded = time.monotonic()
        inst.finish_worker()
        got = inst.cache.get(identifier)
        want = _tensor(identifier, rows, self.width)
        same = got is not None and got.dtype == want.dtype and got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16))
        # The request ends and the engine evicts the entry: the worker
        # releases its slab region, as between requests in vLLM.
        s.request_finished(req)
        inst.cache.pop(identifier, None)
        freed = SchedulerOutput.make_empty()
        freed.free_encoder_mm_hashes = [identifier]
        inst.step_worker(s.build_connector_meta(freed), load=True)
        inst.finish_worker()
        return {"loaded": loaded, "same": bool(same)}


def _serve(conn: Any, kwargs: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        host = _Host(**kwargs)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            break
        if op == "stop":
            for kind in list(host.instances):
                host.op_close(kind)
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(host, "op_" + op)(**args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class _Proc:
    def __init__(self, name: str, **kwargs: Any):
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, kwargs), name=name, daemon=True)
        self._proc.start()
        child.close()

    def result(self, timeout: float, op: str = "start") -> Any:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.05):
            if not self._proc.is_alive():
                raise RuntimeError(f"{self.name} died during {op} (exit {self._proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no answer to {op} within {timeout:.0f}s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name}: {op} failed:\n{value}")
        return value

    def call(self, op: str, timeout: float = 120, **args: Any) -> Any:
        self._conn.send((op, args))
        return self.result(timeout, op)

    def stop(self) -> None:
        if self._proc.is_alive():
            try:
                self.call("stop", 30)
            except (RuntimeError, OSError):
                pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


def _memcpy_ceiling(nbytes: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def _host_line() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or 'unknown CPU'}, {os.cpu_count()} cores"


def run(sizes_mb: list[float], reps: int, width: int, shared_root: str, quiet: bool, transport: str = "tcp") -> dict:
    from . import harness
    from .native import bench_tcp_loopback

    def say(message: str) -> None:
        if not quiet:
            print(message, file=sys.stderr, flush=True)

    work = Path(tempfile.mkdtemp(prefix="ecm-bench-vllm-", dir=shared_root))
    model_dir = tiny_model_config(work / "model")
    shared = work / "shared"
    shared.mkdir()
    sizes = [int(mb * MiB) // (2 * width) * 2 * width for mb in sizes_mb]
    slab = 2 * max(sizes) + 64 * MiB
    port = harness.free_port_range(1)
    common = dict(model_dir=str(model_dir), port=port, width=width, slab_bytes=slab, shared_dir=str(shared), transport=transport)
    say(f"bench-vllm: starting an encoder and a PD process (vLLM import takes a while) in {work}")
    procs = [_Proc("encoder", role="ec_producer", **common), _Proc("pd", role="ec_consumer", **common)]
    encoder, pd = procs
    results: dict[str, dict[int, list[float]]] = {kind: {} for kind in KINDS}
    try:
        for p in procs:
            p.result(300)
        for kind in KINDS:
            pd.call("open", kind=kind)
            encoder.call("open", kind=kind)
            for size in sizes:
                rows = size // (2 * width)
                for rep in range(-1, reps):  # rep -1 warms up: connections, first pages
                    ident = _identifier(kind, size, rep)
                    rid, tid = f"r-{ident[:12]}", f"t-{ident[:12]}"
                    pd.call("expect", kind=kind, request_id=rid, transfer_id=tid, identifier=ident, rows=rows)
                    encoder.call("encode", kind=kind, request_id=rid, transfer_id=tid, identifier=ident, rows=rows)
                    started = encoder.call("save", kind=kind, request_id=rid, identifier=ident)
                    got = pd.call("load", kind=kind, request_id=rid, identifier=ident, rows=rows, timeout_s=60)
                    encoder.call("drain", kind=kind, identifier=ident, timeout_s=60)
                    shutil.rmtree(shared / ident, ignore_errors=True)
                    if not got["same"]:
                        raise RuntimeError(f"{kind}: the loaded tensor of {size} bytes differs from the encoder's")
                    if rep >= 0:
                        results[kind].setdefault(size, []).append(got["loaded"] - started)
                say(f"  {kind:20s} {size / MiB:6.0f} MiB  median {statistics.median(results[kind][size]) * 1e3:8.2f} ms")
            encoder.call("close", kind=kind)
            pd.call("close", kind=kind)
    finally:
        for p in procs:
            p.stop()
        shutil.rmtree(work, ignore_errors=True)
    say("bench-vllm: measuring ceilings")
    rows_out = []
    for size in sizes:
        example = statistics.median(results["ECExampleConnector"][size])
        ours = statistics.median(results["ECMooncakeConnector"][size])
        tcp = bench_tcp_loopback(max(size, 64 * MiB), 1)
        rows_out.append(
            {
                "bytes": size,
                "example_ms": example * 1e3,
                "ecmooncake_ms": ours * 1e3,
                "ecmooncake_min_ms": min(results["ECMooncakeConnector"][size]) * 1e3,
                "example_min_ms": min(results["ECExampleConnector"][size]) * 1e3,
                "speedup": example / ours,
                "ecmooncake_gbps": size / ours / 1e9,
                "tcp_ceiling_gbps": tcp / 1e9,
                "memcpy_gbps": _memcpy_ceiling(size) / 1e9,
            }
        )
    return {"host": _host_line(), "reps": reps, "width": width, "shared_dir": shared_root, "transport": transport, "sizes": rows_out}


def _print(summary: dict) -> None:
    print(f"save_caches -> tensor in the PD worker's encoder cache, median of {summary['reps']} "
          f"(bf16 items, width {summary['width']}; ECMooncake over {summary['transport']}; "
          f"example connector on {summary['shared_dir']})")
    print(f"host: {summary['host']}")
    print(f"{'item':>8} {'ECExample':>11} {'ECMooncake':>11} {'speedup':>8} {'GB/s':>6} {'TCP ceiling':>12} {'of ceiling':>11} {'memcpy':>8}")
    for row in summary["sizes"]:
        print(
            f"{row['bytes'] / MiB:6.0f}MiB {row['example_ms']:9.2f}ms {row['ecmooncake_ms']:9.2f}ms "
            f"{row['speedup']:7.1f}x {row['ecmooncake_gbps']:6.2f} {row['tcp_ceiling_gbps']:9.2f}GB/s "
            f"{row['ecmooncake_gbps'] / row['tcp_ceiling_gbps']:10.0%} {row['memcpy_gbps']:6.1f}GB/s"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 32, 128], help="item sizes, MiB (default %(default)s)")
    parser.add_argument("--reps", type=int, default=5, help="timed items per size and connector (default %(default)s)")
    parser.add_argument("--width", type=int, default=4096, help="encoder output width; rows follow from the size (default %(default)s)")
    parser.add_argument("--dir", default="/dev/shm", help="where the example connector's shared directory lives (default %(default)s)")
    parser.add_argument(
        "--transport", choices=("tcp", "shm"), default="tcp",
        help="ECMooncakeConnector's data plane between the two processes (default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def main(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"bench-vllm needs vLLM and torch in this environment: {exc}", file=sys.stderr)
        return 2
    summary = run(args.sizes_mb, args.reps, args.width, args.dir, args.quiet, args.transport)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print(summary)
    return 0
