"""``python -m ecmooncake bench-serve``: an EPD fleet on one host under vLLM's
own client, ``vllm bench serve --dataset-name random-mm``.

The fleet is started once: as many encoders and PD instances as the largest
topology asks (two encoders when a fault kills one), plus the baselines
``--baselines`` names, all vLLM instances starting together. Every phase
then runs against it by starting a proxy of its own over the instances the
phase uses (a proxy starts in about a second; a vLLM instance takes minutes
on a loaded CPU), so no phase restarts vLLM:

- ``single``: one plain ``vllm serve`` instance, no proxy (a baseline);
- ``example 1E1P``: an encoder and a PD instance of their own with vLLM's
  ECExampleConnector (a shared directory), behind a proxy (a baseline);
- ``ecmooncake NEmP`` for each ``--topologies`` entry: the fleet's first N
  encoders and first M PD instances, ECMooncakeConnector, behind a proxy
  that spreads items over the encoders and requests over the PD instances;
- ``--fault idle-pause``: 1E1P; a burst of requests, a pause longer than
  vLLM's 5 s keep-alive timeout, a second burst; no item may fall back;
- ``--fault proxy-stop``: 1E1P; the proxy is sent SIGTERM while requests
  are in flight; each must answer or fail with an HTTP error, none may
  hang, and the proxy must exit;
- ``--fault kill-encoder``: 2E1P; once a third of the prompts' items were
  encoded, the second encoder's process group is stopped (SIGSTOP, so that
  what the proxy has in flight to it stays put), the proxy's in-flight count
  to it is read (``touched``), and the group is SIGKILLed; the time until
  the proxy marks it unhealthy is measured. A touched item is encoded again
  by the other encoder or falls back to the PD's own encoder, so
  ``fallback`` is at most ``touched``; the CI test (tests/python/e2e) splits
  the two exactly. It runs last: the fleet has one encoder fewer after it.
- ``--reuse FRACTION``: two 1E2P phases of repeated images, the proxy
  routing and reusing by affinity, then with affinity off; with
  ``--store-host IP``, a third: affinity and ``--store-reuse``, a repeated
  image whose holder is too busy going to the other PD from Mooncake Store.
  The tool then starts the wheel's ``mooncake_master`` on IP and every
  instance of the fleet with ``store`` on (the encoder lends the pool, the
  PDs only read), so the affinity phases run on the same fleet and the
  encoder puts in each; ``store`` counts the items the proxy sent from the
  Store, ``fetched`` the PDs' fetches pushed into their own shards, and
  ``local`` the items the PDs encoded themselves. Mooncake listens on every
  interface: give an address of a network namespace the tool runs in
  (docs/operations.md shows one), never the machine's.

Instances keep what they saw between phases (vLLM's encoder cache, the PD
shard's resident items), so every client run gets a seed of its own and
sends images no earlier run sent: each phase really moves its bytes.

Each run prints vLLM's client figures beside the fleet's own: items through
the encoders and fallbacks (the proxy's /metrics), bytes the PD shards took
in and the PD schedulers' wait for pushed items (the PD instances'
ecmooncake metrics), each a difference of scrapes taken around the run.
Every phase's expected outcome is checked (see ``check``), and after each
phase no PD shard may hold a write, cancel or expiry still pending (loaded
items stay resident by design). Elapsed time is printed per phase and in
all.

This process runs no server itself: the servers and the client run from
``--python`` (a vLLM environment), so the tool itself needs only the standard
library (and matplotlib for ``--plot``).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import fleet

IMAGE_LIMIT = json.dumps({"image": 1, "video": 0})
BASELINES = ("single", "example")
FAULTS = ("idle-pause", "proxy-stop", "kill-encoder")
# The PD's lease, short so that a killed encoder's grants end within the
# run, and longer than its push wait so that no live item expires.
LEASE_S = 60
PUSH_WAIT_S = 50
# vLLM closes an idle keep-alive connection after 5 s.
IDLE_PAUSE_S = 7.0
# What mooncake_master logs once its RPC and metadata servers listen.
MASTER_READY = "HTTP metadata server started successfully"


@dataclass(frozen=True)
class Phase:
    """One table: a baseline, a topology or a fault, over some of the
    fleet's instances (indices into its encoders and PD instances)."""

    name: str
    kind: str  # single, example, ecm
    encoders: tuple[int, ...] = ()
    pds: tuple[int, ...] = ()
    fault: str = ""
    # "on" / "off": a repeated-image load (--reuse), with the proxy routing
    # and reusing by affinity or with affinity off; "store": affinity and
    # the proxy's --store-reuse (--store-host).
    reuse: str = ""


@dataclass(frozen=True)
class Plan:
    encoders: int
    pds: int
    baselines: tuple[str, ...]
    phases: tuple[Phase, ...]


