"""The connector bench's PD at TP 1 runs its model runner in the scheduler's
process, as vLLM's uni executor does (tools.worker.InProcess): the same
calls as a spawned Worker, the same errors, nothing pickled."""

from __future__ import annotations

import os

import pytest

from ecmooncake.errors import EcmInvalid
from ecmooncake.tools.worker import InProcess, WorkerError


class Host:
    closed = 0

    def __init__(self, fail: bool = False, tag: str = ""):
        if fail:
            raise RuntimeError("the model runner did not start")
        self.tag = tag
        self.seen: list = []

    def ready(self) -> dict:
        return {"tag": self.tag, "pid": os.getpid()}

    def op_step(self, meta):
        self.seen.append(meta)
        return len(self.seen)

    def op_refuse(self):
        raise EcmInvalid("a refusal of the library's")

    def op_break(self):
        raise KeyError("a bug")

    def close(self):
        Host.closed += 1


def test_runs_the_host_here_and_hands_objects_by_reference():
    w = InProcess(Host, "pd-rank0", tag="rank0")
    assert w.wait_ready(1) == {"tag": "rank0", "pid": os.getpid()}
    meta = {"loads": [object()]}
    w.send("step", meta=meta)
    assert w.result(1) == 1
    assert w.call("step", meta=meta) == 2
    assert w._host.seen[0] is meta, "the metadata object itself, not a copy"


def test_errors_come_back_as_a_spawned_workers_do():
    w = InProcess(Host, "pd-rank0")
    w.wait_ready(1)
    with pytest.raises(EcmInvalid):
        w.call("refuse")
    with pytest.raises(WorkerError, match="'break' raised KeyError"):
        w.call("break")
    assert w.call("step", meta=1) == 1, "an error leaves the host usable"


def test_a_host_that_does_not_start_is_an_error_and_not_running():
    w = InProcess(Host, "pd-rank0", fail=True)
    with pytest.raises(WorkerError, match="did not start"):
        w.wait_ready(1)
    assert not w.alive
    with pytest.raises(WorkerError, match="not running"):
        w.send("step", meta=None)


def test_stop_closes_the_host_once():
    before = Host.closed
    w = InProcess(Host, "pd-rank0")
    w.wait_ready(1)
    w.stop()
    w.stop()
    w.kill()
    assert Host.closed == before + 1
    assert not w.alive
