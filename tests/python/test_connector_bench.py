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
def test_bench_vllm_runs_both_connectors(tmp_path, transport):
    done = subprocess.run(
        [
            sys.executable, "-m", "ecmooncake", "bench-vllm", "--sizes-mb", "1", "--reps", "2", "--width", "1024",
            "--dir", str(tmp_path), "--transport", transport, "--json", "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["transport"] == transport
    (row,) = summary["sizes"]
    assert row["bytes"] == 1 << 20
    for key in ("example_ms", "ecmooncake_ms", "speedup", "tcp_ceiling_gbps", "memcpy_gbps"):
        assert row[key] > 0
    assert list(tmp_path.iterdir()) == [], "the bench removes its shared directory"