@dataclass
class Row:
    setup: str
    rate: str
    completed: int = 0
    failed: int = 0
    req_per_s: float | None = 0.0
    ttft_p50_ms: float | None = 0.0
    ttft_p99_ms: float | None = 0.0
    itl_mean_ms: float | None = 0.0
    e2el_p50_ms: float | None = 0.0
    e2el_p99_ms: float | None = 0.0
    encoded: int | None = None
    reused: int | None = None
    store: int | None = None  # items the proxy sent as coming from Mooncake Store
    fetched: int | None = None  # Store fetches the PDs pushed into their own shards
    local: int | None = None  # items the PDs encoded themselves
    fallback: int | None = None
    encode_s: float | None = None  # time requests spent in the proxy's encode phase, all together
    bytes_moved: int | None = None
    wait_mean_ms: float | None = None
    touched: int | None = None
    unrouted_s: float | None = None  # kill-encoder: SIGKILL to the proxy's marking it unhealthy
    rejected: int | None = None
    hung: int | None = None  # proxy-stop: requests with no answer and no error by the deadline
    dropped: int | None = None  # proxy-stop: connections closed with no HTTP answer
    proxy_exit_s: float | None = None  # proxy-stop: SIGTERM to the proxy's exit
    errors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--python", default=os.environ.get("ECMOONCAKE_VLLM_PYTHON", sys.executable),
                   help="interpreter of a vLLM environment that runs the servers and the client (default: $ECMOONCAKE_VLLM_PYTHON or this one)")
    p.add_argument("--model", default="", help="model to serve (default: a tiny random Qwen2-VL built here, served on the CPU)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every vllm serve (repeat), e.g. --vllm-arg=--gpu-memory-utilization=0.2")
    p.add_argument("--topologies", default="1E1P,2E1P,1E2P", help="ecmooncake fleets, NEmP each (default %(default)s)")
    p.add_argument("--baselines", default="single,example",
                   help="single, example, both or none: instances started beside the fleet (default %(default)s)")
    p.add_argument("--fault", action="append", default=[], choices=list(FAULTS), help="add a fault scenario (repeatable)")
    p.add_argument("--rates", default="2,inf", help="request rates per second, inf for all at once (default %(default)s)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=32, help="random text tokens per prompt (default %(default)s)")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--image-size", type=int, default=224, help="square images of this side (default %(default)s)")
    p.add_argument("--transport", default="tcp", choices=["tcp", "shm"])
    p.add_argument("--reuse", type=float, default=0.0, metavar="FRACTION",
                   help="add two 1E2P phases of repeated images (this fraction of requests repeats an earlier "
                   "image, e.g. 0.8): the proxy routing and reusing by affinity, and with affinity off")
    p.add_argument("--store-host", default="", metavar="IP",
                   help="with --reuse, a third phase: affinity and the proxy's --store-reuse, with a mooncake_master "
                   "(of --python's Mooncake wheel) started on IP and Mooncake Store on in every instance; IP must be "
                   "an address of a network namespace this runs in (Mooncake listens on every interface)")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds for the fleet's servers to be ready (default %(default)s)")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds for one client run (default %(default)s)")
    p.add_argument("--workdir", default="", help="logs, results and the tiny model (default: a new temporary directory)")
    p.add_argument("--json", default="", metavar="FILE", help="also write every row as JSON")
    p.add_argument("--plot", default="", metavar="FILE.png", help="draw TTFT and E2E latency per setup (needs matplotlib)")


def _topology(text: str) -> tuple[int, int]:
    e, _, rest = text.partition("E")
    if not rest.endswith("P") or not e.isdigit() or not rest[:-1].isdigit() or int(e) < 1 or int(rest[:-1]) < 1:
        raise ValueError(f"--topologies: {text!r} is not NEmP (e.g. 2E1P)")
    return int(e), int(rest[:-1])


def plan(args: argparse.Namespace) -> Plan:
    """The fleet to start and the phases to run on it, in order: baselines,
    topologies, then the faults, the one that kills an encoder last."""
    base = {b.strip() for b in args.baselines.split(",") if b.strip() and b.strip() != "none"}
    if "both" in base:
        base = (base - {"both"}) | set(BASELINES)
    unknown = base - set(BASELINES)
    if unknown:
        raise ValueError(f"--baselines: unknown {sorted(unknown)}")
    phases: list[Phase] = []
    if "single" in base:
        phases.append(Phase("single", "single"))
    if "example" in base:
        phases.append(Phase("example 1E1P", "example"))
    n_enc, n_pd = 0, 0
    for topo in dict.fromkeys(t.strip().upper() for t in args.topologies.split(",") if t.strip()):
        e, m = _topology(topo)
        phases.append(Phase(f"ecmooncake {topo}", "ecm", tuple(range(e)), tuple(range(m))))
        n_enc, n_pd = max(n_enc, e), max(n_pd, m)
    if getattr(args, "reuse", 0.0):
        if not 0 < args.reuse < 1:
            raise ValueError(f"--reuse: {args.reuse} is not a fraction in (0, 1)")
        for on in ("on", "off"):
            phases.append(Phase(f"reuse 1E2P affinity {on}", "ecm", (0,), (0, 1), reuse=on))
        if getattr(args, "store_host", ""):
            phases.append(Phase("reuse 1E2P affinity on + store", "ecm", (0,), (0, 1), reuse="store"))
        n_enc, n_pd = max(n_enc, 1), max(n_pd, 2)
    elif getattr(args, "store_host", ""):
        raise ValueError("--store-host: only with --reuse (the Store phase is a repeated-image load)")
    faults = list(dict.fromkeys(args.fault))
    for f in sorted(faults, key=FAULTS.index):
        e = 2 if f == "kill-encoder" else 1
        phases.append(Phase(f"ecmooncake {e}E1P {f}", "ecm", tuple(range(e)), (0,), fault=f))
        n_enc, n_pd = max(n_enc, e), max(n_pd, 1)
    if not phases:
        raise ValueError("nothing to run: no baseline, topology or fault")
    return Plan(n_enc, n_pd, tuple(b for b in BASELINES if b in base), tuple(phases))


def rates(text: str) -> list[str]:
    out = []
    for r in text.split(","):
        r = r.strip()
        if r != "inf" and not (float(r) > 0):
            raise ValueError(f"--rates: {r!r} is neither a positive number nor inf")
        out.append(r)
    return out


