"""Which calls keep the GIL (_ffi.HOLD_GIL, through a ctypes.PyDLL handle)
and which let go of it (the CDLL handle): every call that can wait lets the
other Python threads run meanwhile, and the encoder's per-batch calls keep
it, so that they do not wait to take it back from a busy thread."""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest

import header
from ecmooncake import _ffi
from ecmooncake.native import Producer

# A name that says the call can wait: it opens (dials, resolves, starts
# threads), closes (waits for goroutines), polls or waits.
WAITING_WORDS = ("open", "close", "poll", "wait", "acquire", "release", "step", "configure", "info", "trace", "stats")
# Named like calls that wait, but they never do: the PD scheduler's step and
# poll read what the shards' sockets hold without waiting (_ffi says why).
NEVER_WAIT = {"ecm_scheduler_step", "ecm_scheduler_poll"}


def test_hold_gil_names_only_calls_that_cannot_wait():
    names = {fn.name: fn for fn in header.functions()}
    assert _ffi.HOLD_GIL <= set(_ffi.PROTOTYPES)
    assert {"ecm_producer_submit_packed", "ecm_producer_sources_packed"} <= _ffi.HOLD_GIL
    for name in _ffi.HOLD_GIL:
        params = [p.name for p in names[name].params]
        assert not any("timeout" in p for p in params), f"{name} takes a timeout: it waits, so it must release the GIL"
        if name not in NEVER_WAIT:
            assert not any(word in name for word in WAITING_WORDS), f"{name} can wait: it must release the GIL"
    assert NEVER_WAIT <= _ffi.HOLD_GIL, "an exemption for a call that releases the GIL anyway"


def _holds_gil(fn) -> bool:
    return bool(fn._flags_ & ctypes._FUNCFLAG_PYTHONAPI)


@pytest.mark.usefixtures("library")
def test_each_function_goes_through_the_handle_its_name_calls_for():
    for name in _ffi.PROTOTYPES:
        assert _holds_gil(_ffi.function(name)) == (name in _ffi.HOLD_GIL), name
        # lib() is the CDLL whatever the name: tools and tests call through it.
        assert not _holds_gil(getattr(_ffi.lib(), name)), name


@pytest.mark.usefixtures("library")
def test_a_poll_that_waits_lets_another_python_thread_run():
    """With a switch interval longer than the test, the other thread gets
    the GIL during the poll only if the poll lets go of it."""
    state = {"in_call": False, "seen": False, "stop": False}
    go = threading.Event()

    def watch():
        go.wait()  # not spinning (and holding the GIL) until the call
        while not state["stop"] and not state["seen"]:
            if state["in_call"]:
                state["seen"] = True

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        with Producer({"transport": "tcp"}) as producer:
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            state["in_call"] = True
            go.set()
            out = producer.poll(300)  # nothing pending: waits the whole 300 ms
            state["in_call"] = False
            state["stop"] = True
            watcher.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not out.get("done")
    assert state["seen"], "ecm_producer_poll held the GIL while it waited"
