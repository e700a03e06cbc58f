"""A real ``vllm serve`` 0.26.0 EPD on one GPU host: the packing here, the
run there, and the checks (build/gpu_vllm_e2e.sh drives it).

    python3 build/gpu_vllm_e2e.py pack --cache DIR --model DIR --wheel WHL --out1 DIR --out2 DIR
    python3 build/gpu_vllm_e2e.py run --root DIR --out DIR

``pack`` (on the build machine) resolves vLLM 0.26.0's dependencies for
CPython 3.12 as of its release, leaves out what the GPU host has, trims the
vLLM wheel and writes the two pieces carried to the host: piece 1 is vLLM's
core op library (xz) and the tiny model, piece 2 every other file of the
folder that goes first on PYTHONPATH (one tar.xz) and our wheel's files
(another).

``run`` (on the GPU host, the pieces unpacked into DIR) starts, side by
side on the one GPU, a baseline ``vllm serve`` and an EPD pair (an
encoder-only instance as producer, a PD instance as consumer with
ECMooncakeConnector), then our proxy in front of the pair; sends images of
several sizes one at a time, then a burst, to both; and checks that the
answers are token-identical, that every image went through the transfer
(0 fallbacks, counted by the proxy and by both ends' library series), that
the bytes went over ``cuda_ipc``, and that nothing is left on the GPU or in
/dev/shm once the instances stopped. It prints per request the baseline's
and EPD's time to first token and the connector's time from save_caches on
the encoder to the tensor in the PD instance's encoder cache
(ECMOONCAKE_TRACE_LOG's stamps), and writes every log and summary.json
into the out folder.

The checks are functions of text and numbers (tests/python/test_gpu_vllm_e2e.py
runs them on the CPU); only ``run`` needs the GPU host.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# --- what is packed ---------------------------------------------------------

VLLM_VERSION = "0.26.0"
# vLLM 0.26.0's release: its dependencies as they were then (later ones
# bring openai 3.x, anthropic 2.x and mcp 2.x).
EXCLUDE_NEWER = "2026-07-26"
PYTHON_VERSION = "3.12"
# llguidance 1.7.6 has no wheel for an older glibc; the host has 2.39.
UV_PLATFORM = "x86_64-manylinux_2_35"
PIP_PLATFORMS = [
    "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
    "manylinux_2_5_x86_64", "manylinux1_x86_64",
]
# The host's PyTorch family: resolved with no dependencies of their own
# (their CUDA packages under these pins are not on PyPI), and never carried.
TORCH_FAMILY = {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0", "triton": "3.6.0"}
# GPU kernel packages vLLM 0.26.0 lists that serving this model does not
# import (seen on the host: it served without them).
NOT_NEEDED = {
    "torchcodec", "pynvvideocodec", "flashinfer-python", "apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend",
    "fastsafetensors", "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels",
}
# vLLM's core op library: carried alone (xz) in piece 1, as it is most of
# the wheel's size that any run needs.
CORE_LIB = "vllm/_C_stable_libtorch.abi3.so"
# Files of the vLLM wheel not carried: the MoE kernels, FlashAttention 2,
# the Rust front end, FlashMLA, QuTLASS and deep_gemm's builds for other
# Pythons (FlashAttention 3 stays: it is vLLM's default on Hopper).
WHEEL_DROPS = (
    re.compile(r"^vllm/_moe_C[^/]*\.so$"),
    re.compile(r"^vllm/vllm_flash_attn/_vllm_fa2_C[^/]*\.so$"),
    re.compile(r"^vllm/vllm-rs$"),
    re.compile(r"^vllm/_flashmla_C[^/]*\.so$"),
    re.compile(r"^vllm/_qutlass_C[^/]*\.so$"),
    re.compile(r"^vllm/third_party/deep_gemm/_C\.cpython-3(?!12-)[0-9]+-[^/]*\.so$"),
)
HOST_PACKAGES = REPO / "build" / "gpu_host_packages.txt"
# Each piece rides with the working tree (about 4 MB) in one call of at
# most 64 MiB.
PIECE_LIMIT = 58 << 20


def norm(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise ValueError(f"not a requirement: {req!r}")
    return norm(m.group(1))


def requirements_in(metadata: str) -> list[str]:
    """vLLM's own requirements (no extras) from its wheel's METADATA, less
    the kernel packages not needed."""
    msg = Parser().parsestr(metadata)
    out = []
    for req in msg.get_all("Requires-Dist") or []:
        if "extra ==" in req.replace('"', " ").replace("'", " ") or "extra==" in req:
            continue
        if requirement_name(req) in NOT_NEEDED:
            continue
        out.append(req.strip())
    return out


def uv_config() -> str:
    """uv's settings giving the PyPI torch family no dependencies."""
    rows = [f'  {{ name = "{n}", version = "{v}", requires-dist = [] }},' for n, v in TORCH_FAMILY.items()]
    return "dependency-metadata = [\n" + "\n".join(rows) + "\n]\n"


def host_packages(text: str) -> set[str]:
    names: set[str] = set()
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        names.update(norm(w) for w in line.split())
    return names