def phase_rates(phase: Phase, rate_list: list[str]) -> list[str]:
    """A fault happens once: a second rate would find it done already. The
    idle-pause and proxy-stop faults drive their own requests, so no rate."""
    if phase.fault in ("idle-pause", "proxy-stop"):
        return ["-"]
    return rate_list[:1] if phase.fault else rate_list


def check(phase: Phase, row: Row, num_prompts: int) -> list[str]:
    """What went wrong with one run, as sentences; [] when the phase's
    expected outcome held."""
    out: list[str] = []
    total = row.completed + row.failed
    if phase.fault == "proxy-stop":
        if row.hung:
            out.append(f"{row.hung} requests hung past the deadline after the proxy's SIGTERM")
        if row.dropped:
            out.append(f"{row.dropped} requests lost their connection with no HTTP answer")
        if row.proxy_exit_s is None:
            out.append("the proxy did not exit after SIGTERM")
        return out
    if total != num_prompts:
        out.append(f"{total} requests ended of {num_prompts} sent")
    if row.failed:
        out.append(f"{row.failed} requests failed")
    if phase.kind == "single":
        return out
    reused, store = row.reused or 0, row.store or 0
    if phase.reuse == "off" and reused:
        out.append(f"{reused} items reused with affinity off")
    if phase.reuse != "store" and store:
        out.append(f"{store} items sent from the Store without --store-reuse")
    if phase.reuse == "store" and row.local:
        # Every fetch is from a live master, within its deadline: a local
        # encode here is a fetch that failed.
        out.append(f"{row.local} items encoded by the PDs themselves (a Store fetch that failed)")
    if row.encoded is not None and row.fallback is not None and row.encoded + row.fallback + reused + store != num_prompts:
        from_store = f", {store} from the Store" if row.store is not None else ""
        out.append(f"{row.encoded} items encoded, {reused} reused{from_store} and {row.fallback} fallen back, of {num_prompts} sent")
    if phase.fault == "kill-encoder":
        if row.touched is None or row.fallback is None or row.fallback > row.touched:
            out.append(f"{row.fallback} fallbacks, more than the {row.touched} items the kill touched")
        if row.unrouted_s is None:
            out.append("the proxy still routed to the killed encoder")
    elif row.fallback:
        out.append(f"{row.fallback} items fell back to the PD's own encoder")
    if phase.kind == "ecm":
        if row.rejected:
            out.append(f"the PD shards rejected {row.rejected} writes")
        if row.bytes_moved is not None and row.encoded and row.bytes_moved <= 0:
            out.append(f"{row.encoded} items encoded but no byte reached the PD shards")
    return out


def _free_ports(count: int) -> int:
    from .harness import free_port_range

    return free_port_range(count)


