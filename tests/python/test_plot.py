"""``--plot`` of bench --sweep, bench-vllm and gpubench: throughput against
item size, one line per transport or peer, the ceilings as lines too, and
the sweep's latency. Drawn from small summaries shaped as each tool writes
them; no benchmark runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env
from ecmooncake.tools import plot

# build/setup.sh installs the package with its [plot] extra, so CI draws;
# a host without matplotlib skips the drawing tests, not the refusal ones.
drawing = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason=f"matplotlib not installed: {plot.INSTALL}")

MiB = 1 << 20
PNG = b"\x89PNG\r\n\x1a\n"

SIZES = [64 << 10, 256 << 10, 1 * MiB, 4 * MiB, 16 * MiB, 32 * MiB, 64 * MiB, 256 * MiB]


def _point(n: int, gbps: float, cap: float, p50: float) -> dict:
    return {"item_bytes": n, "batch": 1, "batches": 3, "bytes_per_sec": gbps * 1e9, "gb_per_s": gbps,
            "ceiling_gb_per_s": cap, "ceiling_ratio": gbps / cap, "failures": [],
            "latency_us": {"samples": 8, "p50": p50, "p99": 2 * p50}}


SWEEP = {
    "ok": True,
    "sweep": True,
    "host": "test CPU, 2 CPUs",
    "date": "2026-12-01 23:00 UTC",
    "load_average": {"before": [3.0, 2.0, 1.0], "after": [4.0, 3.0, 2.0]},
    "planes": {
        "tcp": {"ceiling_name": "TCP data plane alone", "ceiling_per_size": False,
                "points": [_point(n, 0.1 * (i + 1), 2.0, 100.0 * (i + 1)) for i, n in enumerate(SIZES)]},
        "shm": {"ceiling_name": "host copy", "ceiling_per_size": True,
                "points": [_point(n, 0.2 * (i + 1), 3.0 + i, 50.0 * (i + 1)) for i, n in enumerate(SIZES)]},
    },
}
BENCH_VLLM = {
    "host": "test CPU, 2 cores",
    "date": "2026-12-01 09:00 UTC",
    "transport": "shm",
    "gomaxprocs": 2,
    "connectors": {"ecmooncake": "ecmooncake ECMooncakeConnector", "example": "vLLM ECExampleConnector"},
    "cells": [
        {"connector": kind, "bytes": n * MiB, "batch": batch, "gb_per_s": rate * batch, "ceiling": which, "ceiling_gb_per_s": cap}
        for n in (4, 32, 128)
        for batch in (1, 8)
        for kind, rate, which, cap in (("example", 0.5, "copy_1", 3.0), ("ecmooncake", 1.0, "copy_gomaxprocs", 9.0))
    ],
}
GPUBENCH = {
    "date": "2026-12-01",
    "gpu": "test GPU",
    "devices": "cuda:0 -> cuda:1",
    "phases": [
        {"name": f"{plane}-{n}m", "transport": plane, "item_bytes": n * MiB, "inflight": inflight, "bytes_per_sec": rate * 1e9,
         "ceiling_bytes_per_sec": cap * 1e9}
        for plane, n, inflight, rate, cap in (
            ("cuda_ipc", 4, 1, 100.0, 300.0), ("cuda_ipc", 32, 1, 200.0, 350.0), ("cuda_ipc", 32, 32, 280.0, 350.0),
            ("tcp", 4, 1, 1.0, 2.0), ("tcp", 32, 1, 1.5, 2.0),
        )
    ],
}


def labels(figure) -> set[str]:
    (axes,) = figure.axes
    return {line.get_label() for line in axes.get_lines()}


@drawing
@pytest.mark.parametrize(
    "summary, want",
    [
        (
            SWEEP,
            {"ecmooncake over tcp", "ceiling of tcp: TCP data plane alone", "ecmooncake over shm", "ceiling of shm: host copy"},
        ),
        (
            BENCH_VLLM,
            {
                "ecmooncake ECMooncakeConnector over shm, batches of 1", "ecmooncake ECMooncakeConnector over shm, batches of 8",
                "vLLM ECExampleConnector, batches of 1", "vLLM ECExampleConnector, batches of 8",
                "ceiling: host copy, 1 thread", "ceiling: host copy, 2 threads",
            },
        ),
        (GPUBENCH, {"cuda_ipc", "cuda_ipc, 32 batches in flight", "tcp", "ceiling: cuda_ipc", "ceiling: tcp"}),
    ],
    ids=["bench-sweep", "bench-vllm", "gpubench"],
)
def test_one_line_per_transport_and_each_ceiling(summary, want, tmp_path):
    figure = plot.figure(summary)
    assert labels(figure) == want
    (axes,) = figure.axes
    assert axes.get_xscale() == "log" and "item size" in axes.get_xlabel() and "GB/s" in axes.get_ylabel()
    out = plot.write(summary, tmp_path / "plot.png")
    assert out.read_bytes()[:8] == PNG
    assert out.stat().st_size > 5000


@drawing
def test_a_summary_of_no_known_shape_is_refused(tmp_path):
    with pytest.raises(ValueError, match="bench --sweep, bench-vllm or gpubench"):
        plot.write({"ok": True}, tmp_path / "x.png")


@drawing
def test_a_sweep_has_a_marker_at_every_measured_size_and_nothing_between():
    (axes,) = plot.figure(SWEEP).axes
    lines = {line.get_label(): line for line in axes.get_lines()}
    for label in ("ecmooncake over tcp", "ecmooncake over shm", "ceiling of shm: host copy"):
        assert list(lines[label].get_xdata()) == SIZES, label
        assert lines[label].get_marker() not in (None, "None", ""), label
    flat = lines["ceiling of tcp: TCP data plane alone"]
    assert set(flat.get_ydata()) == {2.0} and flat.get_marker() in (None, "None", ""), "one value, drawn flat"
    assert [t.get_text() for t in axes.get_xticklabels()] == ["64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "32 MiB", "64 MiB", "256 MiB"]


@drawing
def test_a_sweep_draws_p50_and_p99_per_plane_on_log_log_axes():
    (axes,) = plot.latency_figure(SWEEP).axes
    lines = {line.get_label(): line for line in axes.get_lines()}
    assert set(lines) == {"tcp p50", "tcp p99", "shm p50", "shm p99"}
    assert axes.get_xscale() == "log" and axes.get_yscale() == "log" and "µs" in axes.get_ylabel()
    assert list(lines["shm p99"].get_ydata()) == [100.0 * (i + 1) for i in range(len(SIZES))]


@drawing
def test_a_sweep_above_its_ceiling_says_so_in_the_title():
    (axes,) = plot.figure(SWEEP | {"ceiling_warnings": ["shm 4 MiB items: 1.29 of its ceiling"]}).axes
    assert "1 point above its ceiling: not to be trusted" in axes.get_title()
    (axes,) = plot.figure(SWEEP).axes
    assert "ceiling" not in axes.get_title()


@drawing
def test_a_latency_plot_needs_a_sweep():
    with pytest.raises(ValueError, match="bench --sweep"):
        plot.latency_figure(GPUBENCH)


@drawing
@pytest.mark.parametrize(
    "target, want",
    [("out", ["out/bench-throughput.png", "out/bench-latency.png"]), ("run.png", ["run.png", "run-latency.png"])],
)
def test_a_sweep_goes_to_two_pngs(target, want, tmp_path):
    paths = plot.write_all(SWEEP, tmp_path / target)
    assert paths == [tmp_path / w for w in want]
    for path in paths:
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5000


@drawing
def test_a_saved_summary_is_drawn_again_from_the_command_line(tmp_path):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(SWEEP))
    done = subprocess.run(
        [sys.executable, "-m", "ecmooncake.tools.plot", str(saved), str(tmp_path / "again.png")],
        capture_output=True, text=True, timeout=120, env=subprocess_env(),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "again.png").read_bytes()[:8] == PNG
    assert (tmp_path / "again-latency.png").read_bytes()[:8] == PNG


@drawing
def test_a_saved_file_that_is_no_summary_is_refused_from_the_command_line(tmp_path):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"ok": True}))
    done = subprocess.run(
        [sys.executable, "-m", "ecmooncake.tools.plot", str(saved), str(tmp_path / "x.png")],
        capture_output=True, text=True, timeout=120, env=subprocess_env(),
    )
    assert done.returncode == 2 and "not a summary" in done.stderr and not (tmp_path / "x.png").exists()


BLOCKED = """
import sys
sys.modules["matplotlib"] = None  # as on a host without it
from ecmooncake.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", [["bench"], ["bench-vllm"], ["gpubench"]])
def test_without_matplotlib_plot_fails_at_once_saying_what_to_install(command, tmp_path):
    target = tmp_path / "x.png"
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED, *command, "--plot", str(target)], capture_output=True, text=True, timeout=120, env=subprocess_env()
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pip install 'ecmooncake[plot]'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not target.exists(), "refused before any measurement"


def test_the_plot_extra_is_declared():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["plot"] == ["matplotlib"]
