"""``python -m ecmooncake bench-vllm``: ecmooncake's ECMooncakeConnector beside
peers, through the same hook sequence.

Peers: vLLM's ECExampleConnector (``example``: a safetensors file per item
in a shared directory, ``/dev/shm`` by default, so no disk is involved) and
vLLM's own in-tree ECMooncakeConnector (``mooncake``: Mooncake's
TransferEngine with ``mooncake_protocol: tcp``; ecmooncake's plugin takes
that connector name, so the class is loaded by its module path). The
in-tree peer needs ``bash build/setup_bench_peers.sh``; with it, the whole
benchmark runs inside a network namespace it creates (``lo`` and a veth
pair, no route out), since the engine advertises the first address that is
not loopback, and the summary lists the TCP endpoints ``ss`` saw there.

Two spawned processes stand for the two vLLM instances, each holding a
scheduler-role and a worker-role connector as vLLM's single-process executor
does: the encoder (producer) and the PD instance (consumer). For each batch
the encoder's scheduler announces the pushes and its worker runs
``start_save_caches`` before the "encoder" makes the tensors (as in vLLM,
where the encoder runs between those hooks); then the clock starts at the
first ``save_caches``. The PD instance steps the way its engine loop would:
each step asks ``ensure_cache_available`` and ``has_cache_item`` for every
waiting request, allocates those that are ready, builds the step's metadata
and runs the worker's hooks; an item's time stops when the step that put it
into the worker's encoder cache ends. Meanwhile the encoder keeps stepping
while it has pushes pending. Every loaded tensor is compared with the
encoder's, bit for bit, outside the timed span.

Ceilings (``ceiling``), each sampled before and after the connectors run,
the higher kept: the TCP data plane alone (its own writer and receiver,
no reservations) between two processes with the connector's GOMAXPROCS
over its ``tcp_conns`` connections (for the TCP planes), and a
PyTorch copy of one item with the measured copy's threads (one for the
example connector's file write and read; GOMAXPROCS for the shm plane).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from . import ceiling as ceilings
from .harness import free_port_range, percentile
from .report import GB, MiB, add_ceiling_arguments, add_output_arguments, ceiling_settings, plot_ready, report, summary_text
from .worker import Worker

_POLL_S = 0.0005
# ecmooncake is always measured; the others are peers beside it.
OURS = "ecmooncake"
PEERS = ("example", "mooncake")
LABELS = {
    OURS: "ecmooncake ECMooncakeConnector",
    "example": "vLLM ECExampleConnector",
    "mooncake": "vLLM in-tree ECMooncakeConnector (Mooncake TE, tcp)",
}
_CONNECTOR_NAMES = {OURS: "ECMooncakeConnector", "example": "ECExampleConnector", "mooncake": "ECMooncakeConnector"}
_IN_TREE_MODULE = "vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector"
# The namespace the benchmark creates for the in-tree peer: a veth pair
# whose two ends both stay inside it, and no route out.
NETNS_ENV = "ECMOONCAKE_BENCH_NETNS"
NETNS_ADDR = "10.213.0.1"
_NETNS_SETUP = (
    "set -e; ip link set lo up; ip link add ecmb0 type veth peer name ecmb1; "
    f"ip addr add {NETNS_ADDR}/30 dev ecmb0; ip addr add 10.213.0.2/30 dev ecmb1; "
    'ip link set ecmb0 up; ip link set ecmb1 up; exec "$@"'
)


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


def _vllm_config(kind: str, role: str, model_dir: Path, port: int, width: int, slab_bytes: int, shared_dir: str,
                 transport: str, gomaxprocs: int, tcp_conns: int, ip: str) -> Any:
    from vllm.config import DeviceConfig, ECTransferConfig, ModelConfig, VllmConfig

    if kind == OURS:
        extra: dict[str, Any] = {"log_level": "warn", "transport": transport, "gomaxprocs": gomaxprocs, "tcp_conns": tcp_conns}
    elif kind == "mooncake":
        extra = {"mooncake_protocol": "tcp"}
    else:
        extra = {"shared_storage_path": shared_dir}
    ec = ECTransferConfig(
        ec_connector=_CONNECTOR_NAMES[kind],
        ec_role=role,
        ec_buffer_device="cpu",
        ec_buffer_size=slab_bytes,
        ec_ip=ip,
        ec_port=port,
        ec_connector_extra_config=extra,
    )
    if role == "ec_producer":
        # vLLM's engine core measures this at startup on every producer.
        ec.mm_encoder_output_widths = {"image": width}
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16")
    return VllmConfig(model_config=model, ec_transfer_config=ec, device_config=DeviceConfig(device="cpu"))


def _identifier(kind: str, size: int, batch: int, rep: int, index: int) -> str:
    return hashlib.sha256(f"{kind}/{size}/{batch}/{rep}/{index}".encode()).hexdigest()


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

    def __init__(self, config: Any, kind: str):
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

        if kind == "mooncake":
            # By module path: the factory's name is ecmooncake's once its
            # plugin is registered.
            cls = importlib.import_module(_IN_TREE_MODULE).ECMooncakeConnector
            self.sched = cls(config, ECConnectorRole.SCHEDULER)
            self.worker = cls(config, ECConnectorRole.WORKER)
        else:
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

    def step(self, scheduler_output: Any = None, load: bool = False) -> None:
        from vllm.v1.core.sched.output import SchedulerOutput

        self.step_worker(self.sched.build_connector_meta(scheduler_output or SchedulerOutput.make_empty()), load)
        self.finish_worker()

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


class _Host:
    """The child side: an encoder or PD instance for each connector kind."""

    def __init__(self, role: str, model_dir: str, ports: dict, width: int, slab_bytes: int, shared_dir: str,
                 transport: str, gomaxprocs: int, tcp_conns: int, ip: str):
        self.role = role
        self.ports = ports
        self.args = dict(model_dir=Path(model_dir), width=width, slab_bytes=slab_bytes, shared_dir=shared_dir,
                         transport=transport, gomaxprocs=gomaxprocs, tcp_conns=tcp_conns, ip=ip)
        self.ip = ip
        self.instances: dict[str, _Instance] = {}
        self.width = width
        if role == "ec_consumer":
            # The example connector loads onto current_platform.device_type,
            # which is empty on a host without an accelerator; its loads
            # here go to host memory, as ours do.
            from vllm.platforms import current_platform

            if not current_platform.device_type:
                current_platform.device_type = "cpu"

    def ready(self) -> None:
        return None

    def close(self) -> None:
        for kind in list(self.instances):
            self.op_close(kind)

    def op_open(self, kind: str) -> None:
        from ecmooncake import plugin

        plugin.register()
        config = _vllm_config(kind, self.role, port=self.ports[kind], **self.args)
        self.instances[kind] = _Instance(config, kind)

    def op_close(self, kind: str) -> None:
        self.instances.pop(kind).close()

    # encoder side

    def op_encode(self, kind: str, items: list[dict]) -> None:
        """One scheduler step that schedules every item's request, one
        worker step before the encoder, then the encoder's outputs."""
        from vllm.v1.core.sched.output import SchedulerOutput

        inst = self.instances[kind]
        for it in items:
            params = {"consumer_zmq": f"tcp://{self.ip}:{self.ports[kind]}", "ec_items": [{"transfer_id": it["transfer_id"]}]}
            req = inst.requests[it["request_id"]] = _request(it["request_id"], it["identifier"], it["rows"], params)
            inst.sched.ensure_cache_available(req, 0)
            inst.sched.has_cache_item(it["identifier"])
            inst.sched.update_state_after_alloc(req, 0)
        inst.step_worker(inst.sched.build_connector_meta(SchedulerOutput.make_empty()), load=False)
        for it in items:
            inst.cache[it["identifier"]] = _tensor(it["identifier"], it["rows"], self.width)

    def op_save(self, kind: str, items: list[dict]) -> float:
        inst = self.instances[kind]
        started = time.monotonic()
        for it in items:
            inst.worker.save_caches(encoder_cache=inst.cache, mm_hash=it["identifier"])
        inst.finish_worker()
        for it in items:
            inst.sched.request_finished(inst.requests.pop(it["request_id"]))
        return started

    def op_drain(self, kind: str, identifiers: list[str], timeout_s: float) -> None:
        """Empty steps while pushes are pending, then forget the outputs."""
        inst = self.instances[kind]
        deadline = time.monotonic() + timeout_s
        while inst.sched.has_pending_push_work() and time.monotonic() < deadline:
            inst.step()
            time.sleep(0.001)
        for ident in identifiers:
            inst.cache.pop(ident, None)

    # PD side

    def op_expect(self, kind: str, items: list[dict]) -> None:
        inst = self.instances[kind]
        for it in items:
            params = {"ec_items": [{"mm_hash": it["identifier"], "transfer_id": it["transfer_id"]}]}
            req = inst.requests[it["request_id"]] = _request(it["request_id"], it["identifier"], it["rows"], params)
            inst.sched.ensure_cache_available(req, 0)

    def op_load(self, kind: str, items: list[dict], timeout_s: float) -> dict:
        """Engine steps until every item is in the encoder cache; returns
        when each got there and whether its bits are the encoder's."""
        import torch
        from vllm.v1.core.sched.output import SchedulerOutput

        inst = self.instances[kind]
        s = inst.sched
        waiting = {it["identifier"]: inst.requests.pop(it["request_id"]) for it in items}
        done: dict[str, Any] = {}
        loaded: dict[str, float] = {}
        deadline = time.monotonic() + timeout_s
        while waiting:
            ready = [i for i, req in waiting.items() if s.ensure_cache_available(req, 0) and s.has_cache_item(i)]
            for ident in ready:
                s.update_state_after_alloc(waiting[ident], 0)
            inst.step(load=True)
            now = time.monotonic()
            for ident in ready:
                loaded[ident] = now
                done[ident] = waiting.pop(ident)
            if waiting and not ready:
                if now > deadline:
                    raise TimeoutError(f"{kind}: {len(waiting)} of {len(items)} items not available within {timeout_s:.0f}s")
                time.sleep(_POLL_S)
        same: dict[str, bool] = {}
        for it in items:
            ident = it["identifier"]
            got = inst.cache.get(ident)
            want = _tensor(ident, it["rows"], self.width)
            same[ident] = bool(
                got is not None and got.dtype == want.dtype and got.shape == want.shape
                and torch.equal(got.view(torch.int16), want.view(torch.int16))
            )
        # The requests end and the engine evicts the entries: the worker
        # releases their slab regions, as between requests in vLLM.
        freed = SchedulerOutput.make_empty()
        freed.free_encoder_mm_hashes = list(done)
        for ident, req in done.items():
            s.request_finished(req)
            inst.cache.pop(ident, None)
        inst.step(freed, load=True)
        return {"loaded": loaded, "same": same}


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