def _png(seed: int, side: int) -> str:
    """A data URL of a PNG of random-looking pixels (stdlib only)."""
    raw = bytearray()
    state = seed or 1
    for _ in range(side):
        raw.append(0)
        for _ in range(side * 3):
            state = (state * 1103515245 + 12345) & 0x7FFFFFFF
            raw.append(state >> 23)
    def chunk(tag: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + tag + data + zlib.crc32(tag + data).to_bytes(4, "big")
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", side.to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0]))
    png += chunk(b"IDAT", zlib.compress(bytes(raw))) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


@dataclass
class Answer:
    """One chat request's end: answered (HTTP 200 with text), refused (an
    HTTP error status with its message), dropped (the connection ended with
    no HTTP answer) or hung (nothing by the deadline)."""

    outcome: str
    detail: str = ""


def chat(url: str, model: str, image: str, max_tokens: int, timeout_s: float) -> Answer:
    body = {
        "model": model, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is in this image?"}]}],
    }
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            text = json.loads(resp.read())["choices"][0]["message"]["content"]
            return Answer("answered", text)
    except urllib.error.HTTPError as exc:
        return Answer("refused", f"{exc.code}: {exc.read()[:200].decode(errors='replace')}")
    except (TimeoutError, socket.timeout) as exc:
        return Answer("hung", str(exc))
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            return Answer("hung", str(reason))
        return Answer("dropped", f"{type(exc).__name__}: {reason}")


def burst(url: str, model: str, seeds: list[int], side: int, max_tokens: int, timeout_s: float) -> list[Answer]:
    """One request per seed, all at once; each image is new."""
    images = [_png(s, side) for s in seeds]
    out: list[Answer | None] = [None] * len(seeds)

    def one(i: int) -> None:
        out[i] = chat(url, model, images[i], max_tokens, timeout_s)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(seeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    return [a if a is not None else Answer("hung", "no answer") for a in out]


def _warm_up(url: str, model: str, side: int, seed: int, timeout_s: float) -> None:
    """The first request of an instance is slow (CPU kernels being built) and
    would otherwise be in the first run's figures."""
    a = chat(url, model, _png(seed, side), 2, timeout_s)
    if a.outcome != "answered":
        raise fleet.ServerError(f"warm-up through {url}: {a.outcome} {a.detail}")


class Fleet:
    """The plan's vLLM instances, started once, and a proxy per phase."""

    def __init__(self, p: Plan, args: argparse.Namespace, model: str, log_dir: Path):
        self.plan, self.args, self.model, self.log_dir = p, args, model, log_dir
        self.d = fleet.Deployment(log_dir / "fleet", args.start_timeout)
        self.encoders: list[fleet.Server] = []
        self.encoder_urls: list[str] = []
        self.pds: list[tuple[str, str]] = []  # (URL, consumer control endpoint)
        self.pd_metrics: list[list[str]] = []
        self.single_url = ""
        self.example_encoder = ""
        self.example_pd: tuple[str, str] = ("", "")
        self.client: Client | None = None
        self.store_host: str = getattr(args, "store_host", "")

    def _vllm(self, port: int, ec: dict | None) -> list[str]:
        return fleet.vllm_argv(self.args.python, self.model, port, ec=ec) + self.args.vllm_arg

    def _store(self, base: int) -> tuple[dict, dict]:
        """Starts the wheel's mooncake_master on --store-host (ports base and
        base + 1) and returns the encoder's and the PDs' store settings."""
        probe = "from ecmooncake import store; print(store.master_binary() or ''); print(store.cudart_dir() or '')"
        done = subprocess.run([self.args.python, "-c", probe], capture_output=True, text=True, timeout=120, env=fleet.vllm_env())
        lines = done.stdout.splitlines()
        if done.returncode != 0 or len(lines) < 2 or not lines[-2]:
            raise fleet.ServerError(f"no mooncake_master in {self.args.python}'s Mooncake wheel: {done.stderr[-2000:]}")
        binary, cudart = lines[-2], lines[-1]
        ip, env = self.store_host, fleet.vllm_env()
        if cudart:
            # The wheel before 0.3.13 links libcudart.so.12 even without CUDA.
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [cudart, env.get("LD_LIBRARY_PATH")]))
        self.d.start("mooncake-master", [
            binary, f"--rpc_address={ip}", f"--rpc_port={base}", "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={ip}", f"--http_metadata_server_port={base + 1}",
            f"--metrics_port={base + 2}", "--enable_metric_reporting=false"], ready=MASTER_READY, env=env)
        common = {"enabled": True, "master_address": f"{ip}:{base}", "metadata_address": f"http://{ip}:{base + 1}/metadata",
                  "local_hostname": ip}
        # The encoder lends the Store its pool; the PDs only read.
        return ({**common, "segment_bytes": 512 << 20, "put_inflight_bytes": 64 << 20, "get_staging_bytes": 16 << 20},
                {**common, "segment_bytes": 0, "put_inflight_bytes": 4 << 20, "get_staging_bytes": 64 << 20})

    def start(self) -> None:
        p, env = self.plan, fleet.vllm_env()
        base = _free_ports(4 * p.pds + p.encoders + 6)
        enc_store, pd_store = self._store(base + 4 * p.pds + p.encoders + 3) if self.store_host else ({}, {})
        for j in range(p.pds):
            http, ec_port, metrics_port = base + 4 * j, base + 4 * j + 1, base + 4 * j + 2
            ec = fleet.ecm_config("ec_consumer", "127.0.0.1", ec_port, {
                "transport": self.args.transport, "metrics_port": metrics_port,
                "push_wait_timeout_s": PUSH_WAIT_S, "lease_s": LEASE_S, **({"store": pd_store} if pd_store else {})})
            # The engine core serves the series at metrics_port, its worker
            # at the next port, where they are two processes.
            self.pd_metrics.append([f"http://127.0.0.1:{metrics_port}/metrics", f"http://127.0.0.1:{metrics_port + 1}/metrics"])
            self.d.start(f"pd{j}", self._vllm(http, ec), ready=fleet.VLLM_READY, env=env)
            self.pds.append((f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{ec_port}"))
        for i in range(p.encoders):
            port = base + 4 * p.pds + i
            # The consumer to push to comes with each request from the proxy.
            ec = fleet.ecm_config("ec_producer", "127.0.0.1", base + 1, {
                "transport": self.args.transport, **({"store": enc_store} if enc_store else {})})
            self.encoders.append(self.d.start(f"encoder{i}", self._vllm(port, ec), ready=fleet.VLLM_READY, env=env))
            self.encoder_urls.append(f"http://127.0.0.1:{port}")
        extra = base + 4 * p.pds + p.encoders
        if "single" in p.baselines:
            self.d.start("single", self._vllm(extra, None), ready=fleet.VLLM_READY, env=env)
            self.single_url = f"http://127.0.0.1:{extra}"
        if "example" in p.baselines:
            store = self.log_dir / "ec-store"
            store.mkdir(parents=True, exist_ok=True)
            self.d.start("example-pd", self._vllm(extra + 1, fleet.example_config("ec_consumer", store)), ready=fleet.VLLM_READY, env=env)
            self.d.start("example-encoder", self._vllm(extra + 2, fleet.example_config("ec_producer", store)), ready=fleet.VLLM_READY, env=env)
            self.example_pd = (f"http://127.0.0.1:{extra + 1}", "tcp://127.0.0.1:1")
            self.example_encoder = f"http://127.0.0.1:{extra + 2}"
        self.d.wait_ready()

    def proxy(self, phase: Phase, log_dir: Path) -> "Proxy":
        if phase.kind == "example":
            enc, pds = [self.example_encoder], [self.example_pd]
        else:
            enc, pds = [self.encoder_urls[i] for i in phase.encoders], [self.pds[j] for j in phase.pds]
        extra: tuple[str, ...] = ()
        if phase.fault == "kill-encoder":
            extra = ("--encode-timeout", "300")  # an encoder call outlasts the time a stopped encoder is held
        elif phase.reuse == "store":
            extra = ("--store-reuse",)
        elif phase.reuse == "off" or (phase.kind in ("ecm", "example") and not phase.reuse):
            # Only the reuse phases reuse: the others measure each item's
            # way through the encoder and the transfer.
            extra = ("--affinity-entries", "0")
        return Proxy(self.args.python, enc, pds, log_dir, self.args.start_timeout, extra=extra)

    def warm_up(self, seed: int) -> int:
        """One request through every instance: each encoder with a PD behind
        a proxy of their own, each PD alone (it encodes itself), each
        baseline. Returns the next unused seed."""
        timeout = self.args.run_timeout
        for i, url in enumerate(self.encoder_urls):
            px = Proxy(self.args.python, [url], [self.pds[i % len(self.pds)]], self.log_dir / "warm-up", self.args.start_timeout, name=f"proxy-e{i}")
            try:
                _warm_up(px.url, self.model, self.args.image_size, seed, timeout)
                seed += 1
            finally:
                px.stop()
        for url, _ in self.pds[len(self.encoder_urls):]:
            _warm_up(url, self.model, self.args.image_size, seed, timeout)
            seed += 1
        if self.single_url:
            _warm_up(self.single_url, self.model, self.args.image_size, seed, timeout)
            seed += 1
        if self.example_encoder:
            px = Proxy(self.args.python, [self.example_encoder], [self.example_pd], self.log_dir / "warm-up", self.args.start_timeout, name="proxy-example")
            try:
                _warm_up(px.url, self.model, self.args.image_size, seed, timeout)
                seed += 1
            finally:
                px.stop()
        return seed

    def pd_scrape(self) -> str:
        return "\n".join(fleet.scrape(u) for urls in self.pd_metrics for u in urls)

    def pd_vllm_scrape(self) -> str:
        """The PD instances' own vLLM /metrics (the connector's Store
        counters reach them through vLLM's stats hooks)."""
        return "\n".join(fleet.scrape(url + "/metrics") for url, _ in self.pds)

    def pending(self) -> float:
        """Writes, cancels and expiries the PD shards still have pending.
        Loaded items stay in the slab by design (vLLM's encoder cache holds
        views of them, then the shard keeps resident copies)."""
        text = self.pd_scrape()
        return sum(fleet.metric(text, "ecm_reservations", state=st) for st in ("WRITING", "CANCEL_PENDING", "EXPIRE_PENDING"))


class Proxy:
    """One phase's proxy, in a deployment of its own."""

    def __init__(self, python: str, encode: list[str], pds: list[tuple[str, str]], log_dir: Path, timeout_s: float,
                 name: str = "proxy", extra: tuple[str, ...] = ()):
        port = _free_ports(2)
        self.d = fleet.Deployment(log_dir, timeout_s)
        self.server = self.d.start(name, fleet.proxy_argv(python, port, port + 1, encode, pds, extra=extra),
                                   ready=fleet.PROXY_READY, env=fleet.vllm_env())
        try:
            self.d.wait_ready()
        except fleet.ServerError:
            self.d.stop()
            raise
        self.url = f"http://127.0.0.1:{port}"
        self.metrics = f"http://127.0.0.1:{port + 1}/metrics"

    def scrape(self) -> str:
        return fleet.scrape(self.metrics)

    def stop(self) -> None:
        self.d.stop()


def reuse_dataset(path: Path, n: int, fraction: float, side: int, seed: int) -> int:
    """Writes vllm bench serve's custom_image dataset of n requests, one
    image each, where about fraction of them repeat an image an earlier
    request sent (a seeded choice) and the others send a new one. Returns
    the number of distinct images."""
    import random

    rng = random.Random(seed)
    images: list[str] = []
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            if not images or rng.random() >= fraction:
                images.append(_png(seed * 100_003 + len(images) + 1, side))
                url = images[-1]
            else:
                url = rng.choice(images)
            f.write(json.dumps({"content": [{"type": "image_url", "image_url": {"url": url}},
                                            {"type": "text", "text": "What is in this image?"}]}) + "\n")
    return len(images)


def bench_args(args: argparse.Namespace, model: str, url: str, rate: str, result_dir: Path, name: str, seed: int = 0,
               dataset: Path | None = None) -> list[str]:
    """``vllm bench serve``'s arguments; each run gets a seed of its own, so
    that its images are new to the instances (a PD shard keeps earlier runs'
    items resident, and an item it holds is not moved again). With dataset,
    the requests are that custom_image file's, in its order."""
    side = args.image_size
    if dataset is not None:
        data = ["--dataset-name", "custom_image", "--dataset-path", str(dataset), "--disable-shuffle",
                "--custom-output-len", str(args.output_len)]
    else:
        data = [
            "--dataset-name", "random-mm",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
            "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
            "--random-mm-limit-mm-per-prompt", IMAGE_LIMIT, "--random-mm-bucket-config", f"{{({side}, {side}, 1): 1.0}}",
        ]
    return [
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url,
        "--model", model, "--tokenizer", model, "--num-prompts", str(args.num_prompts), *data,
        "--request-rate", rate, "--ignore-eos", "--temperature", "0", "--seed", str(seed),
        "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
        "--ready-check-timeout-sec", "0", "--disable-tqdm",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", name,
    ]


def bench_argv(args: argparse.Namespace, model: str, url: str, rate: str, result_dir: Path, name: str, seed: int = 0) -> list[str]:
    """The same run as a command of its own (what Client runs, for a user to
    repeat by hand)."""
    return [args.python, *fleet.VLLM_CLI, "bench", "serve", *bench_args(args, model, url, rate, result_dir, name, seed)]


class Client:
    """One ``vllm bench serve`` process for every run (see vllm_cli's
    --bench-serve-loop): vLLM's import, minutes on a loaded CPU, is paid
    once, while the fleet starts."""

    def __init__(self, python: str, work: Path):
        self.work = work
        self.ready_file = work / "client.ready"
        self.ready_file.unlink(missing_ok=True)
        self.log_path = work / "client.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([python, *fleet.VLLM_CLI, "--bench-serve-loop", str(self.ready_file)],
                                     stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=fleet.vllm_env(), start_new_session=True)
        self.runs = 0

    def _alive(self) -> None:
        if self.proc.poll() is not None:
            raise fleet.ServerError(f"the benchmark client exited with {self.proc.returncode} (log {self.log_path})")

    def wait_ready(self, deadline: float) -> None:
        while not self.ready_file.is_file():
            self._alive()
            if time.monotonic() > deadline:
                raise fleet.ServerError(f"the benchmark client did not import vLLM in time (log {self.log_path})")
            time.sleep(0.5)

    def start(self, argv: list[str]) -> "Run":
        self._alive()
        self.runs += 1
        done = self.work / f"client.run{self.runs}.done"
        done.unlink(missing_ok=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"argv": argv, "done": str(done)}) + "\n").encode())
        self.proc.stdin.flush()
        return Run(self, done)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._log.close()


