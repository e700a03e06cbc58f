"""A PD's Store fetches keep its engine stepping while one is in flight or
a count of one waits for a step's stats (connector.fetch._StoreFetcher.busy,
behind has_pending_push_work), and never otherwise: an engine kept stepping
for nothing spins a core for good."""

from __future__ import annotations

import threading
import types

from ecmooncake.connector import fetch as cfetch


class Tier:
    def __init__(self):
        self.moves = 0

    def moved(self) -> bool:
        return self.moves > 0


def fetcher(tier: Tier, alive: bool = True):
    cfg = types.SimpleNamespace(store=types.SimpleNamespace(get_timeout_s=1.0))
    f = cfetch._StoreFetcher(cfg, None, tier=tier)
    stop = threading.Event()
    f._thread = threading.Thread(target=stop.wait, daemon=True)
    if alive:
        f._thread.start()
    return f, stop


def test_busy_while_a_fetch_is_in_flight_or_its_count_unsent():
    tier = Tier()
    f, stop = fetcher(tier)
    try:
        assert not f.busy()
        f._taken += 1  # taken by the scheduler's thread
        assert f.busy() and f.busy(counts=False)
        f._ended += 1  # ended by the fetch thread, its count made
        tier.moves = 1
        assert f.busy(), "its count waits for a step's stats"
        assert not f.busy(counts=False), "a vLLM that takes no stats has no step to wait for"
        tier.moves = 0  # a step took the stats
        assert not f.busy()
    finally:
        stop.set()


def test_a_fetch_thread_that_is_gone_keeps_nothing_stepping():
    tier = Tier()
    tier.moves = 1
    f, _ = fetcher(tier, alive=False)
    f._taken += 1
    assert not f.busy()
