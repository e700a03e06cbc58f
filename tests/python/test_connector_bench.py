"""`python -m ecmooncake bench-vllm` runs end to end: both connectors through
the same hooks, every loaded tensor compared with the encoder's (the command
exits non-zero when one differs). Small items; the figures are not judged."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import subprocess_env
from vllm_engine import require_vllm

require_vllm()

pytestmark = pytest.mark.usefixtures("library")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_bench_vllm_runs_both_connectors(tmp_path, tmp_path_factory, transport):
    plot = tmp_path_factory.mktemp("plot") / "bench-vllm.png"
    done = subprocess.run(
        [
            sys.executable, "-m", "ecmooncake", "bench-vllm", "--sizes-mb", "1", "--batches", "1", "2", "--reps", "2",
            "--width", "1024", "--dir", str(tmp_path), "--transport", transport, "--ceiling-mb", "16", "--json", "--quiet",
            "--plot", str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["transport"] == transport
    assert summary["ok"] is True
    cells = {(c["connector"], c["batch"]): c for c in summary["cells"]}
    assert set(cells) == {("example", 1), ("example", 2), ("ecmooncake", 1), ("ecmooncake", 2)}
    for c in cells.values():
        assert c["bytes"] == 1 << 20 and c["bit_exact"] is True
        assert c["items"] == 2 * c["batch"]
        for key in ("gb_per_s", "p50_ms", "p99_ms", "ceiling_gb_per_s", "ceiling_ratio"):
            assert c[key] > 0, key
    assert cells[("example", 2)]["ours_throughput_ratio"] > 0
    tcp = summary["ceilings"]["tcp"]
    assert tcp["params"]["processes"] == 2 and tcp["samples"] == 2
    assert "ceiling_exceeded" in summary
    assert list(tmp_path.iterdir()) == [], "the bench removes its shared directory"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "--plot draws the summary"


def test_bench_vllm_refuses_an_unknown_peer():
    done = subprocess.run(
        [sys.executable, "-m", "ecmooncake", "bench-vllm", "--peers", "example,nixl"],
        capture_output=True, text=True, timeout=120, env=subprocess_env(),
    )
    assert done.returncode == 2
    assert "unknown peer nixl" in done.stderr
