"""``python -m ecmooncake bench-serve``: an EPD fleet on one host under vLLM's
own client, ``vllm bench serve --dataset-name random-mm``.

Setups, each started, driven at every rate and stopped before the next:

- ``single``: one ``vllm serve`` instance, no proxy (the baseline);
- ``example``: one encoder and one PD instance with vLLM's ECExampleConnector
  (a shared directory), behind our proxy;
- ``NEmP`` for each ``--topologies`` entry: N encoders and M PD instances with
  ECMooncakeConnector, behind our proxy, which spreads items over the
  encoders and requests over the PD instances;
- ``kill-encoder`` (``--fault kill-encoder``): two encoders and one PD; once a
  third of the prompts' items were encoded, one encoder's process group is
  stopped (SIGSTOP, so that what the proxy has in flight to it stays put),
  the proxy's in-flight count to it is read (``touched``), and the group is
  SIGKILLed; at the first rate only. A touched item is encoded again by the
  other encoder (the proxy tries a second one when the first cannot be
  reached) or falls back to the PD instance's own encoder, so ``fallback``
  is at most ``touched``; the CI test (tests/python/e2e) splits the two
  exactly.

Each run prints vLLM's client figures beside the fleet's own: items through
the encoders and fallbacks (the proxy's /metrics), bytes the PD shards took
in and the PD schedulers' wait for pushed items (the PD instances'
ecmooncake metrics), each a difference of scrapes taken around the run. After
the last run of a setup, what its PD shards still hold (reservations, slab
bytes in use) is read, and the setup fails if either is not back to zero.

This process runs no server itself: the servers and the client run from
``--python`` (a vLLM environment), so the tool itself needs only the standard
library (and matplotlib for ``--plot``).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import fleet

IMAGE_LIMIT = json.dumps({"image": 1, "video": 0})


@dataclass
class Setup:
    name: str
    kind: str  # single, example, ecm
    encoders: int = 0
    pds: int = 0
    fault: str = ""


@dataclass
class Row:
    setup: str
    rate: str
    completed: int = 0
    failed: int = 0
    req_per_s: float = 0.0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    itl_mean_ms: float = 0.0
    e2el_p50_ms: float = 0.0
    e2el_p99_ms: float = 0.0
    encoded: int | None = None
    fallback: int | None = None
    bytes_moved: int | None = None
    wait_mean_ms: float | None = None
    touched: int | None = None
    errors: list[str] = field(default_factory=list)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--python", default=os.environ.get("ECMOONCAKE_VLLM_PYTHON", sys.executable),
                   help="interpreter of a vLLM environment that runs the servers and the client (default: $ECMOONCAKE_VLLM_PYTHON or this one)")
    p.add_argument("--model", default="", help="model to serve (default: a tiny random Qwen2-VL built here, served on the CPU)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every vllm serve (repeat), e.g. --vllm-arg=--gpu-memory-utilization=0.2")
    p.add_argument("--topologies", default="1E1P,2E1P,1E2P", help="ecmooncake fleets, NEmP each (default %(default)s)")
    p.add_argument("--baselines", default="single,example", help="single, example, both or none (default %(default)s)")
    p.add_argument("--fault", action="append", default=[], choices=["kill-encoder"], help="add a fault scenario (repeatable)")
    p.add_argument("--rates", default="2,inf", help="request rates per second, inf for all at once (default %(default)s)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=32, help="random text tokens per prompt (default %(default)s)")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--image-size", type=int, default=224, help="square images of this side (default %(default)s)")
    p.add_argument("--transport", default="tcp", choices=["tcp", "shm"])
    p.add_argument("--start-timeout", type=float, default=900, help="seconds for a setup's servers to be ready (default %(default)s)")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds for one client run (default %(default)s)")
    p.add_argument("--workdir", default="", help="logs, results and the tiny model (default: a new temporary directory)")
    p.add_argument("--json", default="", metavar="FILE", help="also write every row as JSON")
    p.add_argument("--plot", default="", metavar="FILE.png", help="draw TTFT and E2E latency per setup (needs matplotlib)")


def setups(args: argparse.Namespace) -> list[Setup]:
    out: list[Setup] = []
    base = {b.strip() for b in args.baselines.split(",") if b.strip() and b.strip() != "none"}
    if "both" in base:
        base = {"single", "example"}
    unknown = base - {"single", "example"}
    if unknown:
        raise ValueError(f"--baselines: unknown {sorted(unknown)}")
    if "single" in base:
        out.append(Setup("single", "single"))
    if "example" in base:
        out.append(Setup("example 1E1P", "example", 1, 1))
    for topo in (t.strip().upper() for t in args.topologies.split(",") if t.strip()):
        e, _, rest = topo.partition("E")
        if not rest.endswith("P") or not e.isdigit() or not rest[:-1].isdigit() or int(e) < 1 or int(rest[:-1]) < 1:
            raise ValueError(f"--topologies: {topo!r} is not NEmP (e.g. 2E1P)")
        out.append(Setup(f"ecmooncake {topo}", "ecm", int(e), int(rest[:-1])))
    for f in args.fault:
        out.append(Setup(f"ecmooncake 2E1P {f}", "ecm", 2, 1, fault=f))
    return out


def rates(text: str) -> list[str]:
    out = []
    for r in text.split(","):
        r = r.strip()
        if r != "inf" and not (float(r) > 0):
            raise ValueError(f"--rates: {r!r} is neither a positive number nor inf")
        out.append(r)
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


def _warm_up(url: str, model: str, side: int, n: int, timeout_s: float) -> None:
    """n requests, one at a time: the first of each instance is slow (CPU
    kernels being built), and would otherwise be in the first run's figures."""
    for i in range(n):
        body = {
            "model": model, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _png(1000 + i, side)}},
                {"type": "text", "text": "warm up"}]}],
        }
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()