class _SocketWatch:
    """Lists the TCP endpoints seen by ``ss`` while the benchmark runs, to
    show where its bytes went. Only inside the benchmark's own namespace:
    on the host, ``ss`` lists every other process's sockets too."""

    def __init__(self, every_s: float = 0.2):
        self.endpoints: set[str] = set()
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def __enter__(self) -> "_SocketWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["ss", "-Htn"], capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError) as exc:
                self.error = str(exc)
                return
            for line in out.splitlines():
                fields = line.split()
                if len(fields) >= 5:
                    for endpoint in fields[3:5]:
                        self.endpoints.add(endpoint.rsplit(":", 1)[0].strip("[]"))
            self._stop.wait(every_s)


def _cell(kind: str, size: int, batch: int, spans: list[float], latencies: list[float], exact: bool) -> dict:
    total = sum(spans)
    items = len(latencies)
    return {
        "connector": kind,
        "bytes": size,
        "batch": batch,
        "items": items,
        "gb_per_s": items * size / total / GB if total > 0 else 0.0,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "bit_exact": exact,
    }


def _ceiling_for(kind: str, transport: str) -> str:
    """Which ceiling a connector's figure is divided by."""
    if kind == "example":
        return "copy_1"
    if kind == OURS and transport == "shm":
        return "copy_gomaxprocs"
    return "tcp"


