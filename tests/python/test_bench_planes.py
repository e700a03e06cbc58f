"""``python -m ecmooncake bench --planes``: a bad list is refused by name,
and a tiny run measures the native TCP plane and Mooncake's engine (PyPI's
wheel, its tcp protocol) one after the other against one TCP ceiling,
inside a network namespace this test creates (the engine advertises the
first interface that is not loopback: there, the namespace's own veth).
No figure is judged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env
from ecmooncake.tools import bench


def _run(*args: str, netns: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + [sys.executable, "-m", "ecmooncake", "bench", *args]
    return subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "planes, said",
    [
        ("tcp,udp", "unknown plane udp: choose among tcp, mooncake, shm"),
        ("tcp,tcp", "a plane is named twice"),
        (",", "no plane named"),
    ],
)
def test_a_bad_list_of_planes_is_refused_by_name(planes, said):
    proc = _run("--planes", planes, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr, proc.stderr
    with pytest.raises(ValueError, match="a plane is named twice"):
        bench.run(planes=("mooncake", "mooncake"))


def _skip_or_fail(why: str) -> None:
    if os.environ.get("ECMOONCAKE_REQUIRE_MOONCAKE") == "1":
        pytest.fail(f"{why} (ECMOONCAKE_REQUIRE_MOONCAKE=1)", pytrace=False)
    pytest.skip(why)


@pytest.fixture
def netns():
    """A network namespace with loopback and one veth pair, both ends
    inside it (198.18.9.1 on one): a host of its own, whose first interface
    that is not loopback is the veth."""
    if os.geteuid() != 0:
        _skip_or_fail("creating a network namespace needs root")
    name = f"ecm-bench-{os.getpid()}"
    made = False
    try:
        for args in (
            ["netns", "add", name],
            ["-n", name, "link", "set", "lo", "up"],
            ["-n", name, "link", "add", "bench0", "type", "veth", "peer", "name", "bench1"],
            ["-n", name, "addr", "add", "198.18.9.1/24", "dev", "bench0"],
            ["-n", name, "link", "set", "bench0", "up"],
            ["-n", name, "link", "set", "bench1", "up"],
        ):
            done = subprocess.run(["ip", *args], capture_output=True, text=True)
            if done.returncode != 0:
                _skip_or_fail(f"ip {' '.join(args)}: {done.stderr.strip()}")
            made = True
        yield name
    finally:
        if made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.usefixtures("library")
def test_a_tiny_bench_of_both_planes_inside_a_namespace(netns):
    from ecmooncake import native

    info = native.mooncake_info()
    if not info.get("available"):
        _skip_or_fail(f"no Mooncake engine: {info.get('reason')}")
    proc = _run(
        "--planes", "tcp,mooncake", "--host", "198.18.9.1", "--mb", "1", "--batch", "2", "--batches", "1",
        "--small-kb", "16", "--small-batch", "4", "--small-batches", "1", "--ceiling-mb", "16",
        "--gomaxprocs", "2", "--tcp-conns", "2", "--quiet", "--json",
        netns=netns,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout
    out = json.loads(proc.stdout)
    assert out["ok"], out
    assert set(out["planes"]) == {"tcp", "mooncake"} and out["transport"] == "tcp"
    for plane, phases in out["planes"].items():
        for label in ("large", "small"):
            phase = phases[label]
            assert phase["failures"] == [], (plane, label, phase)
            assert phase["bytes_per_sec"] > 0 and "ceiling_ratio" in phase, (plane, label, phase)
    # The first plane's phases stay where a single-plane summary has them.
    assert out["large"] == out["planes"]["tcp"]["large"]
    # Each Mooncake engine (the shard's and the producer's) said where it
    # serves its handshake: the namespace's veth, nothing else.
    listening = [line.rpartition("listening on ")[2].strip() for line in proc.stderr.splitlines() if "listening on " in line]
    assert len(listening) >= 2, proc.stderr[-4000:]
    assert all(a.startswith("198.18.9.1:") for a in listening), listening


@pytest.mark.usefixtures("library")
def test_shm_is_measured_beside_tcp_and_not_held_to_its_ceiling():
    # 64 MiB through shm against a 16 MiB TCP sample: on a quiet machine shm
    # may well be above the TCP ceiling, which must not read as a broken one.
    proc = _run(
        "--planes", "tcp,shm", "--mb", "1", "--batch", "2", "--batches", "1",
        "--small-kb", "16", "--small-batch", "4", "--small-batches", "1", "--ceiling-mb", "16",
        "--gomaxprocs", "2", "--tcp-conns", "2", "--quiet", "--json",
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout
    out = json.loads(proc.stdout)
    assert out["ok"], out
    assert set(out["planes"]) == {"tcp", "shm"}
    for plane, phases in out["planes"].items():
        for label in ("large", "small"):
            phase = phases[label]
            assert phase["failures"] == [], (plane, label, phase)
            assert phase["bytes_per_sec"] > 0 and "ceiling_ratio" in phase, (plane, label, phase)
            # The per-phase breakdown a batch's control plane is read from:
            # TCP's frames complete each item in-band, so only shm sends
            # complete_batch.
            completes = phase["producer_stat_deltas"].get("phases.complete_rtt.count", 0)
            if plane == "tcp":
                assert completes == 0, (plane, label, phase)
            else:
                assert completes >= 1, (plane, label, phase)
    assert not any(w.startswith("shm ") for w in out["ceiling_warnings"]), out


def test_only_planes_over_tcp_are_held_to_the_tcp_ceiling():
    by_plane = {
        "tcp": {"large": {"ceiling_ratio": 0.5}, "small": {"ceiling_ratio": 0.1}},
        "shm": {"large": {"ceiling_ratio": 6.2}, "small": {"ceiling_ratio": 0.2}},
    }
    assert bench.ceiling_marks(by_plane) == {"tcp large items": 0.5, "tcp small items": 0.1}
    assert bench.ceiling_marks({"tcp": by_plane["tcp"]}) == {"large items": 0.5, "small items": 0.1}