class Fleet:
    """One setup's servers and where their metrics are."""

    def __init__(self, setup: Setup, args: argparse.Namespace, model: str, log_dir: Path):
        self.setup, self.args, self.model = setup, args, model
        self.d = fleet.Deployment(log_dir, args.start_timeout)
        self.proxy_metrics = ""
        self.pd_metrics: list[str] = []
        self.encoders: list[fleet.Server] = []
        self.encoder_urls: list[str] = []
        self.url = ""

    def _vllm(self, port: int, ec: dict | None) -> list[str]:
        return fleet.vllm_argv(self.args.python, self.model, port, ec=ec) + self.args.vllm_arg

    def start(self) -> None:
        s, py = self.setup, self.args.python
        env = fleet.vllm_env()
        if s.kind == "single":
            port = _free_ports(1)
            self.d.start("vllm", self._vllm(port, None), ready=fleet.VLLM_READY, env=env)
            self.d.wait_ready()
            self.url = f"http://127.0.0.1:{port}"
            return
        base = _free_ports(2 + s.encoders + 4 * s.pds)
        proxy_port, proxy_metrics = base, base + 1
        enc_ports = [base + 2 + i for i in range(s.encoders)]
        pd_base = base + 2 + s.encoders
        pds: list[tuple[str, str]] = []
        store = self.d.log_dir / "ec-store"
        for j in range(s.pds):
            http, ec_port, metrics_port = pd_base + 4 * j, pd_base + 4 * j + 1, pd_base + 4 * j + 2
            if s.kind == "example":
                store.mkdir(parents=True, exist_ok=True)
                ec = fleet.example_config("ec_consumer", store)
            else:
                ec = fleet.ecm_config("ec_consumer", "127.0.0.1", ec_port,
                                      {"transport": self.args.transport, "metrics_port": metrics_port, "push_wait_timeout_s": 120})
                # The engine core serves the series at metrics_port, its
                # worker at the next port, where they are two processes.
                self.pd_metrics += [f"http://127.0.0.1:{metrics_port}/metrics", f"http://127.0.0.1:{metrics_port + 1}/metrics"]
            self.d.start(f"pd{j}", self._vllm(http, ec), ready=fleet.VLLM_READY, env=env)
            pds.append((f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{ec_port}" if s.kind == "ecm" else "tcp://127.0.0.1:1"))
        for i, port in enumerate(enc_ports):
            if s.kind == "example":
                ec = fleet.example_config("ec_producer", store)
            else:
                # The consumer to push to comes with each request from the proxy.
                ec = fleet.ecm_config("ec_producer", "127.0.0.1", pd_base + 1, {"transport": self.args.transport})
            self.encoders.append(self.d.start(f"encoder{i}", self._vllm(port, ec), ready=fleet.VLLM_READY, env=env))
            self.encoder_urls.append(f"http://127.0.0.1:{port}")
        self.d.wait_ready()
        self.d.start("proxy", fleet.proxy_argv(py, proxy_port, proxy_metrics, self.encoder_urls, pds), ready=fleet.PROXY_READY, env=env)
        self.d.wait_ready()
        self.url = f"http://127.0.0.1:{proxy_port}"
        self.proxy_metrics = f"http://127.0.0.1:{proxy_metrics}/metrics"

    def scrape(self) -> tuple[str, str]:
        proxy = fleet.scrape(self.proxy_metrics) if self.proxy_metrics else ""
        return proxy, "\n".join(fleet.scrape(u) for u in self.pd_metrics)


def bench_argv(args: argparse.Namespace, model: str, url: str, rate: str, result_dir: Path, name: str, seed: int = 0) -> list[str]:
    """The client's command; each run of a setup gets a seed of its own, so that
    its images are new to the PD shards (a shard keeps the last run's, and an
    image it holds is not moved again)."""
    side = args.image_size
    return [
        args.python, *fleet.VLLM_CLI, "bench", "serve",
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url,
        "--model", model, "--tokenizer", model,
        "--dataset-name", "random-mm", "--num-prompts", str(args.num_prompts),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
        "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
        "--random-mm-limit-mm-per-prompt", IMAGE_LIMIT, "--random-mm-bucket-config", f"{{({side}, {side}, 1): 1.0}}",
        "--request-rate", rate, "--ignore-eos", "--temperature", "0", "--seed", str(seed),
        "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
        "--ready-check-timeout-sec", "0", "--disable-tqdm",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", name,
    ]


def _kill_encoder_under_load(f: Fleet, client: subprocess.Popen, before: str, threshold: int, deadline: float) -> int:
    """Waits until threshold items went through the encoders, then stops one
    encoder's group, reads what the proxy has in flight to it, and kills it.
    Returns that count: the items the fault touched while in flight."""
    victim, url = f.encoders[0], f.encoder_urls[0]
    base = fleet.metric(before, "ecm_proxy_media_items_total", outcome="encoded")
    while time.monotonic() < deadline and client.poll() is None:
        now = fleet.scrape(f.proxy_metrics)
        if fleet.metric(now, "ecm_proxy_media_items_total", outcome="encoded") - base >= threshold:
            break
        time.sleep(0.2)
    victim.signal_group(signal.SIGSTOP)
    touched = int(fleet.metric(fleet.scrape(f.proxy_metrics), "ecm_proxy_backend_in_flight", role="encode", url=url))
    victim.signal_group(signal.SIGKILL)
    return touched


def run_one(f: Fleet, args: argparse.Namespace, model: str, rate: str, result_dir: Path, log_dir: Path, seed: int = 0) -> Row:
    name = f"{f.setup.name.replace(' ', '_')}_{rate}.json"
    proxy0, pd0 = f.scrape()
    log = open(log_dir / f"client_{name}.log", "wb")
    client = subprocess.Popen(bench_argv(args, model, f.url, rate, result_dir, name, seed), stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, env=fleet.vllm_env(), start_new_session=True)
    deadline = time.monotonic() + args.run_timeout
    touched = None
    try:
        if f.setup.fault == "kill-encoder":
            touched = _kill_encoder_under_load(f, client, proxy0, max(1, args.num_prompts // 3), deadline)
        client.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(client.pid, signal.SIGKILL)
        client.wait()
        raise fleet.ServerError(f"{f.setup.name} at rate {rate}: the client did not finish within {args.run_timeout:.0f} s") from None
    finally:
        log.close()
    if client.returncode != 0:
        raise fleet.ServerError(f"{f.setup.name} at rate {rate}: vllm bench serve exited {client.returncode} (log {log.name})")
    res = json.loads((result_dir / name).read_text())
    proxy1, pd1 = f.scrape()
    row = Row(
        setup=f.setup.name, rate=rate, completed=int(res["completed"]), failed=int(res.get("failed", 0)),
        req_per_s=float(res["request_throughput"]), ttft_p50_ms=float(res["p50_ttft_ms"]), ttft_p99_ms=float(res["p99_ttft_ms"]),
        itl_mean_ms=float(res["mean_itl_ms"]), e2el_p50_ms=float(res["p50_e2el_ms"]), e2el_p99_ms=float(res["p99_e2el_ms"]),
        touched=touched, errors=sorted({e for e in res.get("errors", []) if e})[:5],
    )
    if f.proxy_metrics:
        d = lambda a, b, n, **lab: fleet.metric(b, n, **lab) - fleet.metric(a, n, **lab)  # noqa: E731
        row.encoded = int(d(proxy0, proxy1, "ecm_proxy_media_items_total", outcome="encoded"))
        row.fallback = int(d(proxy0, proxy1, "ecm_proxy_media_items_total", outcome="fallback"))
        if f.pd_metrics:
            row.bytes_moved = int(d(pd0, pd1, "ecm_completed_bytes_total"))
            n = d(pd0, pd1, "ecm_transfer_wait_seconds_count")
            row.wait_mean_ms = 1000 * d(pd0, pd1, "ecm_transfer_wait_seconds_sum") / n if n else 0.0
    return row


def leftovers(f: Fleet) -> dict[str, float]:
    """What the PD shards still hold once every request ended."""
    if not f.pd_metrics:
        return {}
    _, pd = f.scrape()
    return {"reservations": fleet.metric(pd, "ecm_reservations"), "slab_bytes_in_use": fleet.metric(pd, "ecm_slab_bytes_in_use")}


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


def table(setup: str, rows: list[Row], extra: str = "") -> str:
    cols = COLUMNS + ([("touched", "touched")] if any(r.touched is not None for r in rows) else [])
    cells = [[h for _, h in cols]] + [[_fmt(getattr(r, k)) if k != "req_per_s" else f"{r.req_per_s:.2f}" for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = [f"== {setup}" + (f" ({extra})" if extra else "")]
    for i, c in enumerate(cells):
        lines.append("  ".join(x.rjust(w) for x, w in zip(c, widths)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        for e in r.errors:
            lines.append(f"   rate {r.rate}: error: {e[:200]}")
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def main(args: argparse.Namespace) -> int:
    try:
        plan, rate_list = setups(args), rates(args.rates)
    except ValueError as exc:
        print(f"bench-serve: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        from .report import plot_ready

        if not plot_ready("bench-serve"):
            return 2
    # SIGTERM unwinds like ^C, so that a setup's servers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ecm-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not model:
        model = str(work / "tiny-qwen2-vl")
        if not (Path(model) / "config.json").is_file():
            subprocess.run([args.python, "-m", "ecmooncake", "tiny-model", model], check=True, env=fleet.vllm_env(), stdout=subprocess.DEVNULL)
    t0 = time.monotonic()
    print(f"bench-serve: {len(plan)} setups x rates {','.join(rate_list)}, {args.num_prompts} prompts of {args.input_len} tokens "
          f"+ one {args.image_size}x{args.image_size} image, {args.output_len} output tokens; logs in {work}", flush=True)
    all_rows: list[Row] = []
    failed = False
    for s in plan:
        log_dir = work / s.name.replace(" ", "_")
        f = Fleet(s, args, model, log_dir)
        rows: list[Row] = []
        extra = ""
        t_setup = time.monotonic()
        try:
            f.start()
            _warm_up(f.url, model, args.image_size, max(1, s.pds), args.run_timeout)
            # A fault happens once: the second rate would find A dead already.
            for k, rate in enumerate(rate_list[:1] if s.fault else rate_list):
                rows.append(run_one(f, args, model, rate, log_dir, log_dir, seed=k))
            left = leftovers(f)
            if left:
                extra = ", ".join(f"{k} left {v:.0f}" for k, v in left.items())
                if any(left.values()):
                    failed = True
        except (fleet.ServerError, OSError, KeyError, ValueError) as exc:
            failed = True
            extra = f"FAILED: {exc}"
            print(f.d.logs(), file=sys.stderr)
        finally:
            f.d.stop()
        extra = (extra + "; " if extra else "") + f"{time.monotonic() - t_setup:.0f} s"
        print(table(s.name, rows, extra), flush=True)
        all_rows += rows
    print(f"bench-serve: {time.monotonic() - t0:.0f} s in all", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in all_rows], indent=1))
    if args.plot and all_rows:
        plot(all_rows, args.plot)
        print(f"bench-serve: wrote {args.plot}")
    return 1 if failed else 0
