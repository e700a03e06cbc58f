"""A test run that is told to stop (SIGTERM, as build/test.sh's trap does
to the vLLM 0.26 phase when a Go phase fails) stops the servers its tests
started in sessions of their own, which its process group's signal does
not reach; else a `vllm serve` outlives the run, holding its memory and
ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PROBE_ENV = "ECMOONCAKE_TERM_PROBE"


@pytest.mark.skipif(not os.environ.get(PROBE_ENV), reason="the probe runs only inside test_sigterm_stops_servers_in_their_own_sessions")
def test_probe_starts_a_server_in_its_own_session():
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    Path(os.environ[PROBE_ENV]).write_text(str(server.pid))
    time.sleep(300)


def _alive(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return st != "Z"


def test_sigterm_stops_servers_in_their_own_sessions(tmp_path):
    pid_file = tmp_path / "server.pid"
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::test_probe_starts_a_server_in_its_own_session"],
        env={**os.environ, PROBE_ENV: str(pid_file)},
        cwd=Path(__file__).parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = 0
    try:
        deadline = time.monotonic() + 120  # a hang bound: a fresh interpreter and pytest
        while not pid_file.exists() or not pid_file.read_text():
            assert run.poll() is None, "the probe run ended before it started its server"
            assert time.monotonic() < deadline, "the probe never started its server"
            time.sleep(0.05)
        server = int(pid_file.read_text())
        assert _alive(server)
        run.send_signal(signal.SIGTERM)
        run.wait(60)
        deadline = time.monotonic() + 30
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server), "the server outlived the stopped run"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if server and _alive(server):
            os.kill(server, signal.SIGKILL)
