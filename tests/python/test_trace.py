"""The trace of the ready path (ecmooncake.trace, core/trace): the Python
ring, the per-hop table, and a real producer and shard whose stamps must
show every hop of every item once, in the plane's order."""

from __future__ import annotations

import threading

import pytest

from ecmooncake import trace
from ecmooncake.tools.harness import free_port_range

IP = "127.0.0.1"


@pytest.fixture
def python_ring():
    """Python's ring alone, on for the test and off after it."""
    trace.enable(8)
    yield
    trace.enable(0)


def test_off_records_nothing():
    trace.enable(0)
    trace.stamp("ready", "a")
    trace.stamp_all("hand_over", ["a", "b"])
    trace.stamp_first("available", "a")
    assert not trace.enabled()
    assert trace.drain() == {"capacity": 0, "dropped": 0, "stamps": []}


def test_off_evaluates_no_keys():
    # The hot paths pass generators: off, nothing iterates them.
    trace.enable(0)

    def keys():
        raise AssertionError("a key was computed with tracing off")
        yield  # pragma: no cover

    trace.stamp_all("submit", keys())


@pytest.mark.usefixtures("python_ring")
def test_ring_is_bounded_wraps_and_counts_what_it_overwrote():
    for i in range(20):
        trace.stamp("ready", str(i))
    got = trace.drain()
    assert got["capacity"] == 8 and got["dropped"] == 12
    assert [s[1] for s in got["stamps"]] == [str(i) for i in range(12, 20)]
    assert all(a[2] <= b[2] for a, b in zip(got["stamps"], got["stamps"][1:]))
    # Drained: the next drain has only what came after, and counts anew.
    trace.stamp("ready", "x")
    again = trace.drain()
    assert again["dropped"] == 0 and [s[:2] for s in again["stamps"]] == [["ready", "x"]]


@pytest.mark.usefixtures("python_ring")
def test_stamp_first_keeps_the_first_answer_only():
    for _ in range(5):
        trace.stamp_first("available", "h")
    trace.stamp_first("available", "g")
    got = trace.drain()["stamps"]
    assert [(s[0], s[1]) for s in got] == [("available", "h"), ("available", "g")]


def test_concurrent_writers_lose_nothing_within_capacity():
    writers, each = 8, 500
    trace.enable(writers * each)
    try:
        def write(w: int) -> None:
            for i in range(each):
                trace.stamp("write_enqueued", f"{w}-{i}")

        threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = trace.drain()
        keys = [s[1] for s in got["stamps"]]
        assert got["dropped"] == 0
        assert sorted(keys) == sorted(f"{w}-{i}" for w in range(writers) for i in range(each))
    finally:
        trace.enable(0)


@pytest.mark.parametrize("value, capacity", [(None, 0), ("", 0), ("0", 0), ("x", 0), ("-2", 0), ("1", trace.DEFAULT_CAPACITY), ("300", 300)])
def test_capacity_from_env(value, capacity):
    assert trace.capacity_from_env(value) == capacity


def test_table_orders_hops_by_time_and_gives_percentiles():
    stamps = []
    # 100 items: hand_over at 0, write_enqueued 10+i us later, ready 1 us
    # after that, write_ended 5 us after ready; two items lack ready.
    for i in range(100):
        k = f"k{i}"
        stamps += [["write_ended", k, (10 + i + 1 + 5) * 1000], ["hand_over", k, 0], ["write_enqueued", k, (10 + i) * 1000]]
        if i < 98:
            stamps.append(["ready", k, (10 + i + 1) * 1000])
    stamps.append(["hand_over", "k0", 10**9])  # a later stamp of a hop: the first counts
    stamps.append(["ready", "other", 5])  # not one of the items asked for
    t = trace.table(stamps, keys=[f"k{i}" for i in range(100)])
    assert t["items"] == 100
    rows = {r["hop"]: r for r in t["rows"]}
    assert [r["hop"] for r in t["rows"]] == ["hand_over", "write_enqueued", "ready", "write_ended"]
    assert rows["hand_over"]["p50_us"] == 0 and rows["hand_over"]["count"] == 100
    assert rows["write_enqueued"]["p50_us"] == 59 and rows["write_enqueued"]["p99_us"] == 108
    assert rows["ready"]["count"] == 98 and rows["ready"]["p50_us"] == 1 and rows["ready"]["p99_us"] == 1
    # From the row before that the item has: ready for 98 items,
    # write_enqueued (6 us) for two: the 99th of 100 by rank is one of them.
    assert rows["write_ended"]["p50_us"] == 5 and rows["write_ended"]["p99_us"] == 6
    assert rows["write_ended"]["from_start_p50_us"] == 65
    text = "\n".join(trace.format_table(t))
    assert text.index("hand_over") < text.index("write_enqueued") < text.index("ready") < text.index("write_ended")


