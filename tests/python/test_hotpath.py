"""`python -m ecmooncake hotpath` runs end to end on a few batches and
reports each call's wall-clock and CPU figures, each against its floor."""

from __future__ import annotations

import argparse

import pytest

from ecmooncake.tools import hotpath

pytestmark = pytest.mark.usefixtures("library")


@pytest.mark.parametrize("busy", [False, True])
def test_a_short_run_reports_wall_and_cpu_figures(busy):
    parser = argparse.ArgumentParser()
    hotpath.add_arguments(parser)
    report = hotpath.run(parser.parse_args(["--batches", "6", "--warmup", "2", "--batch", "3"] + (["--busy-thread"] if busy else [])))
    assert report["busy_thread"] is busy
    assert report["floor_holds_gil"], "the floor crosses as the packed calls do"
    for key in ("figures", "cpu_figures"):
        figures = report[key]
        assert set(figures) == {"floor", "submit", "submit_call", "hand_over", "hand_over_call", "gil_released"}
        for fig in figures.values():
            assert 0 < fig["p50_us"] <= fig["p99_us"] <= fig["max_us"]
        assert figures["floor"]["p50_per_floor"] == pytest.approx(1.0)
        # The library's call is a part of its method's time, batch by
        # batch, so of every percentile too: what is left is Python's.
        for call in ("submit", "hand_over"):
            for q in ("p50_us", "p99_us", "max_us"):
                assert figures[call + "_call"][q] <= figures[call][q]
    text = hotpath.summary(report)
    assert "submit cpu" in text and "hand_over cpu" in text
    assert "submit_call" in text and "hand_over_call" in text
    assert ("a busy Python thread" in text) is busy