@dataclass
class Run:
    client: Client
    done: Path

    def running(self) -> bool:
        return not self.done.is_file() and self.client.proc.poll() is None

    def wait(self, deadline: float) -> str:
        """"" once the run ended well, else why not."""
        while self.running():
            if time.monotonic() > deadline:
                # A run that outlives its deadline leaves the client in it.
                self.client.stop()
                return "did not finish in time"
            time.sleep(0.2)
        if not self.done.is_file():
            return f"the client exited with {self.client.proc.returncode}"
        status = self.done.read_text()
        return "" if status.startswith("0") else status.partition("\n")[2].splitlines()[0]


def _kill_encoder_under_load(px: Proxy, victim: fleet.Server, url: str, run: "Run", before: str,
                             threshold: int, deadline: float) -> tuple[int, float | None]:
    """Waits until threshold items went through the encoders, then stops the
    victim's group, reads what the proxy has in flight to it, and kills it.
    Returns that count (the items the fault touched while in flight) and the
    seconds from the kill until the proxy marked it unhealthy (None: not
    before the client ended or the deadline)."""
    base = fleet.metric(before, "ecm_proxy_media_items_total", outcome="encoded")
    while time.monotonic() < deadline and run.running():
        if fleet.metric(px.scrape(), "ecm_proxy_media_items_total", outcome="encoded") - base >= threshold:
            break
        time.sleep(0.2)
    victim.signal_group(signal.SIGSTOP)
    touched = int(fleet.metric(px.scrape(), "ecm_proxy_backend_in_flight", role="encode", url=url))
    victim.signal_group(signal.SIGKILL)
    killed = time.monotonic()
    # The proxy's health checks see it too when the client sends nothing
    # more to it, so this wait does not depend on the client still running.
    while time.monotonic() < min(deadline, killed + 120):
        text = px.scrape()
        if 'url="' + url + '"' in text and fleet.metric(text, "ecm_proxy_backend_healthy", role="encode", url=url) == 0:
            return touched, time.monotonic() - killed
        time.sleep(0.1)
    return touched, None