def pins(compiled: str, host: set[str]) -> list[str]:
    """The name==version lines of uv's output that the host lacks (numpy
    among what it has: mistral-common asks for <2.4, the host's 2.5.2 works)."""
    out = []
    for line in compiled.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line.startswith("-"):
            continue
        pin = line.split(";", 1)[0].split("\\", 1)[0].strip()
        name = requirement_name(pin)
        if name in host or name in TORCH_FAMILY or name == "vllm":
            continue
        if "==" not in pin:
            raise ValueError(f"not pinned: {line!r}")
        out.append(pin)
    return out


HOST_ENV = {"python_version": PYTHON_VERSION, "python_full_version": PYTHON_VERSION + ".3", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "extra": ""}


def unmet(metadatas: dict[str, str], host: set[str]) -> list[str]:
    """Each requirement (no extras, markers as on the GPU host) of the
    carried distributions that neither they nor the host provide; the
    kernel packages left out on purpose are not counted."""
    from packaging.requirements import Requirement

    have = {norm(n) for n in metadatas} | host | set(TORCH_FAMILY)
    out = []
    for dist, text in sorted(metadatas.items()):
        for raw in Parser().parsestr(text).get_all("Requires-Dist") or []:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate(HOST_ENV):
                continue
            name = norm(req.name)
            if name not in have and name not in NOT_NEEDED:
                out.append(f"{dist} needs {raw}")
    return out


def wheel_metadata(whl: Path) -> tuple[str, str]:
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = z.read(name).decode()
    return Parser().parsestr(text)["Name"], text


def keep_in_vllm(name: str) -> bool:
    return not any(p.match(name) for p in WHEEL_DROPS)


def keep_of_ours(name: str) -> bool:
    """Our wheel less the TCP ceiling tool, which the run does not use."""
    return name != "ecmooncake/ecm-ceiling"


def _install_target(name: str) -> str | None:
    """Where a wheel member goes in a --target folder: .data/purelib and
    platlib at the top, .data/scripts, headers and data nowhere."""
    parts = name.split("/")
    if parts[0].endswith(".data"):
        if len(parts) > 2 and parts[1] in ("purelib", "platlib"):
            return "/".join(parts[2:])
        return None
    return name


def unpack_wheel(whl: Path, site: Path, keep=lambda name: True) -> list[str]:
    """Installs a wheel into site as pip --target does (no scripts), the
    members keep() refuses left out; returns what was left out."""
    left = []
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            target = _install_target(info.filename)
            if target is None:
                continue
            if not keep(target):
                left.append(target)
                continue
            dest = site / target
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(dest, mode | 0o200)
    return left


def shrink_xgrammar(site: Path) -> int:
    """xgrammar without its static library, its shared ones stripped:
    44.8 MB -> 2.6 MB; returns the bytes saved."""
    root = site / "xgrammar"
    if not root.is_dir():
        raise FileNotFoundError(f"no xgrammar in {site}")
    before = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    for p in list(root.rglob("*.a")):
        p.unlink()
    for p in root.rglob("*.so*"):
        if p.is_file():
            subprocess.run(["strip", "--strip-unneeded", str(p)], check=True)
    after = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return before - after


def _run(cmd: list[str], **kw) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, **kw)


def _tar_xz(out: Path, root: Path, members: list[str]) -> None:
    """tar.xz of root's members, with xz on every core (Python's lzma has
    one thread)."""
    tmp = out.with_suffix(out.suffix + ".tmp")
    _run(["tar", "-C", str(root), "--owner=0", "--group=0", "--sort=name", "-I", "xz -6 -T0", "-cf", str(tmp), *members])
    tmp.replace(out)


def _digest(paths: list[Path], extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(str(p.stat().st_size).encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def _pip_download(dest: Path, reqs: list[str]) -> None:
    platforms = [a for p in PIP_PLATFORMS for a in ("--platform", p)]
    _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON_VERSION,
          "--implementation", "cp", *platforms, "-d", str(dest), *reqs])


def _wheel_for(dest: Path, pin: str) -> Path:
    name, _, version = pin.partition("==")
    want = norm(name).replace("-", "_")
    found = [p for p in dest.glob("*.whl") if p.name.split("-")[0].lower().replace(".", "_") == want and p.name.split("-")[1] == version]
    if len(found) != 1:
        raise FileNotFoundError(f"{pin}: {len(found)} wheels in {dest} ({[p.name for p in found]})")
    return found[0]


