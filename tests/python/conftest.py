"""Shared fixtures: the source tree on sys.path, the built library (or a clear
skip), worker processes that are always stopped, and a per-test deadline
that stops every process a stuck test started before it ends the run."""

from __future__ import annotations

import faulthandler
import os
import signal
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

# A test that runs past this is stuck: stop every process it started, dump
# every thread's stack and exit instead of hanging CI.
TEST_DEADLINE_S = float(os.environ.get("ECMOONCAKE_TEST_DEADLINE_S", "600"))

# The deadline runs in a Python thread, which a hang that holds the GIL
# starves; faulthandler's C watchdog then ends the run this much later,
# without stopping the children (it cannot run Python).
DEADLINE_BACKSTOP_S = 60.0

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


def pytest_configure(config) -> None:
    # Told to stop (build/test.sh's trap signals the process group of a
    # phase that runs beside a failed one), the run first stops what its
    # tests started: a server in a session of its own is outside the group
    # and would outlive the run, holding its memory and ports.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_on_term)
    config.addinivalue_line(
        "markers",
        "deadline(seconds, env=None): this test's deadline instead of TEST_DEADLINE_S "
        "(the environment variable env, when set, overrides it)",
    )


def _stop_on_term(signum, _frame) -> None:
    stop_descendants()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def deadline_of(node) -> float:
    """The test's deadline: its ``deadline`` marker's, else TEST_DEADLINE_S.
    The end-to-end tests, which start several vLLM instances, take a longer
    one this way, so that the same watchdog (which stops what they started)
    ends them too."""
    mark = node.get_closest_marker("deadline")
    if mark is None:
        return TEST_DEADLINE_S
    env = mark.kwargs.get("env")
    if env and os.environ.get(env):
        return float(os.environ[env])
    return float(mark.args[0])


@pytest.fixture(autouse=True)
def _deadline(request):
    passed = threading.Event()
    limit_s = deadline_of(request.node)

    def watch():
        if not passed.wait(limit_s):
            _expire(request, limit_s)

    threading.Thread(target=watch, name=f"deadline: {request.node.nodeid}", daemon=True).start()
    faulthandler.dump_traceback_later(limit_s + DEADLINE_BACKSTOP_S, exit=True)
    yield
    passed.set()
    faulthandler.cancel_dump_traceback_later()


def _expire(request, limit_s: float) -> None:
    """Ends a stuck test's run: first every process it started (a server in
    a session of its own outlives pytest otherwise, holding its memory),
    then the stacks, where pytest's capture does not swallow them, then
    the run itself."""
    stopped = stop_descendants()
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    sys.stderr.write(
        f"\n{request.node.nodeid}: the test deadline of {limit_s:g} s passed; "
        f"stopped {len(stopped)} processes it started (pids {sorted(stopped)})\n"
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(1)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """A process's state and parent, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _descendants(root: int) -> set[int]:
    """Every live (not zombie) process below root in the process tree."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _proc_stat(int(entry))) is not None and st[0] != "Z":
            children.setdefault(st[1], []).append(int(entry))
    found: set[int] = set()
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            if pid not in found:
                found.add(pid)
                todo.append(pid)
    return found


def stop_descendants(root: int | None = None) -> set[int]:
    """SIGKILLs every process below root (this one by default) and the
    process groups they lead or belong to, other than root's own: the
    servers the end-to-end tests start in sessions of their own, their
    children, workers, clients. Each is stopped (SIGSTOP) before any dies,
    so that none forks a child that escapes the walk, and a grandchild is
    killed by pid even once reparented away from its dead parent. Returns
    the pids it signalled."""
    root = os.getpid() if root is None else root
    own_group = os.getpgid(root)
    frozen: set[int] = set()
    for _ in range(100):  # a bound on a tree that keeps growing
        new = _descendants(root) - frozen
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        frozen |= new
    groups: set[int] = set()
    for pid in frozen:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for pgid in groups - {own_group}:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in frozen:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return frozen


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
