"""Mooncake's own GPU-to-GPU figures on this host, the ceiling of the
``mooncake`` rows of the connector bench: two processes, each with its own
``mooncake.engine.TransferEngine`` (the wheel's Python API, no ecmooncake),
a GPU buffer registered on each, and ``batch_transfer_sync_write`` moving
the same sizes and batches the bench moves, checked bit for bit.

It also measures what decides how an encoder output should leave a
producer with a CUDA engine: registering the output itself for each write
(``register_memory`` of a fresh buffer, with nothing and with 16 buffers
registered already, then ``unregister_memory``) against a device-to-device
copy of it into a buffer registered once (what the library does).

Run by ``bash build/gpu_run.sh mooncake``; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

MiB = 1 << 20


def _engine(host: str, protocol: str) -> Any:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    rc = te.initialize(host, "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}")
    return te


def _use(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)


def _sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _location(device: str) -> str:
    """Mooncake's name for where memory lives ("cpu" is "*": any NUMA node)."""
    return device if device.startswith("cuda") else "*"


def _pattern(torch: Any, n: int, seed: int, device: str) -> Any:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)


def _target(conn: Any, host: str, protocol: str, device: str, nbytes: int) -> None:
    """The receiving engine: a registered GPU buffer, checked on demand."""
    import torch

    _use(torch, device)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    te = _engine(host, protocol)
    rc = te.register_memory(buf.data_ptr(), nbytes, _location(device))
    if rc != 0:
        conn.send({"error": f"register_memory of the {nbytes}-byte GPU buffer on {device} returned {rc}"})
        return
    conn.send({"segment": f"{host}:{te.get_rpc_port()}", "base": buf.data_ptr()})
    while True:
        msg = conn.recv()
        if msg is None:
            break
        n, seeds = msg
        ok = all(bool(torch.equal(buf[i * n : (i + 1) * n], _pattern(torch, n, s, device))) for i, s in enumerate(seeds))
        buf.zero_()
        _sync(torch, device)
        conn.send(ok)
    te.unregister_memory(buf.data_ptr())


def ceiling(args: argparse.Namespace) -> dict:
    import torch

    device = args.device
    _use(torch, device)
    largest = max(args.sizes) * MiB * max(args.batches)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, args.host, args.protocol, device, largest), daemon=True)
    proc.start()
    try:
        hello = parent.recv() if parent.poll(120) else {"error": "the target engine did not start within 120 s"}
        if "error" in hello:
            raise RuntimeError(hello["error"])
        seg, base = hello["segment"], hello["base"]
        te = _engine(args.host, args.protocol)
        src = torch.empty(largest, dtype=torch.uint8, device=device)
        rc = te.register_memory(src.data_ptr(), largest, _location(device))
        if rc != 0:
            raise RuntimeError(f"register_memory of the {largest}-byte GPU source returned {rc}")
        rows = []
        for mib in args.sizes:
            n = mib * MiB
            for batch in args.batches:
                seeds = [mib * 100 + batch * 10 + i for i in range(batch)]
                for i, s in enumerate(seeds):
                    src[i * n : (i + 1) * n].copy_(_pattern(torch, n, s, device))
                _sync(torch, device)
                srcs = [src.data_ptr() + i * n for i in range(batch)]
                dsts = [base + i * n for i in range(batch)]
                times = []
                for rep in range(args.warmup + args.reps):
                    t0 = time.perf_counter()
                    rc = te.batch_transfer_sync_write(seg, srcs, dsts, [n] * batch)
                    took = time.perf_counter() - t0
                    if rc != 0:
                        raise RuntimeError(f"batch_transfer_sync_write of {batch} x {mib} MiB returned {rc}")
                    if rep == 0:
                        parent.send((n, seeds))
                        if not parent.recv():
                            raise RuntimeError(f"{batch} x {mib} MiB: the target's bytes differ from the source's")
                    if rep >= args.warmup:
                        times.append(took)
                med = statistics.median(times)
                rows.append({"mib": mib, "batch": batch, "batch_s": med, "gbps": batch * n / med / 1e9, "bit_exact": True})
                print(f"mooncake engine {mib:>4} MiB x {batch}: {med * 1e3:8.2f} ms per batch ({batch * n / med / 1e9:.2f} GB/s), bit-exact", flush=True)
        te.unregister_memory(src.data_ptr())
        staging = register_vs_copy(te, torch, args.sizes, device, args.reps)
        return {"rows": rows, "register_vs_copy": staging, "protocol": args.protocol}
    finally:
        try:
            parent.send(None)
        except OSError:
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def register_vs_copy(te: Any, torch: Any, sizes: list[int], device: str, reps: int) -> list[dict]:
    """Per size: registering a fresh output and unregistering it (with 0 and
    with 16 other buffers registered), against a device copy of it into a
    buffer registered once."""
    rows = []
    for mib in sizes:
        n = mib * MiB
        out = torch.empty(n, dtype=torch.uint8, device=device)
        staging = torch.empty(n, dtype=torch.uint8, device=device)
        figures: dict[str, Any] = {"mib": mib}
        for held in (0, 16):
            others = [torch.empty(MiB, dtype=torch.uint8, device=device) for _ in range(held)]
            for o in others:
                te.register_memory(o.data_ptr(), MiB, _location(device))
            reg, unreg = [], []
            for _ in range(reps):
                fresh = torch.empty(n, dtype=torch.uint8, device=device)
                t0 = time.perf_counter()
                rc = te.register_memory(fresh.data_ptr(), n, _location(device))
                t1 = time.perf_counter()
                te.unregister_memory(fresh.data_ptr())
                t2 = time.perf_counter()
                if rc != 0:
                    raise RuntimeError(f"register_memory of {mib} MiB returned {rc}")
                reg.append(t1 - t0)
                unreg.append(t2 - t1)
            for o in others:
                te.unregister_memory(o.data_ptr())
            figures[f"register_s_with_{held}"] = statistics.median(reg)
            figures[f"unregister_s_with_{held}"] = statistics.median(unreg)
        copies = []
        for _ in range(reps + 2):
            if not device.startswith("cuda"):
                t0 = time.perf_counter()
                staging.copy_(out)
                copies.append(time.perf_counter() - t0)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            staging.copy_(out)
            end.record()
            end.synchronize()
            copies.append(start.elapsed_time(end) / 1e3)
        figures["device_copy_s"] = statistics.median(copies[2:])
        rows.append(figures)
        print(
            f"register {mib:>4} MiB: {figures['register_s_with_0'] * 1e3:7.3f} ms (+{figures['unregister_s_with_0'] * 1e3:.3f} ms to unregister), "
            f"{figures['register_s_with_16'] * 1e3:7.3f} ms with 16 registered; device copy into staging {figures['device_copy_s'] * 1e3:7.3f} ms",
            flush=True,
        )
    return rows


