"""``--plot FILE.png`` of the benchmarks: throughput against item size.

One line per transport (or peer, or connector) and one per ceiling measured
in the same run, so that a figure is read as a ratio, as the text summaries
are. The input is the summary dict a tool prints with ``--json``; matplotlib
is optional (``pip install 'ecmooncake[plot]'``) and imported only here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GB = 1e9
INSTALL = "pip install 'ecmooncake[plot]'"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require() -> None:
    """Raises PlotUnavailable, saying what to install, before any work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed ({exc}): {INSTALL} (or pip install matplotlib)") from None


@dataclass
class Series:
    label: str
    sizes: list[int] = field(default_factory=list)  # item bytes
    gbps: list[float] = field(default_factory=list)
    ceiling: bool = False
    # A ceiling of one transport is drawn in that transport's colour.
    group: str = ""

    def add(self, nbytes: int, gbps: float) -> None:
        self.sizes.append(int(nbytes))
        self.gbps.append(float(gbps))


def _bench(s: dict) -> tuple[str, list[Series]]:
    line = Series(f"ecmooncake over {s.get('transport', 'tcp')}", group="ours")
    phases = sorted((s[k] for k in ("small", "large") if k in s), key=lambda p: p["item_bytes"])
    for phase in phases:
        line.add(phase["item_bytes"], phase["bytes_per_sec"] / GB)
    c = s["ceiling"]
    # Measured with large transfers, before and after: one value for every size.
    ceiling = Series(f"ceiling: {c['name']}", ceiling=True, group="ours")
    for phase in phases:
        ceiling.add(phase["item_bytes"], c["gb_per_s"])
    return "ecmooncake bench: one consumer shard over loopback", [line, ceiling]


def _ceiling_name(which: str, s: dict) -> str:
    names = {"tcp": "TCP data plane alone", "copy_1": "host copy, 1 thread", "copy_gomaxprocs": f"host copy, {s.get('gomaxprocs', 'GOMAXPROCS')} threads"}
    return names.get(which, which)


def _bench_vllm(s: dict) -> tuple[str, list[Series]]:
    names = s.get("connectors") or {}
    batches = {c["batch"] for c in s["cells"]}
    lines: dict[str, Series] = {}
    ceilings: dict[str, Series] = {}
    for c in sorted(s["cells"], key=lambda c: (c["bytes"], c["batch"])):
        name = names.get(c["connector"], c["connector"])
        if c["connector"] == "ecmooncake":
            name += f" over {s.get('transport', 'tcp')}"
        label = name if len(batches) == 1 else f"{name}, batches of {c['batch']}"
        lines.setdefault(label, Series(label)).add(c["bytes"], c["gb_per_s"])
        which = c["ceiling"]
        ceiling = ceilings.setdefault(which, Series(f"ceiling: {_ceiling_name(which, s)}", ceiling=True))
        if c["bytes"] not in ceiling.sizes:
            ceiling.add(c["bytes"], c["ceiling_gb_per_s"])
    title = "bench-vllm: save_caches to the tensor in the PD worker's encoder cache"
    if s.get("host"):
        title += f"\n{s['host']}" + (f", {s['date']}" if s.get("date") else "")
    return title, [*lines.values(), *ceilings.values()]


def _gpubench(s: dict) -> tuple[str, list[Series]]:
    lines: dict[str, Series] = {}
    ceilings: dict[str, Series] = {}
    for r in sorted(s["phases"], key=lambda r: r["item_bytes"]):
        plane = r["transport"]
        inflight = r.get("inflight", 1)
        label = plane if inflight == 1 else f"{plane}, {inflight} batches in flight"
        lines.setdefault(label, Series(label, group=plane)).add(r["item_bytes"], r["bytes_per_sec"] / GB)
        ceiling = ceilings.setdefault(plane, Series(f"ceiling: {plane}", ceiling=True, group=plane))
        if r["item_bytes"] not in ceiling.sizes:
            ceiling.add(r["item_bytes"], r["ceiling_bytes_per_sec"] / GB)
    title = f"gpubench: {s.get('gpu', 'GPU')}, {s.get('devices', '')}, {s.get('date', '')}".rstrip(", ")
    return title, [*lines.values(), *ceilings.values()]


def series(summary: dict) -> tuple[str, list[Series]]:
    """The title and lines of a summary of bench, bench-vllm or gpubench."""
    if "large" in summary and "ceiling" in summary:
        return _bench(summary)
    if "cells" in summary:
        return _bench_vllm(summary)
    if "phases" in summary:
        return _gpubench(summary)
    raise ValueError(f"not a summary of bench, bench-vllm or gpubench (keys: {', '.join(sorted(summary))})")


def _size_label(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def figure(summary: dict, note: str = "") -> Any:
    """A matplotlib Figure of the summary (no pyplot: no global state)."""
    require()
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    title, lines = series(summary)
    fig = Figure(figsize=(7.5, 4.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    sizes = sorted({n for line in lines for n in line.sizes})
    colours: dict[str, Any] = {}
    greys = iter(["0.35", "0.6", "0.8"])
    for line in lines:
        if line.ceiling:
            colour = (colours.get(line.group) if line.group else None) or next(greys, "0.5")
            ax.plot(line.sizes, line.gbps, label=line.label, linestyle="--", linewidth=1.3, color=colour)
        else:
            (drawn,) = ax.plot(line.sizes, line.gbps, label=line.label, marker="o", linewidth=2)
            if line.group:
                colours.setdefault(line.group, drawn.get_color())
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([_size_label(n) for n in sizes])
    ax.set_xlabel("item size")
    ax.set_ylabel("throughput, GB/s")
    values = [v for line in lines for v in line.gbps if v > 0]
    if values and max(values) > 30 * min(values):
        # Transports a hundredfold apart (cuda_ipc and TCP) both stay readable.
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=10)
    ax.legend(fontsize=8)
    return fig


def write(summary: dict, path: str | Path, note: str = "") -> Path:
    """Draws the summary into a PNG at path; returns the path."""
    out = Path(path)
    figure(summary, note).savefig(out, format="png")
    return out
