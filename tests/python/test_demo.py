"""The demo as a user runs it: separate processes, every byte verified."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env


@pytest.mark.usefixtures("library")
def test_demo_verifies_every_item():
    proc = subprocess.run(
        [sys.executable, "-m", "ecmooncake", "demo", "--items", "6", "--max-mb", "4", "--json"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    summary = json.loads(proc.stdout)
    assert summary["ok"] is True
    assert summary["items"] == 6
    assert summary["verified"] == 6
    assert summary["failed"] == 0 and summary["mismatched"] == 0
    assert summary["shards"] == 2
    assert summary["duplicates"] >= 1
    assert summary["ceiling"]["gb_per_s"] > 0
    assert "demo: 6/6 items" in proc.stderr


def test_demo_rejects_a_slab_too_small():
    proc = subprocess.run(
        [sys.executable, "-m", "ecmooncake", "demo", "--items", "2", "--max-mb", "8", "--slab-mb", "4"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "cannot hold two" in proc.stderr