def _row_from_result(name: str, rate: str, res: dict) -> Row:
    return Row(
        setup=name, rate=rate, completed=int(res["completed"]), failed=int(res.get("failed", 0)),
        req_per_s=float(res["request_throughput"]), ttft_p50_ms=float(res["p50_ttft_ms"]), ttft_p99_ms=float(res["p99_ttft_ms"]),
        itl_mean_ms=float(res["mean_itl_ms"]), e2el_p50_ms=float(res["p50_e2el_ms"]), e2el_p99_ms=float(res["p99_e2el_ms"]),
        errors=sorted({e for e in res.get("errors", []) if e})[:5],
    )


def _fleet_figures(row: Row, f: Fleet, px: Proxy | None, proxy0: str, pd0: str, vllm0: str, ecm: bool) -> None:
    if px is None:
        return
    proxy1 = px.scrape()
    d = lambda a, b, n, **lab: fleet.metric(b, n, **lab) - fleet.metric(a, n, **lab)  # noqa: E731
    row.encoded = int(d(proxy0, proxy1, "ecm_proxy_media_items_total", outcome="encoded"))
    row.reused = int(d(proxy0, proxy1, "ecm_proxy_media_items_total", outcome="reused"))
    if f.store_host:
        row.store = int(d(proxy0, proxy1, "ecm_proxy_media_items_total", outcome="store"))
        vllm1 = f.pd_vllm_scrape()
        row.fetched = int(d(vllm0, vllm1, "vllm:ec_mooncake_store_events_total", event="fetch_pushed"))
    row.fallback = int(d(proxy0, proxy1, "ecm_proxy_media_items_total", outcome="fallback"))
    row.encode_s = d(proxy0, proxy1, "ecm_proxy_phase_seconds_sum", phase="encode")
    if ecm:
        pd1 = f.pd_scrape()
        row.bytes_moved = int(d(pd0, pd1, "ecm_completed_bytes_total"))
        if f.store_host:
            row.local = int(d(pd0, pd1, "ecm_local_encodes_total"))
        row.rejected = int(d(pd0, pd1, "ecm_rejected_writes_total"))
        n = d(pd0, pd1, "ecm_transfer_wait_seconds_count")
        row.wait_mean_ms = 1000 * d(pd0, pd1, "ecm_transfer_wait_seconds_sum") / n if n else 0.0


