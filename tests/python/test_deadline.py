"""The per-test deadline (conftest's _deadline) stops what the stuck test
started before it ends the run: a ``vllm serve`` left running by a test
that hit it holds gigabytes until someone notices.

Each test runs a pytest of its own, with conftest loaded as a plugin and a
deadline of a few seconds, over a stuck test whose module starts children
the ways the end-to-end helpers do (fleet.Server: a session and process
group of its own, with a child of its own as vLLM's engine core is; a
plain subprocess in pytest's group). They are started while the module is
collected, before the deadline runs, so that no machine is too slow for
them to be up when it passes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO, subprocess_env

STUCK = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from pathlib import Path

    import pytest

    MARKER = os.environ["DEADLINE_TEST_MARKER"]
    UP = Path(os.environ["DEADLINE_TEST_UP"])
    # A server with a child of its own, each writing its pid once up.
    SERVER = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import sys, time; open(sys.argv[2], \\"w\\").write(\\"up\\"); time.sleep(600)', sys.argv[1], sys.argv[2] + '.engine']); "
        "open(sys.argv[2], 'w').write('up'); time.sleep(600)"
    )
    PLAIN = "import sys, time; open(sys.argv[2], 'w').write('up'); time.sleep(600)"

    server = subprocess.Popen([sys.executable, "-c", SERVER, MARKER, str(UP) + ".server"], start_new_session=True)
    plain = subprocess.Popen([sys.executable, "-c", PLAIN, MARKER, str(UP) + ".plain"])
    end = time.monotonic() + 120
    while not all(Path(str(UP) + s).exists() for s in (".server", ".server.engine", ".plain")):
        assert time.monotonic() < end, "the children never came up"
        time.sleep(0.05)
    UP.write_text("up")


    # the test's own mark, if any
    def test_stuck():
        time.sleep(600)
    """
)


def _alive_with(marker: str) -> list[int]:
    """Processes, not yet reaped or zombie, whose command line holds marker."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline.split(b"\0") and state != "Z":
            pids.append(int(entry))
    return pids


@pytest.mark.parametrize(
    "default_s, mark, says",
    [
        # conftest's deadline for every test
        ("2", "", "deadline of 2 s"),
        # a test's own, shorter or longer than the default (the end-to-end
        # tests take 1800 s this way): the same watchdog ends it
        ("3000", "@pytest.mark.deadline(2)", "deadline of 2 s"),
        ("3000", '@pytest.mark.deadline(3000, env="DEADLINE_TEST_OWN_S")', "deadline of 2 s"),
    ],
    ids=["default", "marker", "marker-env"],
)
def test_deadline_kills_the_children_of_a_stuck_test(tmp_path, default_s, mark, says):
    marker = f"deadline-test-{uuid.uuid4().hex}"
    up = tmp_path / "up"
    (tmp_path / "test_stuck.py").write_text(STUCK.replace("# the test's own mark, if any", mark))
    env = subprocess_env(
        ECMOONCAKE_TEST_DEADLINE_S=default_s,
        DEADLINE_TEST_OWN_S="2",
        DEADLINE_TEST_MARKER=marker,
        DEADLINE_TEST_UP=str(up),
    )
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "python"), env["PYTHONPATH"]])
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_stuck.py")],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )
        out = run.stdout + run.stderr
        assert up.exists(), f"the stuck test's children never came up:\n{out}"
        assert run.returncode != 0, out
        left = _still_alive(marker)
        assert left == [], f"the deadline left the stuck test's children running: pids {left}\n{out}"
        assert "test_stuck" in out, f"the deadline names no stack of the stuck test:\n{out}"
        assert says in out, f"the deadline does not say it is {says!r}:\n{out}"
    finally:
        for pid in _alive_with(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _still_alive(marker: str) -> list[int]:
    """The marker's processes left once a kill has had time to land: a
    killed process is gone within moments, and 60 s is a hang bound."""
    end = time.monotonic() + 60
    while (left := _alive_with(marker)) and time.monotonic() < end:
        time.sleep(0.1)
    return left