def compare(ours: dict, engine: dict) -> list[str]:
    """The table that puts the connector bench's mooncake rows beside the
    engine's own figures for the same bytes (ratio: engine time over ours,
    1.0 when the connector costs nothing on top), then the register
    against copy figures."""
    by_size = {(r["mib"], r["batch"]): r for r in ours.get("rows", []) if r.get("path", "mooncake") == "mooncake"}
    lines = [
        f"mooncake GPU -> GPU ({engine.get('protocol', '?')}): through the connector's hooks against the engine's own batch_transfer_sync_write",
        "%8s %6s %12s %12s %8s" % ("MiB", "batch", "ours ms", "engine ms", "ratio"),
    ]
    for c in engine.get("rows", []):
        o = by_size.get((c["mib"], c["batch"]))
        if o is None:
            lines.append("%8d %6d %12s %12.2f %8s" % (c["mib"], c["batch"], "-", c["batch_s"] * 1e3, "-"))
            continue
        lines.append("%8d %6d %12.2f %12.2f %8.3f" % (c["mib"], c["batch"], o["batch_s"] * 1e3, c["batch_s"] * 1e3, c["batch_s"] / o["batch_s"]))
    staging = engine.get("register_vs_copy") or []
    if staging:
        lines.append("an encoder output's way into registered memory: register it for each write (and unregister), or copy it into staging registered once")
        lines.append("%8s %14s %16s %14s" % ("MiB", "register ms", "with 16 held", "copy ms"))
        for r in staging:
            lines.append(
                "%8d %14.3f %16.3f %14.3f"
                % (r["mib"], (r["register_s_with_0"] + r["unregister_s_with_0"]) * 1e3, (r["register_s_with_16"] + r["unregister_s_with_16"]) * 1e3, r["device_copy_s"] * 1e3)
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ecmooncake.tools.mooncake_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 32, 128], help="MiB per item")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda:0", help="cpu runs the same steps in host memory (a check of the tool without a GPU)")
    p.add_argument("--host", default="127.0.0.1", help="the address both engines name themselves by")
    p.add_argument("--protocol", default="tcp")
    p.add_argument("--json", default="")
    p.add_argument("--compare", nargs=2, metavar=("CONNECTOR_JSON", "CEILING_JSON"), help="print the connector bench's mooncake rows against the ceiling, and exit")
    args = p.parse_args(argv)
    if args.compare:
        with open(args.compare[0]) as a, open(args.compare[1]) as b:
            print("\n".join(compare(json.load(a), json.load(b))))
        return 0
    print("mooncake engine GPU -> GPU ceiling (its Python API, batch_transfer_sync_write), median of", args.reps, flush=True)
    out = ceiling(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