def run(
    sizes_mb: list[float],
    reps: int,
    width: int,
    shared_root: str,
    quiet: bool,
    transport: str = "tcp",
    peers: tuple[str, ...] = ("example",),
    batches: tuple[int, ...] = (1,),
    gomaxprocs: int = 2,
    tcp_conns: int = 4,
    ceiling_bytes: int = 1 << 30,
) -> dict:
    def say(message: str) -> None:
        if not quiet:
            print(message, file=sys.stderr, flush=True)

    kinds = [k for k in PEERS if k in peers] + [OURS]
    ip = "127.0.0.1"
    work = Path(tempfile.mkdtemp(prefix="ecm-bench-vllm-", dir=shared_root))
    model_dir = tiny_model_config(work / "model")
    shared = work / "shared"
    shared.mkdir()
    sizes = [int(mb * MiB) // (2 * width) * 2 * width for mb in sizes_mb]
    slab = 2 * max(sizes) * max(batches) + 64 * MiB
    base = free_port_range(len(kinds))
    ports = {k: base + i for i, k in enumerate(kinds)}
    common = dict(model_dir=str(model_dir), ports=ports, width=width, slab_bytes=slab, shared_dir=str(shared),
                  transport=transport, gomaxprocs=gomaxprocs, tcp_conns=tcp_conns, ip=ip)
    tcp = ceilings.TCPCeiling(gomaxprocs, tcp_conns, receivers=1, nbytes=ceiling_bytes)
    copy_books = {
        n: ceilings.Ceiling("PyTorch host copy", {"bytes": n}, primary=gomaxprocs,
                            phrases=[f"one {ceilings.size_text(n)} item"], variant_unit="threads")
        for n in sizes
    }

    def measure_ceilings(when: str) -> None:
        say(f"bench-vllm: measuring ceilings ({when})")
        tcp.measure(when)
        for n, book in copy_books.items():
            for threads in sorted({1, gomaxprocs}):
                book.add(threads, when, ceilings.torch_copy_ceiling(n, threads))

    cells: list[dict] = []
    netns = os.environ.get(NETNS_ENV, "")
    watch = _SocketWatch() if netns else contextlib.nullcontext()
    measure_ceilings(ceilings.BEFORE)
    say(f"bench-vllm: starting an encoder and a PD process (vLLM import takes a while) in {work}")
    procs = [Worker(_Host, "encoder", timeout=120, role="ec_producer", **common), Worker(_Host, "pd", timeout=120, role="ec_consumer", **common)]
    encoder, pd = procs
    try:
        with watch:
            for p in procs:
                p.result(300)
            for kind in kinds:
                pd.call("open", kind=kind)
                encoder.call("open", kind=kind)
                for size in sizes:
                    rows = size // (2 * width)
                    for batch in batches:
                        spans, latencies, exact = [], [], True
                        for rep in range(-1, reps):  # rep -1 warms up: connections, first pages
                            items = []
                            for i in range(batch):
                                ident = _identifier(kind, size, batch, rep, i)
                                items.append({"request_id": f"r-{ident[:12]}", "transfer_id": f"t-{ident[:12]}",
                                              "identifier": ident, "rows": rows})
                            timeout = 60 + batch * size / (20 * MiB)
                            pd.call("expect", kind=kind, items=items)
                            encoder.call("encode", kind=kind, items=items)
                            started = encoder.call("save", timeout=timeout, kind=kind, items=items)
                            encoder.send("drain", kind=kind, identifiers=[it["identifier"] for it in items], timeout_s=timeout)
                            pd.send("load", kind=kind, items=items, timeout_s=timeout)
                            got = pd.result(timeout + 60)
                            encoder.result(timeout + 60)
                            shutil.rmtree(shared, ignore_errors=True)
                            shared.mkdir(exist_ok=True)
                            if rep < 0:
                                continue
                            exact = exact and all(got["same"].values())
                            done = [got["loaded"][it["identifier"]] - started for it in items]
                            latencies += done
                            spans.append(max(done))
                        cells.append(_cell(kind, size, batch, spans, latencies, exact))
                        c = cells[-1]
                        say(f"  {kind:10s} {size / MiB:6.0f} MiB x {batch}: {c['gb_per_s']:6.2f} GB/s, "
                            f"p50 {c['p50_ms']:8.2f} ms, p99 {c['p99_ms']:8.2f} ms, bit-exact {c['bit_exact']}")
                encoder.call("close", kind=kind)
                pd.call("close", kind=kind)
    finally:
        for p in procs:
            p.stop(30)
        shutil.rmtree(work, ignore_errors=True)
    measure_ceilings(ceilings.AFTER)

    caps = {"tcp": lambda n: tcp.book.value(), "copy_1": lambda n: copy_books[n].value(1),
            "copy_gomaxprocs": lambda n: copy_books[n].value(gomaxprocs)}
    ratios: dict[str, float] = {}
    by_key = {(c["connector"], c["bytes"], c["batch"]): c for c in cells}
    for c in cells:
        which = _ceiling_for(c["connector"], transport)
        cap = caps[which](c["bytes"])
        c["ceiling"] = which
        c["ceiling_gb_per_s"] = cap / GB
        c["ceiling_ratio"] = c["gb_per_s"] * GB / cap if cap else 0.0
        ratios[f"{c['connector']} {c['bytes'] // MiB} MiB x {c['batch']}"] = c["ceiling_ratio"]
        ours = by_key[(OURS, c["bytes"], c["batch"])]
        if c["connector"] != OURS:
            # Above 1: ecmooncake moves more per second / waits less.
            c["ours_throughput_ratio"] = ours["gb_per_s"] / c["gb_per_s"] if c["gb_per_s"] else 0.0
            c["ours_p50_speedup"] = c["p50_ms"] / ours["p50_ms"] if ours["p50_ms"] else 0.0
    summary = {
        "ok": all(c["bit_exact"] for c in cells),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": _host_line(),
        "load_average": os.getloadavg(),
        "reps": reps,
        "width": width,
        "shared_dir": shared_root,
        "transport": transport,
        "gomaxprocs": gomaxprocs,
        "tcp_conns": tcp_conns,
        "connectors": {k: LABELS[k] for k in kinds},
        "network": f"namespace made by the benchmark (lo, veth {netns}/30)" if netns else "host loopback",
        "tcp_endpoints_seen": sorted(watch.endpoints) if netns else None,
        "ceilings": {
            "tcp": tcp.book.as_dict(),
            "copy": {f"{n // MiB} MiB": b.as_dict() for n, b in copy_books.items()},
        },
        "cells": cells,
    }
    return ceilings.mark(summary, ratios)


def format_summary(summary: dict) -> str:
    s = summary
    lines = [
        f"bench-vllm {s['date']}: save_caches -> tensor in the PD worker's encoder cache "
        f"(bf16 items, width {s['width']}; {s['reps']} timed batches per cell after one warm-up)",
        f"  host: {s['host']}, load average {s['load_average'][0]:.1f}; network: {s['network']}"
        + (f"; TCP endpoints seen there: {', '.join(s['tcp_endpoints_seen']) or 'none'}" if s["tcp_endpoints_seen"] is not None else ""),
        f"  ecmooncake: {s['transport']}, GOMAXPROCS {s['gomaxprocs']}, tcp_conns {s['tcp_conns']}; "
        f"example connector on {s['shared_dir']}",
        f"  TCP ceiling:  {s['ceilings']['tcp']['text']}",
    ]
    for name, c in s["ceilings"]["copy"].items():
        lines.append(f"  copy ceiling: {c['text']}")
    lines.append(
        f"  {'connector':<11}{'item':>8}{'batch':>6}{'GB/s':>8}{'p50 ms':>10}{'p99 ms':>10}{'exact':>6}"
        f" {'ceiling':>15}{'GB/s':>7}{'of it':>7}{'ours/this':>10}{'p50 x':>7}"
    )
    for c in s["cells"]:
        vs = f"{c['ours_throughput_ratio']:>10.2f}{c['ours_p50_speedup']:>7.2f}" if "ours_throughput_ratio" in c else ""
        lines.append(
            f"  {c['connector']:<11}{c['bytes'] / MiB:>5.0f}MiB{c['batch']:>6}{c['gb_per_s']:>8.2f}{c['p50_ms']:>10.2f}"
            f"{c['p99_ms']:>10.2f}{'yes' if c['bit_exact'] else 'NO':>6}"
            f" {c['ceiling']:>15}{c['ceiling_gb_per_s']:>7.2f}{c['ceiling_ratio']:>7.2f}{vs}"
        )
    lines.append("  (ours/this: ecmooncake's GB/s over this connector's; p50 x: this connector's p50 over ecmooncake's;")
    lines.append("   ceilings: tcp = the TCP ceiling above, copy_1 / copy_gomaxprocs = the copy of one item on 1 / GOMAXPROCS threads)")
    return summary_text(s, lines, result_at=9, failed="FAILED: a loaded tensor differs from the encoder's")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 32, 128], help="item sizes, MiB (default %(default)s)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="items per batch (default %(default)s)")
    parser.add_argument("--reps", type=int, default=5, help="timed batches per size, batch and connector (default %(default)s)")
    parser.add_argument("--width", type=int, default=4096, help="encoder output width; rows follow from the size (default %(default)s)")
    parser.add_argument("--dir", default="/dev/shm", help="where the example connector's shared directory lives (default %(default)s)")
    parser.add_argument(
        "--peers", default="example",
        help="comma-separated peers measured beside ecmooncake: example, mooncake (default %(default)s); "
        "mooncake needs build/setup_bench_peers.sh and runs everything in a network namespace",
    )
    parser.add_argument(
        "--transport", choices=("tcp", "shm"), default="tcp",
        help="ECMooncakeConnector's data plane between the two processes (default %(default)s)",
    )
    add_ceiling_arguments(
        parser,
        gomaxprocs_help="ecmooncake's GOMAXPROCS, the TCP ceiling's too",
        conns_help="ecmooncake's connections, the TCP ceiling's too",
        ceiling_help="MiB per TCP ceiling sample",
    )
    parser.add_argument("--no-netns", action="store_true", help="run the mooncake peer on the host's loopback (its engine may then advertise another address)")
    add_output_arguments(parser, plot=True)


