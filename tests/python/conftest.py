"""Shared fixtures: the source tree on sys.path, the built library (or a clear
skip), worker processes that are always stopped, and a per-test deadline."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON_DIR = REPO / "python"
sys.path.insert(0, str(PYTHON_DIR))

from ecmooncake import _ffi  # noqa: E402
from ecmooncake.tools.harness import Worker, stop_all  # noqa: E402

# A test that runs past this is stuck: dump every thread's stack and exit
# instead of hanging CI. Workers notice the closed pipe and stop.
TEST_DEADLINE_S = float(os.environ.get("ECMOONCAKE_TEST_DEADLINE_S", "600"))

# A fresh interpreter that imports vLLM (and so torch) takes about 40 s on
# an idle 2-core host, and ten times that at a load average of 35. Waits
# for one are hang bounds: as long as the test's own deadline allows, so
# that a stuck child fails its test with the child's output instead of
# the deadline ending the whole run.
FRESH_PYTHON_S = 0.9 * TEST_DEADLINE_S


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child Python that imports this tree's package."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON_DIR), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def _deadline():
    faulthandler.dump_traceback_later(TEST_DEADLINE_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def library() -> Path:
    """The built library, loaded in this process; skips when it is absent
    (a failure when ECMOONCAKE_REQUIRE_LIB=1)."""
    path = _ffi.find()
    if path is None:
        tried = ", ".join(str(p) for p in _ffi.candidates())
        reason = f"libecmooncake.so is not built (tried {tried}); run 'python build/build_lib.py'"
        if os.environ.get("ECMOONCAKE_REQUIRE_LIB") == "1":
            pytest.fail(reason + " (ECMOONCAKE_REQUIRE_LIB=1)", pytrace=False)
        pytest.skip(reason)
    _ffi.lib()
    return path


@pytest.fixture
def workers():
    """Starts workers and stops (or kills) every one of them after the test."""
    started: list[Worker] = []

    def start(role: str, name: str, **kwargs) -> Worker:
        worker = Worker(role, name, **kwargs)
        started.append(worker)
        return worker

    yield start
    stop_all(started, timeout=10)


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Polls predicate until it returns a truthy value; fails after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"{what} not reached within {timeout:.0f}s")
        time.sleep(interval)


def without_hanging(fn, bound_s: float = 120.0, what: str = "call"):
    """Runs fn in a thread and returns its result (or raises what it raised);
    fails when it has not returned within bound_s. The bound is a hang
    detector, not a speed claim: set it far above what a loaded machine
    takes, and make what would hang take far longer still."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test's thread below
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"without-hanging: {what}", daemon=True)
    thread.start()
    thread.join(bound_s)
    if thread.is_alive():
        pytest.fail(f"{what} hung: still running after {bound_s:.0f}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def pytest_terminal_summary(terminalreporter):
    """Shows how long the end-to-end test's phases took, passed or not."""
    e2e = sys.modules.get("test_vllm_serve")
    timings = getattr(e2e, "TIMINGS", None)
    if timings:
        line = ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
        terminalreporter.write_line(f"end-to-end phases: {line}")
