"""The GPU bench's report, on made-up figures: the per-phase breakdown of
the readiness path and the cuda_ipc targets (no GPU needed)."""

from ecmooncake.tools import gpubench

MiB = 1 << 20


def _phase(name, plane, mib, inflight, ratio, fixed):
    return {
        "name": name, "transport": plane, "item_bytes": mib * MiB, "batch": 8, "inflight": inflight, "rounds": 2,
        "seconds": 1.0, "bytes_per_sec": ratio * 1e12, "ceiling_bytes_per_sec": 1e12, "ratio": ratio,
        "us_per_item": 10.0, "overhead_us_per_item": fixed / 8, "fixed_us_per_batch": fixed,
        "us_per_batch": {"submit": 5.0} if inflight == 1 else {},
        "ready_path_us": {"copy": {"us": 150.0, "count": 2}, "event_delivery": {"us": 30.0, "count": 16}},
        "failures": [],
    }


def test_phase_means_are_per_occurrence_between_two_snapshots():
    before = {"copy": (2, 0.000300), "complete_rtt": (2, 0.0001)}
    after = {"copy": (6, 0.000900), "complete_rtt": (2, 0.0001), "event_delivery": (8, 0.000240)}
    got = gpubench._phase_means(before, after)
    assert got["copy"]["count"] == 4 and abs(got["copy"]["us"] - 150.0) < 1e-6
    assert "complete_rtt" not in got, "a phase not seen in the interval is left out"
    assert abs(got["event_delivery"]["us"] - 30.0) < 1e-6


def test_summary_reports_the_ready_path_and_the_targets():
    phases = [_phase("ipc-32m", "cuda_ipc", 32, 1, 0.55, 120.0), _phase("ipc-32m-stream", "cuda_ipc", 32, 32, 0.7, 20.0)]
    s = {
        "ok": True, "date": "2026-12-01", "gpu": "H200", "devices": "cuda:0 -> cuda:0", "torch": "2.11",
        "ceilings": {"device_copy_gb_per_s": {"32 MiB": 1772.0}, "pinned_d2h_gb_per_s": 55.0, "tcp_gb_per_s": 5.0,
                     "tcp": {"text": "raw Go TCP 5.00 GB/s (1 sender + 1 receiver process, GOMAXPROCS 4 each, 4 connections)"}},
        "phases": phases, "targets": gpubench.targets(phases),
    }
    met = {t["name"]: t["met"] for t in s["targets"]}
    assert met == {"fixed cost per batch": True, "8 x 32 MiB, one batch": True, "8 x 32 MiB, in flight": False}
    text = gpubench.format_summary(s)
    assert "copy 150 (2), event_delivery 30 (16)" in text
    assert "MISSED" in text and "result OK" in text
    assert "TCP ceiling: raw Go TCP 5.00 GB/s (1 sender + 1 receiver process" in text


def test_summary_prints_each_phase_per_hop_trace_beside_its_floor():
    from ecmooncake import trace

    stamps = []
    for i in range(8):
        k = f"ipc-32m-0-0-{i}"
        stamps += [["hand_over", k, 0], ["write_enqueued", k, 20_000], ["write_ended", k, 190_000], ["ready", k, 230_000],
                   ["event_delivered", k, 290_000]]
    phase = {**_phase("ipc-32m", "cuda_ipc", 32, 1, 0.55, 120.0), "trace": {**trace.table(stamps), "dropped": 0}}
    untraced = _phase("ipc-4m", "cuda_ipc", 4, 1, 0.5, 100.0)
    lines = gpubench.trace_lines([phase, untraced])
    # 8 x 32 MiB at the phase's ceiling (1e12 B/s): 268.4 us.
    assert lines[0] == "  ipc-32m per-hop trace of 8 items, us (a batch's bytes take 268.4 us at its ceiling's rate)"
    assert [line.split()[0] for line in lines[2:]] == ["hand_over", "write_enqueued", "write_ended", "ready", "event_delivered"]
    assert lines[4].split()[4:] == ["170.0", "170.0", "190.0", "190.0"]
    assert not any("ipc-4m" in line for line in lines)


def test_every_credit_phase_runs_beside_its_namesake_on_a_producer_of_its_own():
    by = {p["name"]: p for p in gpubench.PHASES}
    credit = [p for p in gpubench.PHASES if p.get("credit")]
    assert {p["name"] for p in credit} >= {"ipc-4m-credit", "ipc-32m-credit"}
    for p in credit:
        twin = by[p["name"].removesuffix("-credit")]
        assert not twin.get("credit")
        same = ("plane", "mib", "batch", "rounds", "encode_ms", "inflight")
        assert {k: p.get(k) for k in same} == {k: twin.get(k) for k in same}, p["name"]
        assert gpubench._producer_key(p) != gpubench._producer_key(twin)
    assert [p["name"] for p in gpubench._phases("ipc-32m,ipc-32m-credit")] == ["ipc-32m", "ipc-32m-credit"]