def _in_namespace(argv: list[str]) -> int:
    """Runs this command again inside a new network namespace."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        print("bench-vllm: the mooncake peer runs in a network namespace: needs unshare and ip (util-linux, iproute2)",
              file=sys.stderr)
        return 2
    env = {**os.environ, NETNS_ENV: NETNS_ADDR, "VLLM_HOST_IP": NETNS_ADDR}
    cmd = ["unshare", "--net", "--", "sh", "-c", _NETNS_SETUP, "sh", sys.executable, "-m", "ecmooncake", "bench-vllm", *argv]
    return subprocess.run(cmd, env=env).returncode


def main(args: argparse.Namespace) -> int:
    # Before anything that imports vLLM: a refusal is one line, at once.
    if args.plot and not plot_ready("bench-vllm"):
        return 2
    peers = tuple(p for p in args.peers.split(",") if p)
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        print(f"bench-vllm: unknown peer {', '.join(unknown)}; known: {', '.join(PEERS)}", file=sys.stderr)
        return 2
    try:
        import torch  # noqa: F401
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"bench-vllm needs vLLM and torch in this environment: {exc}", file=sys.stderr)
        return 2
    if "mooncake" in peers:
        try:
            from mooncake.engine import TransferEngine  # noqa: F401
        except ImportError as exc:
            print(f"bench-vllm: the mooncake peer needs mooncake.engine ({exc}); run bash build/setup_bench_peers.sh "
                  "and use the python of the environment it made", file=sys.stderr)
            return 2
        if not args.no_netns and not os.environ.get(NETNS_ENV):
            return _in_namespace(args.argv)
    return report(
        "bench-vllm",
        lambda: run(args.sizes_mb, args.reps, args.width, args.dir, args.quiet, args.transport, peers,
                    tuple(args.batches), **ceiling_settings(args)),
        format_summary,
        args.json,
        plot_path=args.plot,
    )
