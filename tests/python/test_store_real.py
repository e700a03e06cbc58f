"""The Mooncake Store tier against a real ``mooncake_master`` and the real
Store client of Mooncake's pip wheel.

Mooncake advertises the first interface that is not loopback and binds
0.0.0.0, so the outer test runs the inner tests again inside a network
namespace it creates (loopback plus a veth pair on 10.231.0.1/24) and
samples ``ss`` there while they run: every socket must be bound and
connected to loopback or the namespace's own address. The wheels to test
are the installed one and, when present, the oldest one in
``.mooncake-oldest/`` (``bash build/setup.sh`` installs both). With
ECMOONCAKE_REQUIRE_MOONCAKE=1 (build/test.sh and CI) a missing wheel,
master or namespace is a failure, not a skip.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, subprocess_env
from ecmooncake import store
from ecmooncake.store import GetResult, StoreSettings, StoreTier

MiB = 1 << 20
IP = "10.231.0.1"
NETNS_ENV = "ECMOONCAKE_TEST_IN_NETNS"
SITE_ENV = "ECMOONCAKE_STORE_SITE"
REQUIRE_MOONCAKE = os.environ.get("ECMOONCAKE_REQUIRE_MOONCAKE") == "1"
OLDEST = REPO / ".mooncake-oldest"
NETNS_SETUP = (
    "set -e; ip link set lo up; ip link add ecm0 type veth peer name ecm1; "
    "ip addr add 10.231.0.1/24 dev ecm0; ip link set ecm0 up; ip link set ecm1 up; "
    "ss_log=$1; shift; ( while :; do ss -Htanp >>\"$ss_log\" 2>/dev/null; sleep 0.2; done ) & sampler=$!; "
    "set +e; \"$@\"; rc=$?; kill $sampler; wait $sampler 2>/dev/null; exit $rc"
)
INNER = [
    "test_put_and_get_byte_exact_across_processes_inside_the_namespace",
    "test_a_miss_and_a_get_past_its_deadline_inside_the_namespace",
    "test_master_killed_mid_run_inside_the_namespace",
    "test_the_connectors_put_is_got_by_a_pd_key_inside_the_namespace",
]
inside = pytest.mark.skipif(os.environ.get(NETNS_ENV) != "1", reason="runs inside the namespace the outer test creates")


def _skip_or_fail(why: str) -> None:
    if REQUIRE_MOONCAKE:
        pytest.fail(f"{why} (ECMOONCAKE_REQUIRE_MOONCAKE=1; bash build/setup.sh installs the wheel)", pytrace=False)
    pytest.skip(f"Mooncake Store is NOT tested: {why}")


def _sites() -> list[str]:
    """"" for the installed wheel; the oldest wheel's folder when present
    (required under ECMOONCAKE_REQUIRE_MOONCAKE)."""
    sites = [""]
    if (OLDEST / "mooncake" / "store.so").is_file() or REQUIRE_MOONCAKE:
        sites.append(str(OLDEST))
    return sites


def _site_env(site: str, **extra: str) -> dict[str, str]:
    env = subprocess_env(**extra)
    if site:
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], site])
        env[SITE_ENV] = site
    return env


SOCKET_OK = re.compile(r"^(127\.[0-9.]+|::1|::ffff:127\.[0-9.]+|10\.231\.0\.[0-9]+|::ffff:10\.231\.0\.[0-9]+|0\.0\.0\.0|::|\*)$")


def _addresses(ss_lines: list[str]) -> set[str]:
    out = set()
    for line in ss_lines:
        cols = line.split()
        if len(cols) < 5:
            continue
        for ep in cols[3:5]:
            addr = ep.rsplit(":", 1)[0].strip("[]").split("%")[0]
            out.add(addr)
    return out


@pytest.mark.deadline(400)
@pytest.mark.parametrize("site", _sites(), ids=lambda s: "oldest" if s else "installed")
@pytest.mark.parametrize("inner", INNER)
def test_store_against_a_real_master_in_a_namespace(inner, site, tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None or shutil.which("ss") is None:
        _skip_or_fail("a network namespace needs root, unshare, ip and ss")
    # The wheel of the site under test, not another one found further
    # along sys.path.
    probe = subprocess.run(
        [sys.executable, "-c", "from ecmooncake import store; print(store.master_binary() or '')"],
        env=_site_env(site), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60,
    )
    binary = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else ""
    if probe.returncode != 0 or not binary or (site and not binary.startswith(site + os.sep)):
        _skip_or_fail(f"no mooncake_master in the wheel at {site or 'the installed site'} (found {binary!r})")
    ss_log = tmp_path / "ss.log"
    env = _site_env(site, **{NETNS_ENV: "1"})
    cmd = ["unshare", "--net", "sh", "-c", NETNS_SETUP, "sh", str(ss_log),
           sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{Path(__file__)}::{inner}"]
    done = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=360)
    assert done.returncode == 0, done.stdout[-8000:]
    assert "1 passed" in done.stdout, done.stdout[-3000:]
    lines = ss_log.read_text().splitlines()
    bad = sorted(a for a in _addresses(lines) if not SOCKET_OK.match(a))
    assert not bad, f"sockets in the namespace used addresses outside it: {bad}"
    if inner != "test_master_killed_mid_run_inside_the_namespace":
        # That test checks the master's listening socket itself, before it
        # kills it: a sampler 0.2 s apart on a loaded machine can miss a
        # master that lives a few seconds.
        assert any("LISTEN" in line and f"{IP}:" in line for line in lines), "ss never saw the master listen in the namespace"


# -- inside the namespace ---------------------------------------------------


class Master:
    """A mooncake_master of the wheel under test, on the namespace's
    address, with its HTTP metadata server."""

    _next = [0]

    def __init__(self, log: Path):
        Master._next[0] += 1
        base = 20000 + 10 * Master._next[0]
        self.rpc, self.http, self.metrics = base, base + 1, base + 2
        self.log = log
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{IP}:{self.rpc}"

    @property
    def metadata(self) -> str:
        return f"http://{IP}:{self.http}/metadata"

    def start(self) -> "Master":
        binary = store.master_binary()
        assert binary, "no mooncake_master in the wheel"
        self.proc = subprocess.Popen(
            [binary, f"--rpc_address={IP}", f"--rpc_port={self.rpc}", "--enable_http_metadata_server=true",
             f"--http_metadata_server_host={IP}", f"--http_metadata_server_port={self.http}",
             f"--metrics_port={self.metrics}", "--enable_metric_reporting=false"],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=store.master_env(), start_new_session=True,
        )
        for port in (self.rpc, self.http):
            for _ in range(200):
                assert self.proc.poll() is None, f"mooncake_master exited: {self.log.read_text()[-3000:]}"
                with contextlib.suppress(OSError), socket.create_connection((IP, port), timeout=0.5):
                    break
                time.sleep(0.05)
            else:
                pytest.fail(f"mooncake_master never listened on {IP}:{port}: {self.log.read_text()[-3000:]}")
        return self

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            # kill() returns before the stop takes: each of the master's
            # threads stops only once it runs again, and on a loaded
            # machine a request can be answered meanwhile.
            _wait(lambda: _all_stopped(self.proc.pid), "every thread of the master stopped")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _all_stopped(pid: int) -> bool:
    """Whether every thread of pid is stopped (state T in /proc)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                # The state follows the command, whose name may hold spaces.
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:
            continue
    return bool(states) and all(st in ("T", "t") for st in states)


