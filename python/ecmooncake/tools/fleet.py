"""Real ``vllm serve`` fleets on one host: vLLM instances, the proxy, each
server in a process group of its own, started together and stopped together.

Shared by ``python -m ecmooncake bench-serve`` and the end-to-end tests.
Standard library only: the tests import it into an interpreter that may
have neither vLLM nor numpy, and every server runs from the interpreter it
is given (a vLLM environment), never from the caller's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# vLLM's CPU backend on a small machine: one OpenMP thread per instance
# and a 1 GiB KV cache. VLLM_CPU_OMP_THREADS_BIND=nobind leaves the cores
# to the kernel, since several instances share them.
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

VLLM_READY = "Application startup complete."
PROXY_READY = "ecmooncake proxy listening on"

# vLLM's own command line (`vllm bench serve ...`) as an argv prefix; see
# ecmooncake.tools.vllm_cli for why not the `vllm` script.
VLLM_CLI = ("-m", "ecmooncake.tools.vllm_cli")


class ServerError(RuntimeError):
    pass


def vllm_env(base: dict[str, str] | None = None, *, bin_dir: Path | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(VLLM_ENV)
    if bin_dir is not None:
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


class Server:
    """One server process in a session (and so a process group) of its own."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, *, netns: str | None = None, env: dict | None = None, ready: str):
        self.name = name
        self.argv = argv
        self.ready_marker = ready
        self.log_path = log_dir / f"{name}.log"
        cmd = (["ip", "netns", "exec", netns] if netns else []) + argv
        self._log = open(self.log_path, "ab")
        self._log.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env if env is not None else vllm_env(),
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
                raise ServerError(f"{self.name} was not ready in time (log: {self.log_path})")
            time.sleep(0.5)

    def signal_group(self, sig: int) -> None:
        """sig to every process of the server's group (vLLM's API server and
        its engine core), as a machine that loses them all at once."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

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
        self.signal_group(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        # The group may outlive its leader for a moment (workers being
        # reaped); wait until none of it is left.
        end = time.monotonic() + 10
        while group_alive(self.proc.pid) and time.monotonic() < end:
            time.sleep(0.1)
        if not self._log.closed:
            self._log.close()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@dataclass
class Deployment:
    """The servers of one phase, started together and stopped together."""

    log_dir: Path
    start_timeout_s: float = 240.0
    servers: list[Server] = field(default_factory=list)

    def start(self, name: str, argv: list[str], *, ready: str, netns: str | None = None, env: dict | None = None) -> Server:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        s = Server(name, argv, self.log_dir, netns=netns, env=env, ready=ready)
        self.servers.append(s)
        return s

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        for s in self.servers:
            s.wait_ready(deadline)

    def stop(self) -> None:
        for s in reversed(self.servers):
            s.stop()

    def logs(self) -> str:
        return "\n".join(f"----- {s.name} ({s.log_path}), last lines -----\n{s.tail()}" for s in self.servers)


def vllm_argv(python: Path | str, model: Path | str, port: int, host: str = "127.0.0.1", ec: dict | None = None,
              max_num_seqs: int = 4) -> list[str]:
    """vllm serve, through the module vLLM keeps for it (see VLLM_CLI)."""
    argv = [
        str(python),
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
        str(max_num_seqs),
        "--enforce-eager",
        "--seed",
        "0",
        "--limit-mm-per-prompt",
        json.dumps({"image": 1, "video": 0}),
    ]
    if ec is not None:
        argv += ["--ec-transfer-config", json.dumps(ec)]
        if ec.get("ec_role") == "ec_producer":
            # An encoder holds no KV cache. vLLM 0.29 and newer turn prefix
            # caching off for it themselves; 0.26 to 0.28 fail at start-up
            # with it on ("HybridKVCacheCoordinator requires at least two
            # attention groups": no KV cache group to manage).
            argv += ["--no-enable-prefix-caching"]
    return argv


def proxy_argv(python: Path | str, port: int, metrics_port: int, encode: list[str], pd: list[tuple[str, str]],
               host: str = "127.0.0.1", extra: tuple[str, ...] = ()) -> list[str]:
    """Our proxy; pd holds (URL, consumer control endpoint) pairs; extra
    are more of its flags."""
    return [
        str(python), "-m", "ecmooncake", "proxy",
        "--host", host, "--port", str(port), "--metrics-port", str(metrics_port),
        "--encode", *encode,
        "--pd", *[f"{url}#ec={consumer}" for url, consumer in pd],
        *extra,
    ]


def ecm_config(role: str, ec_ip: str, ec_port: int, extra: dict, buffer_bytes: int = 64 << 20) -> dict:
    return {
        "ec_connector": "ECMooncakeConnector",
        "ec_role": role,
        "ec_ip": ec_ip,
        "ec_port": ec_port,
        "ec_buffer_device": "cpu",
        "ec_buffer_size": buffer_bytes,
        "ec_connector_extra_config": extra,
    }


def example_config(role: str, store: Path) -> dict:
    return {"ec_connector": "ECExampleConnector", "ec_role": role, "ec_connector_extra_config": {"shared_storage_path": str(store)}}


def scrape(url: str, timeout_s: float = 30) -> str:
    """One /metrics page, "" when it cannot be read (a vLLM process serves
    the library's series on one of its two ports only)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read().decode()
    except OSError:
        return ""


def wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise ServerError(f"{url}/health did not answer 200 within {timeout_s:.0f} s ({last})")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of one Prometheus series' samples in a scrape whose labels
    include the given ones, 0 when absent."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = _labels(rest.rstrip("}")) if rest else {}
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split('",'):
        k, _, v = part.partition("=")
        if k:
            out[k.strip()] = v.strip().strip('"')
    return out