def test_table_of_nothing():
    assert trace.table([]) == {"items": 0, "rows": []}
    assert trace.format_table(trace.table([])) == ["  (no stamps)"]


# The order each plane's hops must keep for every item (non-decreasing
# stamps along each chain), and the hops it must not have.
CHAINS = {
    "tcp": (
        [
            ["submit", "reserve_sent", "reserve_received", "reserve_replied", "reserve_answered", "write_enqueued", "ready", "write_ended"],
            ["hand_over", "sources_entered", "sources_checked", "write_enqueued"],
            ["ready", "event_delivered"],
        ],
        {"complete_sent", "complete_answered"},
    ),
    "shm": (
        [
            ["submit", "reserve_sent", "reserve_received", "reserve_replied", "reserve_answered", "write_enqueued", "write_ended", "complete_sent", "ready", "complete_answered"],
            ["hand_over", "sources_entered", "sources_checked", "write_enqueued"],
            ["ready", "event_delivered"],
        ],
        set(),
    ),
}


@pytest.mark.usefixtures("library")
@pytest.mark.parametrize("plane", sorted(CHAINS))
def test_a_real_producer_and_shard_stamp_every_hop_once_in_order(workers, plane):
    from ecmooncake import native
    from ecmooncake.native import Scheduler

    chains, absent = CHAINS[plane]
    port = free_port_range(1, IP)
    shard = workers(
        "consumer",
        f"consumer-{plane}",
        config={"ec_ip": IP, "ec_port": port, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "transport": plane},
        slab_bytes=16 << 20,
        trace=1024,
    )
    producer = workers("producer", f"producer-{plane}", config={"transport": plane, "control_timeout_s": 10}, trace=1024)
    for w in (shard, producer):
        w.wait_ready(60)
    address = f"tcp://{IP}:{port}"
    items = [{"transfer_id": f"t{i}", "mm_hash": f"{plane}-item-{i}", "nbytes": 4096 * (i + 1), "seed": i} for i in range(3)]
    native.trace_enable(1024)  # this process: the PD scheduler's hops
    try:
        with Scheduler({"ec_ip": IP, "ec_port": port, "tp_size": 1, "dp_rank": 0, "push_wait_timeout_s": 20, "load_timeout_s": 10}) as sched:
            out = sched.step({"expect": [{"request_id": "r", "items": [{"transfer_id": it["transfer_id"], "mm_hash": it["mm_hash"]} for it in items]}]})
            assert not out.get("expect_errors"), out
            pushed = producer.call("push", 60, items=items, consumer=address, timeout_s=30)
            assert pushed["failed"] == {} and pushed["timed_out"] == [], pushed
            waited = sched.wait([it["transfer_id"] for it in items], 20_000)
            assert sorted(waited["available"]) == sorted(it["transfer_id"] for it in items), waited
            rings = [producer.call("trace", 30), shard.call("trace", 30), native.trace_drain()]
    finally:
        native.trace_enable(0)
    stamps = [s for r in rings for s in r["stamps"]]
    assert all(r["dropped"] == 0 for r in rings)
    want = {h for chain in chains for h in chain}
    for it in items:
        mine = [s for s in stamps if s[1] == it["mm_hash"]]
        hops = [s[0] for s in mine]
        assert sorted(hops) == sorted(want), (it["mm_hash"], hops)
        assert not absent & set(hops)
        at = {s[0]: s[2] for s in mine}
        for chain in chains:
            times = [at[h] for h in chain]
            assert times == sorted(times), (it["mm_hash"], list(zip(chain, times)))
    t = trace.table(stamps, [it["mm_hash"] for it in items])
    assert t["items"] == 3 and {r["hop"] for r in t["rows"]} == want
    assert all(r["count"] == 3 for r in t["rows"])


def test_trace_log_writes_one_line_per_python_stamp(monkeypatch, caplog):
    # A vllm serve instance nobody drains: its stamps go to its log too.
    monkeypatch.setenv(trace.LOG_ENV, "1")
    trace.enable(4)
    try:
        with caplog.at_level("INFO", logger="vllm.ecmooncake"):
            trace.stamp("save_caches", "h1")
        got = trace.drain()
    finally:
        trace.enable(0)
    (ns,) = [s[2] for s in got["stamps"]]
    assert [r.getMessage() for r in caplog.records] == [f"ecmooncake item-trace save_caches mm_hash=h1 t_ns={ns}"]