def run_bench(f: Fleet, phase: Phase, px: Proxy | None, rate: str, log_dir: Path, seed: int) -> Row:
    args, model = f.args, f.model
    url = px.url if px is not None else f.single_url
    name = f"{phase.name.replace(' ', '_')}_{rate}.json"
    proxy0, pd0 = (px.scrape() if px else ""), f.pd_scrape()
    vllm0 = f.pd_vllm_scrape() if f.store_host else ""
    dataset = None
    if phase.reuse:
        dataset = log_dir / f"{name}.jsonl"
        reuse_dataset(dataset, args.num_prompts, args.reuse, args.image_size, seed)
    run = f.client.start(bench_args(args, model, url, rate, log_dir, name, seed, dataset))
    deadline = time.monotonic() + args.run_timeout
    touched = unrouted = None
    if phase.fault == "kill-encoder" and px is not None:
        victim = phase.encoders[-1]
        touched, unrouted = _kill_encoder_under_load(px, f.encoders[victim], f.encoder_urls[victim], run, proxy0,
                                                     max(1, args.num_prompts // 3), deadline)
    why = run.wait(deadline)
    if why:
        raise fleet.ServerError(f"{phase.name} at rate {rate}: vllm bench serve: {why} (log {f.client.log_path})")
    row = _row_from_result(phase.name, rate, json.loads((log_dir / name).read_text()))
    row.touched, row.unrouted_s = touched, unrouted
    _fleet_figures(row, f, px, proxy0, pd0, vllm0, phase.kind == "ecm")
    return row


def _count(answers: list[Answer], row: Row) -> None:
    """A self-driven phase's counts; its latencies are not measured, which
    the table shows as "-" rather than as zeros."""
    row.req_per_s = row.ttft_p50_ms = row.ttft_p99_ms = row.itl_mean_ms = row.e2el_p50_ms = row.e2el_p99_ms = None
    row.completed = sum(a.outcome == "answered" for a in answers)
    row.failed = len(answers) - row.completed
    row.errors = sorted({f"{a.outcome}: {a.detail}" for a in answers if a.outcome != "answered"})[:5]


def run_idle_pause(f: Fleet, phase: Phase, px: Proxy, seed: int) -> tuple[Row, int]:
    """Six requests at once, a pause past the backends' keep-alive timeout,
    three more: the second burst must find no dead pooled connection."""
    args = f.args
    proxy0, pd0 = px.scrape(), f.pd_scrape()
    first = burst(px.url, f.model, list(range(seed, seed + 6)), args.image_size, args.output_len, args.run_timeout)
    time.sleep(IDLE_PAUSE_S)
    second = burst(px.url, f.model, list(range(seed + 6, seed + 9)), args.image_size, args.output_len, args.run_timeout)
    row = Row(setup=phase.name, rate="-")
    _count(first + second, row)
    _fleet_figures(row, f, px, proxy0, pd0, True)
    return row, seed + 9


def run_proxy_stop(f: Fleet, phase: Phase, px: Proxy, seed: int, n: int = 4) -> tuple[Row, int]:
    """n requests at once; SIGTERM to the proxy once one is at the PD."""
    args = f.args
    pd0 = f.pd_scrape()
    out: list[list[Answer]] = []
    t = threading.Thread(target=lambda: out.append(burst(px.url, f.model, list(range(seed, seed + n)), args.image_size,
                                                         args.output_len, min(args.run_timeout, 120))), daemon=True)
    t.start()
    deadline = time.monotonic() + args.run_timeout
    while time.monotonic() < deadline and t.is_alive():
        if fleet.metric(px.scrape(), "ecm_proxy_backend_in_flight", role="pd") >= 1:
            break
        time.sleep(0.05)
    px.server.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    row = Row(setup=phase.name, rate="-")
    try:
        px.server.proc.wait(timeout=60)
        row.proxy_exit_s = time.monotonic() - sent
    except subprocess.TimeoutExpired:
        pass
    t.join(min(args.run_timeout, 120) + 60)
    answers = out[0] if out else [Answer("hung", "the client thread did not end")] * n
    _count(answers, row)
    row.hung = sum(a.outcome == "hung" for a in answers)
    row.dropped = sum(a.outcome == "dropped" for a in answers)
    # The proxy is gone and counts an item when its request ends, so what
    # moved is read off the PD shards alone.
    pd1 = f.pd_scrape()
    row.bytes_moved = int(fleet.metric(pd1, "ecm_completed_bytes_total") - fleet.metric(pd0, "ecm_completed_bytes_total"))
    return row, seed + n


def _wait_settled(f: Fleet, timeout_s: float) -> float:
    """Waits until no PD shard has a write, cancel or expiry pending; the
    count left at the deadline."""
    end = time.monotonic() + timeout_s
    while True:
        left = f.pending()
        if left == 0 or time.monotonic() > end:
            return left
        time.sleep(0.5)


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}{unit}" if not math.isnan(v) else "-"
    return f"{v}{unit}"


COLUMNS = [
    ("rate", "rate/s"), ("completed", "ok"), ("failed", "failed"), ("req_per_s", "req/s"),
    ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"), ("itl_mean_ms", "ITL ms"),
    ("e2el_p50_ms", "E2E p50 ms"), ("e2el_p99_ms", "E2E p99 ms"), ("encoded", "encoded"), ("fallback", "fallback"),
    ("bytes_moved", "bytes to PD"), ("wait_mean_ms", "PD wait ms"),
]
# Shown only where a row has them (the reuse and fault scenarios).
OPTIONAL = [("reused", "reused"), ("store", "store"), ("fetched", "fetched"), ("local", "local"), ("encode_s", "encode s"), ("touched", "touched"), ("unrouted_s", "unrouted after s"), ("hung", "hung"), ("dropped", "dropped"),
            ("proxy_exit_s", "proxy exit s")]


def table(setup: str, rows: list[Row], extra: str = "") -> str:
    cols = COLUMNS + [c for c in OPTIONAL if any(getattr(r, c[0]) is not None for r in rows)]
    cells = [[h for _, h in cols]] + [[_fmt(getattr(r, k)) if k != "req_per_s" or r.req_per_s is None else f"{r.req_per_s:.2f}" for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = [f"== {setup}" + (f" ({extra})" if extra else "")]
    for i, c in enumerate(cells):
        lines.append("  ".join(x.rjust(w) for x, w in zip(c, widths)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        for e in r.errors:
            lines.append(f"   rate {r.rate}: error: {e[:200]}")
        for p in r.problems:
            lines.append(f"   rate {r.rate}: CHECK FAILED: {p}")
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.rate != "-"]
    names = list(dict.fromkeys(r.setup for r in rows))
    rts = list(dict.fromkeys(r.rate for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(rts))
    for ax, (key, title) in zip(axes, [("ttft_p50_ms", "TTFT p50 (ms)"), ("e2el_p50_ms", "E2E latency p50 (ms)")]):
        for k, rate in enumerate(rts):
            vals = [next((getattr(r, key) for r in rows if r.setup == n and r.rate == rate), 0.0) for n in names]
            ax.bar([i + k * width for i in range(len(names))], vals, width, label=f"rate {rate}/s")
        ax.set_xticks([i + width * (len(rts) - 1) / 2 for i in range(len(names))], names, rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("vllm bench serve --dataset-name random-mm through the EPD proxy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _load() -> str:
    try:
        return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


def run_phase(f: Fleet, phase: Phase, rate_list: list[str], seed: int) -> tuple[list[Row], int, str]:
    """One phase's rows, the next unused seed, and what its shards held."""
    log_dir = f.log_dir / phase.name.replace(" ", "_")
    log_dir.mkdir(parents=True, exist_ok=True)
    px = f.proxy(phase, log_dir) if phase.kind != "single" else None
    rows: list[Row] = []
    try:
        if phase.fault == "idle-pause":
            row, seed = run_idle_pause(f, phase, px, seed)
            rows.append(row)
        elif phase.fault == "proxy-stop":
            row, seed = run_proxy_stop(f, phase, px, seed)
            rows.append(row)
        else:
            for rate in phase_rates(phase, rate_list):
                rows.append(run_bench(f, phase, px, rate, log_dir, seed))
                seed += 1
    finally:
        if px is not None:
            px.stop()
    for r in rows:
        r.problems = check(phase, r, f.args.num_prompts if r.rate != "-" else r.completed + r.failed)
    extra = ""
    if phase.kind == "ecm":
        # A killed encoder's grants have no writer left: the lease ends
        # them, then a second lease frees them.
        left = _wait_settled(f, 2 * LEASE_S + 60 if phase.fault == "kill-encoder" else 60)
        extra = f"pending writes/cancels/expiries on the PD shards after it: {left:.0f}"
        if left and rows:
            rows[-1].problems.append(f"{left:.0f} writes, cancels or expiries still pending on the PD shards")
    return rows, seed, extra


def main(args: argparse.Namespace) -> int:
    try:
        p, rate_list = plan(args), rates(args.rates)
    except ValueError as exc:
        print(f"bench-serve: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        from .report import plot_ready

        if not plot_ready("bench-serve"):
            return 2
    # SIGTERM unwinds like ^C, so that the fleet's servers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ecm-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    t0 = time.monotonic()
    if not model:
        model = str(work / "tiny-qwen2-vl")
        if not (Path(model) / "config.json").is_file():
            subprocess.run([args.python, "-m", "ecmooncake", "tiny-model", model], check=True, env=fleet.vllm_env(), stdout=subprocess.DEVNULL)
    print(f"bench-serve: a fleet of {p.encoders} encoders and {p.pds} PD instances, baselines "
          f"{', '.join(p.baselines) or 'none'}; {len(p.phases)} phases ({', '.join(ph.name for ph in p.phases)}) at rates "
          f"{','.join(rate_list)}; {args.num_prompts} prompts of {args.input_len} tokens + one {args.image_size}x{args.image_size} "
          f"image, {args.output_len} output tokens; {_load()}; logs in {work}", flush=True)
    f = Fleet(p, args, model, work)
    all_rows: list[Row] = []
    failed = False
    try:
        t = time.monotonic()
        try:
            # The client imports vLLM while the fleet starts.
            f.client = Client(args.python, work)
            f.start()
            f.client.wait_ready(time.monotonic() + args.start_timeout)
            seed = f.warm_up(1000)
        except (fleet.ServerError, OSError) as exc:
            print(f"bench-serve: the fleet did not start: {exc}\n{f.d.logs()}", file=sys.stderr)
            return 1
        ready = ", ".join(f"{s.name} {s.ready_after_s:.0f} s" for s in f.d.servers if s.ready_after_s is not None)
        print(f"bench-serve: fleet started and warmed up in {time.monotonic() - t:.0f} s (ready after: {ready}); {_load()}", flush=True)
        for ph in p.phases:
            t = time.monotonic()
            rows: list[Row] = []
            extra = ""
            try:
                rows, seed, extra = run_phase(f, ph, rate_list, seed)
            except (fleet.ServerError, OSError, KeyError, ValueError) as exc:
                failed = True
                extra = f"FAILED: {exc}"
                print(f.d.logs(), file=sys.stderr)
            if any(r.problems for r in rows):
                failed = True
            extra = (extra + "; " if extra else "") + f"{time.monotonic() - t:.0f} s"
            print(table(ph.name, rows, extra), flush=True)
            all_rows += rows
    finally:
        if f.client is not None:
            f.client.stop()
        f.d.stop()
    print(f"bench-serve: {time.monotonic() - t0:.0f} s in all; {_load()}; checks {'FAILED' if failed else 'passed'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in all_rows], indent=1))
    if args.plot and all_rows:
        plot(all_rows, args.plot)
        print(f"bench-serve: wrote {args.plot}")
    return 1 if failed else 0
