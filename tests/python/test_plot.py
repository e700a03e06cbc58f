"""``--plot FILE.png`` of bench, bench-vllm and gpubench: throughput against
item size, one line per transport or peer, the ceilings as lines too. Drawn
from small summaries shaped as each tool writes them; no benchmark runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env
from ecmooncake.tools import plot

MiB = 1 << 20
PNG = b"\x89PNG\r\n\x1a\n"

BENCH = {
    "ok": True,
    "transport": "tcp",
    "ceiling": {"name": "Go TCP across processes", "gb_per_s": 3.2, "params": {"conns": 4}},
    "large": {"item_bytes": 32 * MiB, "bytes_per_sec": 2.1e9},
    "small": {"item_bytes": 64 << 10, "bytes_per_sec": 0.4e9},
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


@pytest.mark.parametrize(
    "summary, want",
    [
        (BENCH, {"ecmooncake over tcp", "ceiling: Go TCP across processes"}),
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
    ids=["bench", "bench-vllm", "gpubench"],
)
def test_one_line_per_transport_and_each_ceiling(summary, want, tmp_path):
    figure = plot.figure(summary)
    assert labels(figure) == want
    (axes,) = figure.axes
    assert axes.get_xscale() == "log" and "item size" in axes.get_xlabel() and "GB/s" in axes.get_ylabel()
    out = plot.write(summary, tmp_path / "plot.png")
    assert out.read_bytes()[:8] == PNG
    assert out.stat().st_size > 5000


def test_a_summary_of_no_known_shape_is_refused(tmp_path):
    with pytest.raises(ValueError, match="bench, bench-vllm or gpubench"):
        plot.write({"ok": True}, tmp_path / "x.png")


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
