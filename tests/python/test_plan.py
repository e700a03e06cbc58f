"""The demo's plan and the harness helpers, which need no library."""

from __future__ import annotations

import socket

import numpy as np

from ecmooncake.tools.demo import plan_items, windows
from ecmooncake.tools.harness import free_port_range, payload, percentile

MiB = 1 << 20


def test_payload_is_deterministic_and_never_zero():
    a = payload(42, 1_000_003)
    assert a.dtype == np.uint8 and a.nbytes == 1_000_003 and a.flags.c_contiguous
    assert a.min() >= 1
    assert np.array_equal(a, payload(42, 1_000_003))
    assert not np.array_equal(a, payload(43, 1_000_003))
    assert len(np.unique(a)) == 255


def test_plan_duplicates_repeat_content():
    plan = plan_items(40, 1 * MiB, 4 * MiB, 0.25, seed=5)
    dups = [it for it in plan if it.duplicate_of is not None]
    assert len(dups) == 10
    for it in dups:
        original = plan[it.duplicate_of]
        assert original.duplicate_of is None and original.index < it.index
        assert (it.mm_hash, it.nbytes, it.seed) == (original.mm_hash, original.nbytes, original.seed)
    assert len({it.transfer_id for it in plan}) == 40
    assert all(1 * MiB <= it.nbytes <= 4 * MiB for it in plan)
    assert plan == plan_items(40, 1 * MiB, 4 * MiB, 0.25, seed=5)


def test_windows_fit_the_budget_and_keep_order():
    plan = plan_items(30, 1 * MiB, 8 * MiB, 0.2, seed=9)
    budget = 16 * MiB
    groups = windows(plan, budget)
    assert [it.index for g in groups for it in g] == list(range(30))
    for group in groups:
        distinct = {it.mm_hash: it.nbytes for it in group}
        assert len(group) == 1 or sum(distinct.values()) <= budget


def test_percentile_by_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([5.0], 99) == 5.0


def test_free_port_range_is_bindable():
    base = free_port_range(3)
    for port in range(base, base + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