@pytest.fixture
def master(tmp_path):
    m = Master(tmp_path / "master.log").start()
    yield m
    m.stop()


def _settings(m: Master, **over) -> StoreSettings:
    raw = {"enabled": True, "master_address": m.address, "metadata_address": m.metadata, "local_hostname": IP,
           "segment_bytes": 320 * MiB, "put_inflight_bytes": 160 * MiB, "get_staging_bytes": 80 * MiB,
           "get_timeout_s": 10, "put_timeout_s": 30, "retry_after_s": 30}
    raw.update(over)
    return StoreSettings.from_mapping(raw)


def _tier(settings: StoreSettings) -> StoreTier:
    tier = StoreTier(settings)
    tier.open()
    assert tier.wait_ready(60), f"the Store tier did not set up: {tier.state} {tier.stats()}"
    return tier


def _wait(cond, what: str, limit_s: float = 60) -> None:
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.02)


SIZES = [4 << 10, (64 << 10) + 1, MiB, 16 * MiB - 3, 64 * MiB]

# A second process, a PD that never got the items: gets each into its own
# buffer, prints a digest of each, and the counters.
GETTER = r"""
import ctypes, hashlib, json, sys
from ecmooncake.store import StoreSettings, StoreTier
settings, sizes, keys = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
tier = StoreTier(StoreSettings.from_mapping(settings))
tier.open()
assert tier.wait_ready(60), tier.stats()
out = []
for key, n in zip(keys, sizes):
    buf = ctypes.create_string_buffer(n)
    r = tier.get_into(key, ctypes.addressof(buf), n)
    out.append([r.ok, r.reason, hashlib.sha256(buf.raw).hexdigest() if r.ok else ""])
print("RESULT " + json.dumps({"gets": out, "stats": tier.stats()}), flush=True)
tier.close(10)
"""


