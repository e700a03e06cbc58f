"""``bench --sweep``: its plan of sizes, its ratios and their flag, the copy
ceiling of the shm plane, and one tiny sweep run as a user runs it. No
assertion on a rate beyond its being measured."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stderr

import pytest

from conftest import subprocess_env
from ecmooncake.tools import ceiling, sweep

KiB, MiB = 1 << 10, 1 << 20


def test_the_default_sweep_spans_64_kib_to_256_mib_in_at_least_8_sizes_each_moving_about_the_same():
    steps = sweep.plan()
    assert len(steps) >= 8
    assert steps[0].item_bytes == 64 * KiB and steps[-1].item_bytes == 256 * MiB
    assert [s.item_bytes for s in steps] == sorted(s.item_bytes for s in steps)
    moved = [s.item_bytes * s.batch * s.batches for s in steps]
    # Every size moves at least the sweep's bytes, and none more than the
    # minimum batches of the largest item.
    assert min(moved) >= sweep.TOTAL_BYTES and max(moved) <= sweep.MIN_BATCHES * 256 * MiB
    for s in steps:
        assert 1 <= s.batch <= sweep.MAX_BATCH and s.batch_bytes <= max(sweep.BATCH_BYTES, s.item_bytes)
        assert sweep.MIN_REPS <= s.reps <= sweep.MAX_REPS and s.batches >= sweep.MIN_BATCHES


@pytest.mark.parametrize(
    "text, want",
    [("64K,1M,256M", [64 * KiB, MiB, 256 * MiB]), ("64KiB, 1.5MB", [64 * KiB, int(1.5 * MiB)]), ("1G", [1 << 30]), ("4096", [4096])],
)
def test_sizes_are_read_with_their_units(text, want):
    assert sweep.parse_sizes(text) == want


@pytest.mark.parametrize("text, why", [("", "no item sizes"), ("64Q", "want a number"), ("0K", "not positive"), ("-1M", "not positive")])
def test_a_bad_size_is_refused_saying_why(text, why):
    with pytest.raises(ValueError, match=why):
        sweep.parse_sizes(text)


def _summary(tcp_rate: float, shm_rate: float, failures: list[str] | None = None) -> dict:
    """A sweep summary as run() hands it to finish(): rates and ceilings, no ratios yet."""

    def point(n: int, rate: float, cap: float) -> dict:
        return {"item_bytes": n, "batch": 4, "batches": 3, "bytes_per_sec": rate * 1e9, "failures": list(failures or []),
                "ceiling": {"gb_per_s": cap, "text": f"a ceiling of {cap} GB/s"},
                "latency_us": {"samples": 4, "p50": 10.0, "p99": 20.0}}

    return {
        "host": "test CPU, 2 CPUs", "date": "2026-12-01 23:00 UTC", "gomaxprocs": 2, "tcp_conns": 4, "seconds": 1.0,
        "load_average": {"before": [1.0, 1.0, 1.0], "after": [2.0, 1.0, 1.0]},
        "planes": {
            "tcp": {"ceiling_name": "TCP", "ceiling_per_size": False, "points": [point(64 * KiB, tcp_rate, 2.0)]},
            "shm": {"ceiling_name": "copy", "ceiling_per_size": True, "points": [point(MiB, shm_rate, 4.0)]},
        },
        "unmeasured": {"mooncake": "not here"},
    }


def test_each_point_gets_its_ratio_to_its_own_ceiling():
    s = sweep.finish(_summary(1.0, 3.0))
    tcp, shm = s["planes"]["tcp"]["points"][0], s["planes"]["shm"]["points"][0]
    assert tcp["ceiling_ratio"] == pytest.approx(0.5) and shm["ceiling_ratio"] == pytest.approx(0.75)
    assert tcp["gb_per_s"] == pytest.approx(1.0) and shm["ceiling_gb_per_s"] == pytest.approx(4.0)
    assert s["ok"] and not s["ceiling_exceeded"]


def test_a_point_above_its_ceiling_is_warned_about_and_flags_the_summary():
    err = io.StringIO()
    with redirect_stderr(err):
        s = sweep.finish(_summary(1.0, 5.0))
    assert s["ceiling_exceeded"] and s["ceiling_warnings"] == [
        "shm 1 MiB items: 1.25 of its ceiling, above 1.02: the ceiling is not one (a benchmark bug)"
    ]
    assert "WARNING: shm 1 MiB items: 1.25 of its ceiling" in err.getvalue()
    text = sweep.format_summary(s)
    assert text.startswith("  !!! CEILING EXCEEDED") and text.rstrip().endswith("(a benchmark bug)")
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == ["shm"]]
    assert ["shm", "1", "MiB", "4", "x", "3", "5.000", "4.00", "1.25", "10", "20", "(4)"] in rows


def test_a_failed_item_fails_the_sweep():
    assert not sweep.finish(_summary(1.0, 1.0, failures=["t1: timed out"]))["ok"]


def test_an_unknown_plane_is_refused_before_any_work():
    with pytest.raises(ValueError, match="not udp"):
        sweep.run(planes=["tcp", "udp"])


@pytest.mark.usefixtures("library")
def test_the_copy_ceiling_is_the_planes_copy_with_the_workers_gomaxprocs():
    copy = ceiling.HostCopyCeiling(64 * KiB, 4, gomaxprocs=2, rounds=2)
    copy.measure(ceiling.BEFORE)
    copy.measure(ceiling.AFTER)
    book = copy.book.as_dict()
    assert book["primary"] == 2 and book["samples"] == 2 and book["gb_per_s"] > 0
    assert "shm plane's own copy of 4 x 64 KiB" in book["text"] and "GOMAXPROCS 2" in book["text"]
    assert ceiling.HostCopyCeiling(256 * MiB, 1, 2).rounds == 5 and ceiling.HostCopyCeiling(64 * KiB, 1, 2).rounds == 20


@pytest.mark.usefixtures("library")
def test_a_copy_the_command_refuses_is_a_ceiling_error():
    with pytest.raises(ceiling.CeilingError, match="copy ceiling"):
        ceiling.host_copy_rate(0, 1, 2, 1)


def test_a_copy_ceiling_of_no_bytes_is_refused():
    with pytest.raises(ValueError, match="positive"):
        ceiling.HostCopyCeiling(0, 1, 1)


@pytest.mark.usefixtures("library")
def test_a_tiny_sweep_measures_every_plane_at_every_size():
    done = subprocess.run(
        [sys.executable, "-m", "ecmooncake", "bench", "--sweep", "--sizes", "64K,1M", "--sweep-mb", "2",
         "--ceiling-mb", "16", "--tcp-conns", "2", "--json", "--quiet"],
        capture_output=True, text=True, timeout=600, env=subprocess_env(),
    )
    assert done.returncode in (0, 1), done.stderr + done.stdout
    s = json.loads(done.stdout)
    assert s["ok"], s
    assert set(s["planes"]) == {"tcp", "shm"} and "mooncake" in s["unmeasured"]
    steps = {st["item_bytes"]: st for st in s["steps"]}
    for plane, body in s["planes"].items():
        assert [p["item_bytes"] for p in body["points"]] == [64 * KiB, MiB], plane
        for p in body["points"]:
            assert p["bytes_per_sec"] > 0 and p["ceiling_gb_per_s"] > 0 and p["ceiling_ratio"] > 0
            assert p["latency_us"]["samples"] == steps[p["item_bytes"]]["reps"]
            assert 0 < p["latency_us"]["p50"] <= p["latency_us"]["p99"]
    assert s["planes"]["tcp"]["ceiling_per_size"] is False and s["planes"]["shm"]["ceiling_per_size"] is True
