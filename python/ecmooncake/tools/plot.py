"""``--plot`` of the benchmarks: throughput (and, for ``bench --sweep``,
latency) against item size.

One line per transport (or peer, or connector) and one per ceiling measured
in the same run, so that a figure is read as a ratio, as the text summaries
are. The input is the summary dict a tool prints with ``--json``; matplotlib
is optional (``pip install 'ecmooncake[plot]'``) and imported only here.
``python -m ecmooncake.tools.plot run.json OUT`` draws a saved summary again.
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
    # One value for every size (a ceiling measured once): a flat line.
    flat: bool = False

    def add(self, nbytes: int, gbps: float) -> None:
        self.sizes.append(int(nbytes))
        self.gbps.append(float(gbps))


def _sweep(s: dict) -> tuple[str, list[Series]]:
    lines: list[Series] = []
    for plane, body in s["planes"].items():
        points = sorted(body["points"], key=lambda p: p["item_bytes"])
        line = Series(f"ecmooncake over {plane}", group=plane)
        ceiling = Series(f"ceiling of {plane}: {body['ceiling_name']}", ceiling=True, group=plane)
        # A ceiling measured once, with bulk transfers, is one value for
        # every size: drawn flat, without markers that would claim more.
        ceiling.flat = not body.get("ceiling_per_size", True)
        for p in points:
            line.add(p["item_bytes"], p["bytes_per_sec"] / GB)
            ceiling.add(p["item_bytes"], p["ceiling_gb_per_s"])
        lines += [line, ceiling]
    return _sweep_title(s, "bench --sweep: host memory, one consumer shard over loopback"), lines


def _sweep_title(s: dict, head: str) -> str:
    load = s.get("load_average") or {}
    tail = ", ".join(
        x
        for x in (
            s.get("host", ""),
            s.get("date", ""),
            f"load average {load['before'][0]:.1f}/{load['after'][0]:.1f} before/after" if load else "",
        )
        if x
    )
    warned = len(s.get("ceiling_warnings") or [])
    if warned:
        tail += f"; {warned} point{'s' if warned > 1 else ''} above {'their' if warned > 1 else 'its'} ceiling: not to be trusted"
    return head + (f"\n{tail}" if tail else "")


def latency_series(s: dict) -> tuple[str, list[Series]]:
    """p50 and p99 per item against item size, one pair per plane, of a
    sweep summary; the values are microseconds (in ``gbps``)."""
    if not s.get("sweep"):
        raise ValueError("a latency plot needs a summary of bench --sweep")
    lines: list[Series] = []
    for plane, body in s["planes"].items():
        p50 = Series(f"{plane} p50", group=plane)
        p99 = Series(f"{plane} p99", group=plane, ceiling=True)
        for p in sorted(body["points"], key=lambda p: p["item_bytes"]):
            lat = p["latency_us"]
            if lat.get("p50") is not None:
                p50.add(p["item_bytes"], lat["p50"])
                p99.add(p["item_bytes"], lat["p99"])
        lines += [p50, p99]
    return _sweep_title(s, "bench --sweep: one item's push, submit to done (single-item pushes)"), lines


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
    """The title and lines of a summary of bench --sweep, bench-vllm or gpubench."""
    if summary.get("sweep"):
        return _sweep(summary)
    if "cells" in summary:
        return _bench_vllm(summary)
    if "phases" in summary:
        return _gpubench(summary)
    raise ValueError(f"not a summary of bench --sweep, bench-vllm or gpubench (keys: {', '.join(sorted(summary))})")


def size_label(nbytes: float) -> str:
    """An item size as the plots and the benches print it: "64 KiB", "32 MiB"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def _axes(title: str, lines: list[Series], ylabel: str, log_y: bool | None) -> Any:
    """A Figure with lines drawn over item size on a log axis: a measured
    line has a marker at every measured size and is joined only between
    them; a flat line is one value for every size."""
    require()
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    fig = Figure(figsize=(8, 4.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    sizes = sorted({n for line in lines for n in line.sizes})
    colours: dict[str, Any] = {}
    greys = iter(["0.35", "0.6", "0.8"])
    for line in lines:
        if not line.sizes:
            continue
        if line.ceiling:
            colour = (colours.get(line.group) if line.group else None) or next(greys, "0.5")
            marker = None if line.flat else "x"
            ax.plot(line.sizes, line.gbps, label=line.label, linestyle="--", linewidth=1.3, color=colour, marker=marker)
        else:
            (drawn,) = ax.plot(line.sizes, line.gbps, label=line.label, marker="o", linewidth=2)
            if line.group:
                colours.setdefault(line.group, drawn.get_color())
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(sizes, [size_label(n) for n in sizes])
    ax.set_xlabel("item size")
    ax.set_ylabel(ylabel)
    values = [v for line in lines for v in line.gbps if v > 0]
    if log_y is None:
        # Transports a hundredfold apart (cuda_ipc and TCP) both stay readable.
        log_y = bool(values) and max(values) > 30 * min(values)
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def figure(summary: dict, note: str = "") -> Any:
    """A matplotlib Figure of throughput against item size (no pyplot: no
    global state)."""
    require()
    title, lines = series(summary)
    return _axes(title + (f"\n{note}" if note else ""), lines, "throughput, GB/s", None)


def latency_figure(summary: dict, note: str = "") -> Any:
    """A matplotlib Figure of a sweep's p50 and p99 per item, log-log."""
    require()
    title, lines = latency_series(summary)
    return _axes(title + (f"\n{note}" if note else ""), lines, "latency per item, µs", True)


def write(summary: dict, path: str | Path, note: str = "") -> Path:
    """Draws the summary's throughput into a PNG at path; returns the path."""
    out = Path(path)
    figure(summary, note).savefig(out, format="png")
    return out


def targets(summary: dict, target: str | Path) -> list[Path]:
    """Where write_all draws: for a sweep, throughput and latency (into a
    directory as bench-throughput.png and bench-latency.png, or FILE.png and
    FILE-latency.png); else one PNG (a directory gets plot.png)."""
    out = Path(target)
    is_dir = out.is_dir() or out.suffix.lower() != ".png"
    if summary.get("sweep"):
        if is_dir:
            return [out / "bench-throughput.png", out / "bench-latency.png"]
        return [out, out.with_name(out.stem + "-latency.png")]
    return [out / "plot.png"] if is_dir else [out]


def write_all(summary: dict, target: str | Path, note: str = "") -> list[Path]:
    """Draws every figure of the summary (see :func:`targets`); returns the paths."""
    paths = targets(summary, target)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
    figure(summary, note).savefig(paths[0], format="png")
    if len(paths) > 1:
        latency_figure(summary, note).savefig(paths[1], format="png")
    return paths


def main(argv: list[str] | None = None) -> int:
    """``python -m ecmooncake.tools.plot SUMMARY.json DIR_OR_FILE``: draws a
    saved ``--json`` summary again, no measurement."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(prog="python -m ecmooncake.tools.plot", description=main.__doc__)
    parser.add_argument("summary", help="a summary a tool printed with --json")
    parser.add_argument("target", help="FILE.png or a directory")
    parser.add_argument("--note", default="", help="a line added to the title")
    args = parser.parse_args(argv)
    try:
        with open(args.summary) as f:
            summary = json.load(f)
        for path in write_all(summary, args.target, args.note):
            print(f"plot written to {path}")
    except PlotUnavailable as exc:
        print(f"ecmooncake plot: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError) as exc:
        print(f"ecmooncake plot: {args.summary}: {exc!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