@inside
def test_put_and_get_byte_exact_across_processes_inside_the_namespace(master):
    tier = _tier(_settings(master))
    keys, digests, bufs = [], [], []
    for i, n in enumerate(SIZES):
        data = os.urandom(n)
        buf = ctypes.create_string_buffer(data, n)
        bufs.append(buf)
        key = store.item_key(f"img{i}", model="m@r", encoder_config={"max_pixels": 1}, dtype="uint8", shape=(n,))
        released = threading.Event()
        assert tier.put_async(key, ctypes.addressof(buf), n, released.set), tier.stats()
        assert released.wait(60)
        keys.append(key)
        digests.append(hashlib.sha256(data).hexdigest())
        # One at a time, so the 64 MiB put never meets the bound of bytes in flight.
        _wait(lambda: tier.stats()["put_ok"] + tier.stats()["put_error"] == i + 1, f"put {i} answered")
    st = tier.stats()
    assert st["put_ok"] == len(SIZES) and st["put_bytes"] == sum(SIZES), st
    # This process reads them back byte-exact.
    for key, n, digest in zip(keys, SIZES, digests):
        buf = ctypes.create_string_buffer(n)
        assert tier.get_into(key, ctypes.addressof(buf), n) == GetResult(True, "hit", n)
        assert hashlib.sha256(buf.raw).hexdigest() == digest
    # And so does another process that lends no memory: the bytes cross
    # the Store's transfer engine from this process's segment.
    raw = {"enabled": True, "master_address": master.address, "metadata_address": master.metadata,
           "local_hostname": IP, "segment_bytes": 0, "get_staging_bytes": 80 * MiB, "get_timeout_s": 30}
    done = subprocess.run([sys.executable, "-c", GETTER, json.dumps(raw), json.dumps(SIZES), json.dumps(keys)],
                          env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert done.returncode == 0 and line, done.stdout[-5000:]
    got = json.loads(line[len("RESULT "):])
    assert got["gets"] == [[True, "hit", d] for d in digests], got
    assert got["stats"]["get_hit_bytes"] == sum(SIZES)
    assert tier.close(30)


@inside
def test_a_miss_and_a_get_past_its_deadline_inside_the_namespace(master):
    tier = _tier(_settings(master, get_timeout_s=1, retry_after_s=2))
    buf = ctypes.create_string_buffer(b"\x5a" * 4096, 4096)
    addr = ctypes.addressof(buf)
    assert tier.get_into("ecm1/never-put/0", addr, 4096) == GetResult(False, "miss")
    assert buf.raw == b"\x5a" * 4096
    assert tier.put_async("ecm1/late/0", ctypes.addressof(buf), 4096)
    _wait(lambda: tier.stats()["put_ok"] == 1, "the put answered")
    # A master that stops answering: the get gives up at its deadline.
    master.signal(signal.SIGSTOP)
    try:
        dest = ctypes.create_string_buffer(4096)
        r = tier.get_into("ecm1/late/0", ctypes.addressof(dest), 4096)
        assert r == GetResult(False, "timeout"), (r, tier.stats())
        assert tier.get_into("ecm1/late/0", ctypes.addressof(dest), 4096) == GetResult(False, "unavailable")
    finally:
        master.signal(signal.SIGCONT)
    st = tier.stats()
    assert (st["get_miss"], st["get_timeout"], st["get_unavailable"]) == (1, 1, 1), st
    assert dest.raw == b"\0" * 4096  # nothing written after the caller gave up
    # Once retry_after_s has passed, the Store serves again.
    _wait(lambda: tier.get_into("ecm1/late/0", ctypes.addressof(dest), 4096).ok, "a hit after the master resumed")
    assert dest.raw == b"\x5a" * 4096
    assert tier.close(30)


@inside
def test_master_killed_mid_run_inside_the_namespace(master):
    tier = _tier(_settings(master, get_timeout_s=1, retry_after_s=600, max_gets=4))
    n = MiB
    src = ctypes.create_string_buffer(os.urandom(n), n)
    for i in range(4):
        assert tier.put_async(f"ecm1/k{i}/0", ctypes.addressof(src), n)
    _wait(lambda: tier.stats()["put_ok"] == 4, "the puts answered")
    results: list[GetResult] = []
    lock = threading.Lock()
    stop = threading.Event()

    def reader(i: int) -> None:
        dest = ctypes.create_string_buffer(n)
        while not stop.is_set():
            r = tier.get_into(f"ecm1/k{i % 4}/0", ctypes.addressof(dest), n)
            assert r.ok is False or dest.raw == src.raw
            with lock:
                results.append(r)

    readers = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(3)]
    for t in readers:
        t.start()
    _wait(lambda: sum(r.ok for r in list(results)) >= 10, "hits before the kill")
    listening = subprocess.run(["ss", "-Htln"], stdout=subprocess.PIPE, text=True, timeout=30).stdout
    assert f"{IP}:{master.rpc}" in listening, f"the master does not listen on the namespace's address:\n{listening}"
    master.signal(signal.SIGKILL)
    master.proc.wait(10)
    # Puts while the master is gone: taken or dropped, never raised. A
    # taken put reads src until it releases it, maybe after the tier's
    # close: the test keeps src until then (it once returned first, and
    # the put thread's copy from the freed buffer segfaulted).
    released = threading.Semaphore(0)
    taken = sum(tier.put_async(f"ecm1/k{i}/0", ctypes.addressof(src), n, release=released.release) for i in range(4, 8))
    _wait(lambda: tier.stats()["get_unavailable"] >= 50, "gets falling back at once after the kill")
    stop.set()
    for t in readers:
        t.join(30)
        assert not t.is_alive(), "a reader is stuck"
    st = tier.stats()
    reasons = {r.reason for r in results}
    assert reasons <= {"hit", "timeout", "error", "unavailable", "busy"}, reasons
    assert st["breaker_trips"] >= 1 and st["get_timeout"] + st["get_error"] >= 1, st
    assert st["fallbacks"] == sum(not r.ok for r in results), (st, len(results))
    # The client of a gone master closes within its bound or is left
    # behind; the process does not hang on it.
    tier.close(5)
    for _ in range(taken):
        assert released.acquire(timeout=120), "a taken put never released its source"