def pack(args: argparse.Namespace) -> int:
    cache = Path(args.cache)
    (cache / "vllm").mkdir(parents=True, exist_ok=True)
    (cache / "wheels").mkdir(parents=True, exist_ok=True)
    wheels = sorted((cache / "vllm").glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not wheels:
        _pip_download(cache / "vllm", [f"vllm=={VLLM_VERSION}"])
        wheels = sorted((cache / "vllm").glob(f"vllm-{VLLM_VERSION}-*.whl"))
    vllm_whl = wheels[-1]
    with zipfile.ZipFile(vllm_whl) as z:
        metadata = z.read(f"vllm-{VLLM_VERSION}.dist-info/METADATA").decode()

    work = cache / "resolve"
    work.mkdir(exist_ok=True)
    (work / "requirements.in").write_text("\n".join(requirements_in(metadata)) + "\n")
    (work / "uv.toml").write_text(uv_config())
    compiled = work / "requirements.txt"
    key = _digest([work / "requirements.in", work / "uv.toml"], EXCLUDE_NEWER + UV_PLATFORM)
    keyf = work / "key"
    if not compiled.is_file() or not keyf.is_file() or keyf.read_text() != key:
        _run([args.uv, "pip", "compile", "-q", "--config-file", str(work / "uv.toml"), "--exclude-newer", EXCLUDE_NEWER,
              "--python-version", PYTHON_VERSION, "--python-platform", UV_PLATFORM, "--only-binary", ":all:",
              str(work / "requirements.in"), "-o", str(compiled)])
        keyf.write_text(key)
    wanted = pins(compiled.read_text(), host_packages(HOST_PACKAGES.read_text()))
    missing = []
    for pin in wanted:
        try:
            _wheel_for(cache / "wheels", pin)
        except FileNotFoundError:
            missing.append(pin)
    if missing:
        _pip_download(cache / "wheels", missing)
    dep_wheels = [_wheel_for(cache / "wheels", p) for p in wanted]
    gaps = unmet(dict(wheel_metadata(w) for w in [vllm_whl, *dep_wheels]), host_packages(HOST_PACKAGES.read_text()))
    if gaps:
        print("requirements neither carried nor on the host:\n  " + "\n  ".join(gaps), file=sys.stderr)
        return 1
    print(f"== {len(dep_wheels)} dependency wheels for cp312 (the host's packages left out)", file=sys.stderr)

    out1, out2 = Path(args.out1), Path(args.out2)
    for d in (out1, out2):
        d.mkdir(parents=True, exist_ok=True)
    site_key = _digest([vllm_whl, *dep_wheels], "\n".join(p.pattern for p in WHEEL_DROPS))
    site_tar = cache / f"site-{site_key}.tar.xz"
    core_xz = cache / f"core-{site_key}.so.xz"
    if not (site_tar.is_file() and core_xz.is_file()):
        stage = cache / "stage"
        shutil.rmtree(stage, ignore_errors=True)
        site = stage / "site"
        site.mkdir(parents=True)
        for whl in dep_wheels:
            unpack_wheel(whl, site)
        saved = shrink_xgrammar(site)
        print(f"== xgrammar: {saved / 1e6:.1f} MB less", file=sys.stderr)
        left = unpack_wheel(vllm_whl, site, keep_in_vllm)
        print(f"== vLLM wheel: left out {', '.join(left)}", file=sys.stderr)
        core = site / CORE_LIB
        _run(["xz", "-6", "-T0", "-k", "-c", str(core)], stdout=open(core_xz.with_suffix(".tmp"), "wb"))
        core_xz.with_suffix(".tmp").replace(core_xz)
        core.unlink()
        members = sorted(str(p.relative_to(stage)) for p in site.iterdir())
        _tar_xz(site_tar, stage, members)
        shutil.rmtree(stage, ignore_errors=True)
    for old in list(out1.iterdir()) + list(out2.iterdir()):
        old.unlink()
    # piece 1: the core op library and the model
    shutil.copyfile(core_xz, out1 / "core.so.xz")
    model = Path(args.model)
    with tarfile.open(out1 / "model.tar", "w") as t:
        t.add(model, arcname="model")
    # piece 2: the rest of the folder, and our wheel installed (xz packs
    # its Go library tighter than the wheel's zip, and the run needs no
    # ecm-ceiling: 14 MB -> about 6 MB)
    shutil.copyfile(site_tar, out2 / "site.tar.xz")
    ours = cache / "ours-stage"
    shutil.rmtree(ours, ignore_errors=True)
    left = unpack_wheel(Path(args.wheel), ours / "site", keep_of_ours)
    print(f"== {Path(args.wheel).name}: left out {', '.join(left)}", file=sys.stderr)
    _tar_xz(out2 / "ecmooncake.tar.xz", ours, ["site"])
    shutil.rmtree(ours, ignore_errors=True)
    (out2 / "wheel.txt").write_text(Path(args.wheel).name + "\n")
    pack_id = _digest([out1 / "core.so.xz", out1 / "model.tar", out2 / "site.tar.xz", out2 / "ecmooncake.tar.xz"])
    for n, d in ((1, out1), (2, out2)):
        files = {p.name: p.stat().st_size for p in sorted(d.iterdir())}
        (d / "manifest.json").write_text(json.dumps({"piece": n, "pack_id": pack_id, "vllm": VLLM_VERSION, "files": files}, indent=1) + "\n")
    rc = 0
    for n, d in ((1, out1), (2, out2)):
        total = sum(p.stat().st_size for p in d.iterdir())
        print(f"piece {n}: {d} {total} bytes ({total / 2**20:.1f} MiB)")
        for p in sorted(d.iterdir()):
            print(f"  {p.name} {p.stat().st_size}")
        if total > PIECE_LIMIT:
            print(f"piece {n} is over {PIECE_LIMIT >> 20} MiB: it would not fit one call beside the tree", file=sys.stderr)
            rc = 1
    print(f"pack id {pack_id}")
    return rc


# --- the run's checks ---------------------------------------------------------

TRACE_RE = re.compile(r"ecmooncake item-trace (\w+) mm_hash=(\S+) t_ns=(\d+)")


def parse_trace(text: str) -> dict[str, dict[str, int]]:
    """{mm_hash: {event: t_ns}} from a log's item-trace lines, the first
    stamp of each event kept (a later one is the same item again)."""
    out: dict[str, dict[str, int]] = {}
    for m in TRACE_RE.finditer(text):
        event, mm_hash, t = m.group(1), m.group(2), int(m.group(3))
        out.setdefault(mm_hash, {}).setdefault(event, t)
    return out


def item_times(producer_log: str, consumer_log: str) -> list[dict]:
    """Each traced item: its save_caches stamp on the encoder, its
    encoder_cache stamp on the PD instance and the difference (None where
    one side has no stamp)."""
    saves = parse_trace(producer_log)
    puts = parse_trace(consumer_log)
    rows = []
    for h in sorted(set(saves) | set(puts), key=lambda h: saves.get(h, {}).get("save_caches", puts.get(h, {}).get("encoder_cache", 0))):
        s = saves.get(h, {}).get("save_caches")
        p = puts.get(h, {}).get("encoder_cache")
        rows.append({"mm_hash": h, "save_ns": s, "put_ns": p, "connector_ms": (p - s) / 1e6 if s is not None and p is not None else None})
    return rows


def assign_items(requests: list[dict], items: list[dict]) -> None:
    """Gives each request the items whose save_caches stamp falls inside its
    own [sent, answered] window and no other request's (sequential requests
    get theirs; in a burst the windows overlap and an item stays unassigned)."""
    for r in requests:
        r.setdefault("items", [])
    for it in items:
        if it["save_ns"] is None:
            continue
        inside = [r for r in requests if r["sent_ns"] <= it["save_ns"] <= r["done_ns"]]
        if len(inside) == 1:
            inside[0]["items"].append(it["mm_hash"])


def compare_tokens(baseline: list[dict], epd: list[dict]) -> list[str]:
    """Every difference between the two runs' answers, request by request:
    an error on either side, another length, the first token that differs."""
    problems = []
    if len(baseline) != len(epd):
        problems.append(f"{len(baseline)} baseline answers against {len(epd)} EPD answers")
    for i, (b, e) in enumerate(zip(baseline, epd)):
        for side, a in (("baseline", b), ("EPD", e)):
            if a.get("error"):
                problems.append(f"request {i}: {side} failed: {a['error']}")
        if b.get("error") or e.get("error"):
            continue
        bt, et = b["tokens"], e["tokens"]
        if bt == et:
            continue
        first = next((k for k, (x, y) in enumerate(zip(bt, et)) if x != y), min(len(bt), len(et)))
        problems.append(
            f"request {i}: tokens differ from position {first}: baseline {bt} EPD {et}"
            + (f" (baseline logprob {b['logprobs'][first]:.4f}, EPD {e['logprobs'][first]:.4f})" if first < min(len(bt), len(et)) else "")
        )
    return problems


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of one Prometheus series' samples whose labels include the
    given ones; 0 when absent."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def has_metric(text: str, name: str) -> bool:
    return any(line.split("{")[0].split(" ")[0] == name for line in text.splitlines() if not line.startswith("#"))


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def transfer_checks(proxy: str, pd: str, enc: str, items: int, distinct: int) -> list[Check]:
    """Every image went through the transfer, counted on both sides: the
    proxy encoded each one and fell back for none; the encoder's library
    wrote each distinct one over cuda_ipc and failed nothing; the PD
    instance's shard completed each and its scheduler saw each arrive."""
    out = []
    fb = metric(proxy, "ecm_proxy_media_items_total", outcome="fallback")
    enc_items = metric(proxy, "ecm_proxy_media_items_total", outcome="encoded")
    out.append(Check("proxy: 0 fallbacks", fb == 0 and has_metric(proxy, "ecm_proxy_media_items_total"), f"fallback {fb:g}, encoded {enc_items:g}"))
    out.append(Check("proxy: every image encoded", enc_items == items, f"encoded {enc_items:g} of {items}"))
    ipc_bytes = metric(enc, "ecm_transfer_bytes_total", transport="cuda_ipc")
    all_bytes = metric(enc, "ecm_transfer_bytes_total")
    ipc_items = metric(enc, "ecm_transfer_items_total", transport="cuda_ipc")
    out.append(Check('encoder: ecm_transfer_bytes_total{transport="cuda_ipc"} > 0', ipc_bytes > 0, f"{ipc_bytes:g} bytes over cuda_ipc"))
    out.append(Check("encoder: every byte over cuda_ipc", all_bytes == ipc_bytes, f"{all_bytes:g} bytes in all, {ipc_bytes:g} over cuda_ipc"))
    out.append(Check("encoder: each distinct image written", ipc_items >= distinct, f"{ipc_items:g} items over cuda_ipc, {distinct} distinct images"))
    for side, text in (("encoder", enc), ("PD", pd)):
        f = metric(text, "ecm_failures_total")
        out.append(Check(f"{side}: ecm_failures_total 0", f == 0, f"{f:g}"))
    completed = metric(pd, "ecm_completed_items_total")
    waited = metric(pd, "ecm_transfer_wait_seconds_count")
    rejected = metric(pd, "ecm_rejected_writes_total")
    out.append(Check("PD: each distinct image completed on the shard", completed >= distinct, f"{completed:g} completed, {distinct} distinct"))
    out.append(Check("PD: the scheduler saw each distinct image arrive", distinct <= waited <= items, f"{waited:g} waits for {distinct} distinct, {items} items"))
    out.append(Check("PD: 0 rejected writes", rejected == 0, f"{rejected:g}"))
    return out


FAILED_LOAD = "ecmooncake: load of "


def log_checks(producer_log: str, consumer_log: str) -> list[Check]:
    """The startup lines and the data plane the encoder chose: cuda_ipc;
    and no load the PD instance filled with a stand-in."""
    out = []
    chosen = [l for l in producer_log.splitlines() if "data plane chosen" in l]
    ipc = [l for l in chosen if "transport=cuda_ipc" in l]
    out.append(Check("encoder: data plane chosen transport=cuda_ipc", bool(ipc) and len(ipc) == len(chosen),
                     (chosen[0].strip()[-300:] if chosen else "no 'data plane chosen' line in the encoder's log")))
    for side, text, want in (("encoder", producer_log, "connector (producer)"), ("PD", consumer_log, "connector (consumer)")):
        lines = [l for l in text.splitlines() if "ecmooncake:" in l and want in l]
        out.append(Check(f"{side}: connector startup line", bool(lines), lines[0].strip()[-400:] if lines else f"no '{want}' line"))
    failed = [l for l in consumer_log.splitlines() if FAILED_LOAD in l and "failed" in l]
    out.append(Check("PD: 0 loads filled with a stand-in", not failed, failed[0].strip()[-300:] if failed else "none"))
    return out


def leftover_checks(shm_before: set[str], shm_after: set[str], gpu_apps_after: list[str], free_before: int | None,
                    free_after: int | None, slack: int = 512 << 20) -> list[Check]:
    """Nothing of ours in /dev/shm, no process on the GPU and its free
    memory back (within slack) once every instance stopped."""
    ours = sorted(n for n in shm_after - shm_before if n.startswith("ecmooncake"))
    others = sorted(n for n in shm_after - shm_before if not n.startswith("ecmooncake"))
    out = [Check("/dev/shm: nothing of ecmooncake left", not ours, ", ".join(ours) or f"none (others new: {', '.join(others) or 'none'})")]
    out.append(Check("GPU: no process left", not gpu_apps_after, "; ".join(gpu_apps_after) or "none"))
    if free_before is None or free_after is None:
        out.append(Check("GPU: free memory back", False, "torch could not read the GPU's free memory"))
    else:
        out.append(Check("GPU: free memory back", free_after >= free_before - slack,
                         f"{free_before / 2**30:.2f} GiB free before, {free_after / 2**30:.2f} GiB after"))
    return out


def stats(values: list[float]) -> dict:
    v = sorted(x for x in values if x is not None)
    if not v:
        return {"n": 0}
    return {"n": len(v), "min": v[0], "p50": v[len(v) // 2], "max": v[-1], "mean": sum(v) / len(v)}


def request_table(rows: list[dict], items: dict[str, dict]) -> list[str]:
    """Per request: its image size, the baseline's and EPD's TTFT, and the
    connector's time of its item(s)."""
    lines = [f"{'#':>3} {'phase':<6} {'image':>9} {'base TTFT ms':>12} {'EPD TTFT ms':>11} {'connector ms':>12}  item"]
    for r in rows:
        conn = [items[h]["connector_ms"] for h in r.get("items", []) if items.get(h, {}).get("connector_ms") is not None]
        cms = ",".join(f"{c:.2f}" for c in conn) if conn else "-"
        hs = ",".join(h[:12] for h in r.get("items", [])) or ("(burst: see below)" if r["phase"] == "burst" else "-")
        b, e = r.get("base_ttft_ms"), r.get("epd_ttft_ms")
        lines.append(f"{r['index']:>3} {r['phase']:<6} {r['size']:>9} {(f'{b:.1f}' if b is not None else '-'):>12} "
                     f"{(f'{e:.1f}' if e is not None else '-'):>11} {cms:>12}  {hs}")
    return lines


def summarize(checks: list[Check], rows: list[dict], item_rows: list[dict], extra: dict) -> dict:
    by_hash = {it["mm_hash"]: it for it in item_rows}
    burst = [it["connector_ms"] for it in item_rows
             if not any(it["mm_hash"] in r.get("items", []) for r in rows) and it["connector_ms"] is not None]
    return {
        "passed": bool(checks) and all(c.ok for c in checks),
        "checks": [c.__dict__ for c in checks],
        "requests": rows,
        "items": item_rows,
        "ttft_ms": {
            "baseline": stats([r.get("base_ttft_ms") for r in rows if r["phase"] != "warmup"]),
            "epd": stats([r.get("epd_ttft_ms") for r in rows if r["phase"] != "warmup"]),
        },
        "connector_ms": {"all": stats([it["connector_ms"] for it in item_rows]), "burst_unassigned": stats(burst)},
        "items_by_hash": len(by_hash),
        **extra,
    }


def print_summary(summary: dict, out=sys.stdout) -> None:
    items = {it["mm_hash"]: it for it in summary["items"]}
    print("\n== per request", file=out)
    for line in request_table(summary["requests"], items):
        print(line, file=out)
    c = summary["connector_ms"]["all"]
    if c.get("n"):
        print(f"connector save_caches -> encoder_cache over {c['n']} items: min {c['min']:.2f} ms, p50 {c['p50']:.2f} ms, "
              f"max {c['max']:.2f} ms", file=out)
    for side in ("baseline", "epd"):
        t = summary["ttft_ms"][side]
        if t.get("n"):
            print(f"TTFT {side}: p50 {t['p50']:.1f} ms, max {t['max']:.1f} ms over {t['n']} requests (the warm-up left out)", file=out)
    print("\n== checks", file=out)
    for ch in summary["checks"]:
        print(f"{'PASS' if ch['ok'] else 'FAIL'}  {ch['name']}: {ch['detail']}", file=out)
    print(f"\n{'PASSED' if summary['passed'] else 'FAILED'}", file=out)


# --- the run on the GPU host ---------------------------------------------------

# Images of several sizes (the tiny model resizes to 56*56 .. 224*224
# pixels: 4 to 64 placeholder tokens), one at a time; then a burst of
# distinct images sent together.
SIZES = [(56, 56), (112, 112), (140, 84), (224, 224), (448, 336), (84, 196)]
BURST = 12
MAX_TOKENS = 8
TEXT = "What is in this image?"


def png(seed: int, size: tuple[int, int]) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def plan_requests() -> list[dict]:
    # The first request of an instance pays for its warm-up (lazy
    # compilation, allocations): sent to both and compared, it is left out
    # of the TTFT figures.
    reqs = [{"phase": "warmup", "size": "112x112", "seed": 99, "wh": (112, 112)}]
    reqs += [{"phase": "sizes", "size": f"{w}x{h}", "seed": 100 + i, "wh": (w, h)} for i, (w, h) in enumerate(SIZES)]
    reqs += [{"phase": "burst", "size": f"{w}x{h}", "seed": 200 + i, "wh": (w, h)}
             for i, (w, h) in enumerate(SIZES[i % len(SIZES)] for i in range(BURST))]
    for i, r in enumerate(reqs):
        r["index"] = i
    return reqs


def body(model: str, image: str) -> dict:
    return {
        "model": model,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "logprobs": True,
        "top_logprobs": 1,
        "return_tokens_as_token_ids": True,
        "stream": True,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": TEXT}]}],
    }


def stream_answer(url: str, payload: dict, timeout_s: float) -> dict:
    """One streamed chat request: its token ids, logprobs, and the time from
    sending it to the first token (CLOCK_MONOTONIC, as the trace's stamps)."""
    data = json.dumps(payload).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"})
    tokens: list[int] = []
    logprobs: list[float] = []
    sent = time.monotonic_ns()
    first = None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                chunk = line[5:].strip()
                if chunk == "[DONE]":
                    break
                msg = json.loads(chunk)
                if "error" in msg:
                    return {"error": f"stream error: {msg['error']}", "sent_ns": sent, "done_ns": time.monotonic_ns()}
                for choice in msg.get("choices", []):
                    for entry in (choice.get("logprobs") or {}).get("content") or []:
                        if first is None:
                            first = time.monotonic_ns()
                        tok = entry["token"]
                        if not tok.startswith("token_id:"):
                            return {"error": f"token {tok!r} is not in the token_id:N form", "sent_ns": sent, "done_ns": time.monotonic_ns()}
                        tokens.append(int(tok.split(":", 1)[1]))
                        logprobs.append(entry["logprob"])
    except urllib.error.HTTPError as exc:
        return {"error": f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:1500]}", "sent_ns": sent, "done_ns": time.monotonic_ns()}
    except Exception as exc:  # reported with the servers' logs
        return {"error": f"{type(exc).__name__}: {exc}", "sent_ns": sent, "done_ns": time.monotonic_ns()}
    done = time.monotonic_ns()
    return {"tokens": tokens, "logprobs": logprobs, "sent_ns": sent, "done_ns": done,
            "ttft_ms": (first - sent) / 1e6 if first is not None else None}


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def gpu_apps() -> list[str]:
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"nvidia-smi failed: {exc}"]
    return [l.strip() for l in done.stdout.splitlines() if l.strip()]


def gpu_free() -> int | None:
    """The GPU's free bytes, read by a fresh process (this one holds no
    CUDA context)."""
    try:
        done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info()[0])"],
                              capture_output=True, text=True, timeout=120)
        return int(done.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def vllm_gpu_argv(model: Path, port: int, *, ec: dict | None, encoder: bool, gpu_util: float, kv_bytes: int) -> list[str]:
    """vllm serve on the GPU: bf16, greedy-comparable (seed 0), one image
    per prompt. The KV cache is sized outright (--kv-cache-memory-bytes):
    the instances profile side by side, and a neighbour's allocations would
    otherwise count as this one's. The encoder-only instance runs eager
    (CUDA graph capture fails there on 0.26) with prefix caching off."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "16", "--seed", "0",
        "--limit-mm-per-prompt", json.dumps({"image": 1, "video": 0}),
        "--gpu-memory-utilization", str(gpu_util), "--kv-cache-memory-bytes", str(kv_bytes),
    ]
    if encoder:
        argv += ["--enforce-eager", "--no-enable-prefix-caching"]
    if ec is not None:
        argv += ["--ec-transfer-config", json.dumps(ec)]
    return argv


def on_cpu(argv: list[str]) -> list[str]:
    """The same instance on vLLM's CPU build, for a dry run of the
    orchestration on a machine without a GPU (--cpu-dry-run): float32,
    eager, no GPU memory flags, the slab in host memory. Its cuda_ipc and
    GPU checks fail there by design."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in ("--gpu-memory-utilization", "--kv-cache-memory-bytes"):
            skip = True
            continue
        if i > 0 and argv[i - 1] == "--dtype":
            a = "float32"
        if i > 0 and argv[i - 1] == "--ec-transfer-config":
            a = json.dumps({**json.loads(a), "ec_buffer_device": "cpu", "ec_buffer_size": 64 << 20})
        out.append(a)
    if "--enforce-eager" not in out:
        out.append("--enforce-eager")
    return out


def ec_config(role: str, ec_port: int, metrics_port: int) -> dict:
    """Our connector on loopback, its slab in GPU memory (vLLM's default
    ec_buffer_device): the encoder, on the same host, writes with cuda_ipc."""
    cfg = {
        "ec_connector": "ECMooncakeConnector",
        "ec_role": role,
        "ec_ip": "127.0.0.1",
        "ec_port": ec_port,
        "ec_connector_extra_config": {"transport": "tcp", "metrics_port": metrics_port},
    }
    if role == "ec_consumer":
        cfg["ec_buffer_size"] = 256 << 20
        cfg["ec_connector_extra_config"]["push_wait_timeout_s"] = 60
    return cfg


def server_env(site: Path, cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": str(site) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # FlashInfer is not carried.
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        # With an EC connector vLLM 0.26 takes its V1 model runner; the
        # baseline must run the same one to answer token for token alike.
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        "ECMOONCAKE_TRACE_LOG": "1",
        # Each instance compiles into a cache of its own: they start together.
        "VLLM_CACHE_ROOT": str(cache),
    })
    return env


