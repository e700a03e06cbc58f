"""The ceilings' bookkeeping, with made-up measurements: which sample is
kept, which variant the ratio is against, when a summary is flagged. Then
the two-process TCP ceiling (ecm-ceiling) and a tiny bench run as a user
starts them,
checking that they say what the ceiling was measured with (no figure is
judged)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env
from ecmooncake.tools import ceiling
from ecmooncake.tools.ceiling import AFTER, BEFORE, Ceiling, TCPCeiling


def test_the_higher_of_before_and_after_is_kept():
    book = Ceiling("c", {}, primary=4)
    book.add(4, BEFORE, 3e9)
    book.add(4, AFTER, 5e9)
    assert book.value() == 5e9
    book = Ceiling("c", {}, primary=4)
    book.add(4, BEFORE, 5e9)
    book.add(4, AFTER, 3e9)
    assert book.value() == 5e9
    assert book.sample_count() == 2
    assert book.whens() == [BEFORE, AFTER]
    assert book.as_dict()["by_variant_gb_per_s"]["4"]["samples"] == {BEFORE: 5.0, AFTER: 3.0}


def test_ratio_is_against_the_matching_variant_and_best_is_beside_it():
    book = Ceiling("c", {}, primary=4, variant_unit="connections")
    for variant, before, after in ((1, 2e9, 2.5e9), (2, 6e9, 5e9), (4, 4e9, 4.5e9)):
        book.add(variant, BEFORE, before)
        book.add(variant, AFTER, after)
    assert book.value() == 4.5e9
    assert book.best() == (2, 6e9)
    assert book.ratio(4.5e9) == pytest.approx(1.0)
    assert book.ratio(4.5e9, book.best()[0]) == pytest.approx(0.75)
    d = book.as_dict()
    assert d["primary"] == 4 and d["best"] == 2
    assert d["gb_per_s"] == pytest.approx(4.5) and d["best_gb_per_s"] == pytest.approx(6.0)
    assert "best of 1, 2, 4 connections: 6.00 GB/s at 2" in book.describe()


def test_an_empty_ceiling_gives_no_ratio():
    book = Ceiling("c", {}, primary=1)
    assert book.value() == 0.0
    assert book.ratio(1e9) == 0.0
    assert book.sample_count() == 0


def test_a_ratio_above_the_limit_flags_the_summary():
    err = io.StringIO()
    summary = ceiling.mark({"ok": True}, {"large": 1.03, "small": 0.4}, stream=err)
    assert summary["ceiling_exceeded"] is True
    (warning,) = summary["ceiling_warnings"]
    assert warning.startswith("large: 1.03")
    assert "WARNING: large" in err.getvalue()
    lines = ceiling.warning_lines(summary)
    assert "CEILING EXCEEDED" in lines[0] and "large: 1.03" in lines[1]
    assert summary["ok"] is True, "the flag is beside the verdict on the bytes, not instead of it"


@pytest.mark.parametrize("ratio", [0.5, 1.0, ceiling.RATIO_LIMIT])
def test_a_ratio_at_or_below_the_limit_does_not(ratio):
    err = io.StringIO()
    summary = ceiling.mark({}, {"large": ratio}, stream=err)
    assert summary["ceiling_exceeded"] is False and summary["ceiling_warnings"] == []
    assert err.getvalue() == "" and ceiling.warning_lines(summary) == []


@pytest.mark.parametrize(
    "conns, receivers, want",
    [(1, 1, [1]), (4, 1, [1, 2, 4]), (6, 1, [1, 2, 4, 6]), (8, 2, [2, 4, 8]), (4, 4, [4])],
)
def test_stream_counts(conns, receivers, want):
    assert ceiling.stream_counts(conns, receivers) == want


def test_stream_counts_must_spread_evenly():
    with pytest.raises(ValueError, match="evenly"):
        ceiling.stream_counts(5, 2)


def test_tcp_ceiling_samples_every_variant_per_measurement():
    calls = []

    def runner(**kw):
        calls.append(kw)
        # Faster after than before, and faster with fewer connections.
        base = 1e9 if len(calls) == 1 else 2e9
        return [base * (4 - i) for i in range(len(kw["schedule"]))]

    tcp = TCPCeiling(gomaxprocs=3, conns=8, receivers=2, nbytes=1 << 20, runner=runner, chunk_bytes=4 << 20)
    tcp.measure(BEFORE)
    tcp.measure(AFTER)
    assert [c["schedule"] for c in calls] == [[1, 2, 4], [1, 2, 4]]
    assert all(c["gomaxprocs"] == 3 and c["receivers"] == 2 and c["chunk_bytes"] == 4 << 20 for c in calls)
    assert all(c["rounds"] == 4 and c["nbytes"] == 1 << 18 for c in calls), "a sample is 4 rounds of a quarter"
    assert tcp.book.value() == 4e9
    assert tcp.book.best() == (2, 8e9)
    p = tcp.book.params
    assert (p["processes"], p["gomaxprocs"], p["connections"], p["bytes_per_sample"]) == (3, 3, 8, 1 << 20)
    assert p["chunk_bytes"] == 4 << 20 and p["socket_buffer"] == "kernel autotuning"
    text = tcp.book.describe()
    for phrase in ("the data plane's own writer and receiver, 4 MiB frames, no reservations",
                   "1 sender + 2 receiver processes", "GOMAXPROCS 3 each", "8 connections (4 per receiver)",
                   "socket buffers autotuned", "no CPU pinning",
                   "1 MiB per sample (the fastest of 4 rounds of 256 KiB)", "2 samples: before, after"):
        assert phrase in text


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ecmooncake", *args],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=timeout,
    )


def test_a_missing_ceiling_command_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("ECMOONCAKE_LIBRARY", str(tmp_path / "libecmooncake.so"))
    monkeypatch.delenv(ceiling.CEILING_ENV, raising=False)
    monkeypatch.setattr(ceiling, "CEILING_COMMAND", "ecm-ceiling-absent")
    with pytest.raises(ceiling.CeilingError, match="ecm-ceiling-absent not found.*build_lib.py"):
        ceiling.ceiling_command()


def test_the_ceiling_command_is_found_beside_the_library(tmp_path, monkeypatch):
    exe = tmp_path / "ecm-ceiling"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("ECMOONCAKE_LIBRARY", str(tmp_path / "libecmooncake.so"))
    monkeypatch.delenv(ceiling.CEILING_ENV, raising=False)
    assert ceiling.ceiling_command() == exe


@pytest.mark.usefixtures("library")
def test_tcp_ceiling_across_processes():
    proc = _run("ceiling", "--conns", "4", "--receivers", "2", "--gib", "0.02", "--samples", "1", "--rounds", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out["by_variant_gb_per_s"]) == {"2", "4"}
    assert out["gb_per_s"] > 0
    assert out["params"]["processes"] == 3 and out["params"]["gomaxprocs"] == 2
    assert out["params"]["chunk_bytes"] == 8 << 20 and out["params"]["rounds_per_sample"] == 2


@pytest.mark.usefixtures("library")
def test_a_tiny_bench_prints_its_ceiling_parameters():
    proc = _run(
        "bench", "--mb", "1", "--batch", "2", "--batches", "1", "--small-kb", "16", "--small-batch", "4",
        "--small-batches", "1", "--ceiling-mb", "16", "--gomaxprocs", "2", "--tcp-conns", "2", "--quiet",
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    (line,) = [line for line in proc.stdout.splitlines() if line.strip().startswith("ceiling")]
    for phrase in ("the data plane's own writer and receiver, 8 MiB frames", "1 sender + 1 receiver process",
                   "GOMAXPROCS 2 each", "2 connections", "16 MiB per sample (the fastest of 4 rounds of 4 MiB)",
                   "2 samples: before, after", "best of 1, 2 connections"):
        assert phrase in line, line
    assert "of the ceiling" in proc.stdout