@inside
def test_the_connectors_put_is_got_by_a_pd_key_inside_the_namespace(master):
    """The connector's tier (what an encoder's worker runs) puts an encoder
    output; a PD's tier gets it under the key the PD makes from its own
    model config, byte-exact, and through its index from the hash alone."""
    import types

    torch = pytest.importorskip("torch")
    from ecmooncake.connector import tier as ctier

    model = types.SimpleNamespace(model="Qwen/Qwen2-VL-2B-Instruct", revision="r1", hf_overrides={},
                                  multimodal_config=types.SimpleNamespace(mm_processor_kwargs={"max_pixels": 200704}))
    vllm_config = types.SimpleNamespace(model_config=model)
    encoder = ctier._Tier(types.SimpleNamespace(store=_settings(master)), vllm_config)
    encoder.open()
    assert encoder.tier.wait_ready(60), encoder.stats()
    output = torch.randn(1369, 1536, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    encoder.put("9f" * 32, output)
    _wait(lambda: encoder.stats()["put_ok"] == 1, f"the put answered: {encoder.stats()}")
    pd = _tier(_settings(master, segment_bytes=0))
    model_id, encoder_config = ctier.identity(vllm_config)
    pd_key = store.item_key("9f" * 32, model=model_id, encoder_config=encoder_config, dtype="bfloat16", shape=(1369, 1536))
    n = output.numel() * 2
    dest = torch.empty(n, dtype=torch.uint8)
    assert pd.get_into(pd_key, dest.data_ptr(), n) == GetResult(True, "hit", n), pd.stats()
    assert torch.equal(dest, output.view(-1).view(torch.uint8))
    assert pd.close(30)
    # A PD that knows only the image's hash finds it through its index.
    _wait(lambda: encoder.stats()["index_put_ok"] == 1, f"the index put answered: {encoder.stats()}")
    fetcher = ctier._Tier(types.SimpleNamespace(store=_settings(master, segment_bytes=0)), vllm_config)
    fetcher.open(puts=False)
    assert fetcher.tier.wait_ready(60), fetcher.stats()
    got = fetcher.fetch("9f" * 32)
    assert got.ok and (got.index.dtype, got.index.shape) == ("bfloat16", (1369, 1536)), (got.reason, fetcher.stats())
    assert bytes(got.data) == output.view(-1).view(torch.uint8).numpy().tobytes()
    assert fetcher.fetch("9e" * 32).reason == "miss"
    fetcher.close()
    encoder.close()
