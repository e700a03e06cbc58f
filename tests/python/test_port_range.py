"""Runs of free ports for servers a test starts: build/test.sh runs test
phases side by side and gives each its own part of the range below the
ephemeral ports (ECMOONCAKE_PORT_RANGE), so that two never pick one port."""

from __future__ import annotations

import pytest

from ecmooncake.tools.harness import free_port_range
from ecmooncake.tools.worker import WorkerError


def test_a_phase_picks_ports_in_its_own_part(monkeypatch):
    monkeypatch.setenv("ECMOONCAKE_PORT_RANGE", "21000-21200")
    for _ in range(50):
        base = free_port_range(8)
        assert 21000 <= base and base + 8 <= 21200


def test_a_range_that_is_not_one_is_refused(monkeypatch):
    for text in ("21000", "a-b", "21000-21010"):
        monkeypatch.setenv("ECMOONCAKE_PORT_RANGE", text)
        with pytest.raises(WorkerError):
            free_port_range(1)