class Deadline(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    root, out = Path(args.root), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The servers append to their logs, and readiness is read from them: an
    # earlier run's lines must not count.
    shutil.rmtree(out / "logs", ignore_errors=True)
    site, model = root / "site", root / "model"
    sys.path.insert(0, str(site))
    from ecmooncake.tools import fleet
    from ecmooncake.tools.harness import free_port_range

    t_end = time.monotonic() + args.budget_s

    def left(cap: float) -> float:
        rest = t_end - time.monotonic()
        if rest <= 5:
            raise Deadline(f"the run's budget of {args.budget_s:.0f} s is spent")
        return min(cap, rest)

    def on_term(signum, frame):
        raise Deadline(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    checks: list[Check] = []
    rows = plan_requests()
    extra: dict = {"vllm": VLLM_VERSION, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    shm_before = _shm()
    free_before = None if args.cpu_dry_run else gpu_free()
    apps_before = [] if args.cpu_dry_run else gpu_apps()
    extra["gpu_before"] = {"free_bytes": free_before, "apps": apps_before}
    base = free_port_range(10)
    port = {"base": base, "enc": base + 1, "pd": base + 2, "proxy": base + 3, "proxy_metrics": base + 4, "ec": base + 5,
            "pd_metrics": base + 6, "enc_metrics": base + 8}
    extra["ports"] = port
    d = fleet.Deployment(out / "logs", start_timeout_s=args.start_timeout_s)
    servers = {}
    item_rows: list[dict] = []
    failure = None
    try:
        print(f"== starting baseline, encoder and PD side by side (ports {port})", flush=True)
        t0 = time.monotonic()
        kv = args.kv_cache_bytes
        argvs = {
            "baseline": vllm_gpu_argv(model, port["base"], ec=None, encoder=False, gpu_util=args.gpu_util, kv_bytes=kv),
            "encoder": vllm_gpu_argv(model, port["enc"], ec=ec_config("ec_producer", port["ec"], port["enc_metrics"]), encoder=True,
                                     gpu_util=args.gpu_util, kv_bytes=kv),
            "pd": vllm_gpu_argv(model, port["pd"], ec=ec_config("ec_consumer", port["ec"], port["pd_metrics"]), encoder=False,
                                gpu_util=args.gpu_util, kv_bytes=kv),
        }
        for name, argv in argvs.items():
            env = server_env(site, root / "cache" / name)
            if args.cpu_dry_run:
                argv = on_cpu(argv)
                env.update(fleet.VLLM_ENV)
            servers[name] = d.start(name, argv, ready=fleet.VLLM_READY, env=env)
        d.start_timeout_s = left(args.start_timeout_s)
        d.wait_ready()
        extra["ready_s"] = {n: s.ready_after_s for n, s in servers.items()}
        print(f"== ready after {time.monotonic() - t0:.0f} s: " + ", ".join(f"{n} {s.ready_after_s:.0f} s" for n, s in servers.items()), flush=True)
        servers["proxy"] = d.start("proxy", fleet.proxy_argv(sys.executable, port["proxy"], port["proxy_metrics"],
                                                             [f"http://127.0.0.1:{port['enc']}"],
                                                             [(f"http://127.0.0.1:{port['pd']}", f"tcp://127.0.0.1:{port['ec']}")]),
                                   ready=fleet.PROXY_READY, env=server_env(site, root / "cache" / "proxy"))
        d.start_timeout_s = left(60)
        d.wait_ready()
        fleet.wait_healthy(f"http://127.0.0.1:{port['proxy']}", left(60))

        images = {r["index"]: png(r["seed"], r["wh"]) for r in rows}
        base_url, epd_url = f"http://127.0.0.1:{port['base']}", f"http://127.0.0.1:{port['proxy']}"
        answers: dict[str, list[dict]] = {"baseline": [None] * len(rows), "epd": [None] * len(rows)}
        sizes = [r for r in rows if r["phase"] in ("warmup", "sizes")]
        burst = [r for r in rows if r["phase"] == "burst"]
        print(f"== {len(sizes)} images of several sizes, one at a time, to the baseline then to EPD", flush=True)
        for r in sizes:
            for side, url in (("baseline", base_url), ("epd", epd_url)):
                answers[side][r["index"]] = stream_answer(url, body(str(model), images[r["index"]]), left(120))
        print(f"== a burst of {len(burst)} distinct images, all at once, to the baseline then to EPD", flush=True)
        for side, url in (("baseline", base_url), ("epd", epd_url)):
            timeout = left(180)
            with ThreadPoolExecutor(max_workers=len(burst)) as pool:
                got = list(pool.map(lambda r: stream_answer(url, body(str(model), images[r["index"]]), timeout), burst))
            for r, a in zip(burst, got):
                answers[side][r["index"]] = a
        for r in rows:
            b, e = answers["baseline"][r["index"]], answers["epd"][r["index"]]
            r.update({"base_ttft_ms": b.get("ttft_ms"), "epd_ttft_ms": e.get("ttft_ms"), "sent_ns": e["sent_ns"], "done_ns": e["done_ns"],
                      "base_tokens": b.get("tokens"), "epd_tokens": e.get("tokens"), "error": b.get("error") or e.get("error")})
        problems = compare_tokens(answers["baseline"], answers["epd"])
        checks.append(Check("answers token-identical to the baseline", not problems,
                            "; ".join(problems) if problems else f"{len(rows)} answers of {MAX_TOKENS} tokens alike"))
        lengths = {len(a.get("tokens") or []) for a in answers["baseline"]}
        checks.append(Check(f"every baseline answer {MAX_TOKENS} tokens", lengths == {MAX_TOKENS}, f"lengths {sorted(lengths)}"))
        distinct_answers = len({tuple(a.get("tokens") or []) for a in answers["baseline"]})
        extra["distinct_answers"] = distinct_answers

        scrape = {
            "proxy": fleet.scrape(f"http://127.0.0.1:{port['proxy_metrics']}/metrics"),
            "pd": "\n".join(fleet.scrape(f"http://127.0.0.1:{port['pd_metrics'] + i}/metrics") for i in (0, 1)),
            "encoder": "\n".join(fleet.scrape(f"http://127.0.0.1:{port['enc_metrics'] + i}/metrics") for i in (0, 1)),
            "pd_vllm": fleet.scrape(f"http://127.0.0.1:{port['pd']}/metrics"),
        }
        for name, text in scrape.items():
            (out / f"metrics_{name}.txt").write_text(text)
        checks += transfer_checks(scrape["proxy"], scrape["pd"], scrape["encoder"], len(rows), len(rows))
    except Exception as exc:  # every failure ends in the summary, with the logs
        failure = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, (Deadline, fleet.ServerError)):
            import traceback

            traceback.print_exc()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        producer_log = servers["encoder"].log_text() if "encoder" in servers else ""
        consumer_log = servers["pd"].log_text() if "pd" in servers else ""
        tails = "\n".join(f"----- {srv.name} ({srv.log_path}), last lines -----\n" + "\n".join(line[:400] for line in srv.tail(30).splitlines())
                          for srv in d.servers)
        d.stop()
    if failure:
        checks.append(Check("the run itself", False, failure))
    item_rows = item_times(producer_log, consumer_log)
    assign_items(rows, item_rows)
    if producer_log or consumer_log:
        checks += log_checks(producer_log, consumer_log)
        traced = [it for it in item_rows if it["connector_ms"] is not None]
        checks.append(Check("connector time traced for every image", len(traced) >= len(rows) and not failure,
                            f"{len(traced)} items with both stamps, {len(item_rows)} traced, {len(rows)} images"))
    # The processes are gone (stop() waits for each group); what is left is leaked.
    time.sleep(2)
    apps_after = [] if args.cpu_dry_run else gpu_apps()
    checks += leftover_checks(shm_before, _shm(), [a for a in apps_after if a not in apps_before], free_before,
                              None if args.cpu_dry_run else gpu_free())
    extra["gpu_after_apps"] = apps_after
    for r in rows:
        r.pop("wh", None)
    summary = summarize(checks, rows, item_rows, extra)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not summary["passed"]:
        # Before the summary, so that the summary ends the output.
        print("\n== the servers' last lines (full logs in " + str(out / "logs") + ")\n" + tails)
    print_summary(summary)
    print(f"summary: {out / 'summary.json'}")
    return 0 if summary["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack", help="write the two pieces (on the build machine)")
    pk.add_argument("--cache", required=True)
    pk.add_argument("--model", required=True)
    pk.add_argument("--wheel", required=True)
    pk.add_argument("--out1", required=True)
    pk.add_argument("--out2", required=True)
    pk.add_argument("--uv", default="uv")
    r = sub.add_parser("run", help="the EPD against the baseline (on the GPU host)")
    r.add_argument("--root", required=True, help="the folder the pieces were unpacked into")
    r.add_argument("--out", required=True, help="logs and summary.json")
    r.add_argument("--budget-s", type=float, default=420.0, help="bound on starting the servers and sending the requests; stopping them and the checks come after (default %(default)s)")
    r.add_argument("--start-timeout-s", type=float, default=300.0, help="the instances' start, together (default %(default)s)")
    r.add_argument("--gpu-util", type=float, default=0.12)
    r.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    r.add_argument("--cpu-dry-run", action="store_true",
                   help="run the orchestration on vLLM's CPU build (a float32 model in ROOT/model): its GPU checks fail by design")
    a = p.parse_args(argv)
    return pack(a) if a.cmd == "pack" else run(a)


if __name__ == "__main__":
    sys.exit(main())
