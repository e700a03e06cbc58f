"""The `mooncake` transport through the C ABI, against the test double of
Mooncake TransferEngine's C API, and the Mooncake metadata store (object and
`python -m ecmooncake metadata-server`)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, subprocess_env, wait_until
from ecmooncake import native
from ecmooncake import environment
from ecmooncake.tools.harness import free_port_range
from ecmooncake.native import EcmUnavailable, MetadataServer, Producer, Scheduler

pytestmark = pytest.mark.usefixtures("library")

IP = "127.0.0.1"
MiB = 1 << 20


def _load_build_script():
    spec = importlib.util.spec_from_file_location("build_mooncake_double", REPO / "build" / "build_mooncake_double.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def double(tmp_path_factory) -> Path:
    """The TransferEngine test double, built with the system C compiler."""
    return _load_build_script().build(tmp_path_factory.mktemp("mooncake-double"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((IP, 0))
        return s.getsockname()[1]


def _http(method: str, url: str, body: object = None, token: str | None = None) -> tuple[int, bytes]:
    """One request as Mooncake's HTTP metadata plugin sends it."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=3) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _key_url(base: str, key: str) -> str:
    return f"{base}?key={urllib.parse.quote(key, safe='')}"


def _check_store(url: str) -> None:
    key = "mooncake/rpc_meta/10.0.0.5:15432"
    assert _http("GET", _key_url(url, key))[0] == 404
    assert _http("PUT", _key_url(url, key), {"ip_or_host_name": "10.0.0.5", "rpc_port": 15432})[0] == 200
    assert _http("PUT", _key_url(url, key), {"rpc_port": 1})[0] == 200, "a second PUT overwrites"
    status, body = _http("GET", _key_url(url, key))
    assert status == 200 and json.loads(body) == {"rpc_port": 1}
    assert _http("DELETE", _key_url(url, key))[0] == 200
    assert _http("DELETE", _key_url(url, key))[0] == 200
    assert _http("GET", _key_url(url, key))[0] == 404
    health = url.rsplit("/", 1)[0] + "/health"
    assert _http("GET", health) == (200, b"ok")


@contextlib.contextmanager
def _metadata_server_cli(*args: str, **env: str):
    """``python -m ecmooncake metadata-server ARGS`` and the URL it prints
    first; SIGTERM stops it, and it must then exit 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ecmooncake", "metadata-server", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(**env),
    )
    try:
        url = proc.stdout.readline().strip()
        yield proc, url, (proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_metadata_server_cli(tmp_path):
    with _metadata_server_cli("--host", IP, "--port", "0", "--open", MC_METADATA_HTTP_TOKEN="") as (proc, url, died):
        assert url.startswith(f"http://{IP}:") and url.endswith("/metadata"), (url, died)
        _check_store(url)


def test_metadata_server_refuses_to_serve_without_a_token():
    # An attacker who can PUT rewrites the descriptors engines connect to:
    # without a token the store does not start unless told to serve open.
    with pytest.raises(native.EcmInvalid, match="MC_METADATA_HTTP_TOKEN"):
        MetadataServer(IP, 0)
    with pytest.raises(native.EcmInvalid, match="token and open"):
        MetadataServer(IP, 0, token="s3cret", open=True)
    env = subprocess_env(MC_METADATA_HTTP_TOKEN="")
    cli = [sys.executable, "-m", "ecmooncake", "metadata-server", "--port", "0"]
    done = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1 and "MC_METADATA_HTTP_TOKEN" in done.stderr and "--open" in done.stderr, done
    # A token on the command line is visible to every user of the host.
    done = subprocess.run([*cli, "--token", "s3cret"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "--token" in done.stderr, done


def test_metadata_server_cli_passes_its_limits():
    # The library checks the limits together: a value above the total is
    # refused by name, which it can only be if the flags reached it.
    cli = [sys.executable, "-m", "ecmooncake", "metadata-server", "--host", IP, "--port", "0", "--open",
           "--max-value-bytes", str(1 << 20), "--max-total-bytes", "1024"]
    done = subprocess.run(cli, capture_output=True, text=True, env=subprocess_env(MC_METADATA_HTTP_TOKEN=""), timeout=60)
    assert done.returncode == 1 and "max_value_bytes" in done.stderr, done
    cli = [sys.executable, "-m", "ecmooncake", "metadata-server", "--host", IP, "--port", "0", "--open",
           "--max-conns", "8", "--max-conns-per-peer", "-1"]
    done = subprocess.run(cli, capture_output=True, text=True, env=subprocess_env(MC_METADATA_HTTP_TOKEN=""), timeout=60)
    assert done.returncode == 1 and "max_conns_per_peer = -1" in done.stderr, done


def test_metadata_server_open_is_logged_loudly():
    proc = subprocess.Popen(
        [sys.executable, "-m", "ecmooncake", "metadata-server", "--port", "0", "--open"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(MC_METADATA_HTTP_TOKEN=""),
    )
    try:
        assert proc.stdout.readline().startswith("http://127.0.0.1:")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "SECURITY" in err and "without a token" in err, err


def test_metadata_server_object():
    with MetadataServer(IP, 0, open=True, max_conns=16, max_conns_per_peer=8) as server:
        assert server.url.startswith(f"http://{IP}:")
        _check_store(server.url)
        stats = server.stats()
        assert stats["puts"] == 2 and stats["deletes"] == 2 and stats["keys"] == 0
        assert stats["evicted_conns"] == 0 and stats["rejected_conns"] == 0
    assert server.closed


def test_metadata_server_token():
    with MetadataServer(IP, 0, token="s3cret") as server:
        assert _http("PUT", _key_url(server.url, "k"), {"a": 1})[0] == 401
        assert _http("PUT", _key_url(server.url, "k"), {"a": 1}, token="s3cret")[0] == 200


def test_metadata_server_is_bounded():
    with MetadataServer(port=0, open=True, max_keys=2, max_value_bytes=1024, max_total_bytes=4096) as server:
        assert server.url.startswith("http://127.0.0.1:"), "loopback by default"
        status, body = _http("PUT", _key_url(server.url, "big"), "x" * 2000)
        assert status == 413 and b"1024" in body
        assert _http("PUT", _key_url(server.url, "a"), 1)[0] == 200
        assert _http("PUT", _key_url(server.url, "b"), 2)[0] == 200
        status, body = _http("PUT", _key_url(server.url, "c"), 3)
        assert status == 507 and b"store full" in body
        assert _http("PUT", _key_url(server.url, "a"), "overwrite")[0] == 200
        stats = server.stats()
        assert stats["too_large"] == 1 and stats["store_full"] == 1 and stats["keys"] == 2
        assert (stats["max_keys"], stats["max_value_bytes"], stats["max_total_bytes"]) == (2, 1024, 4096)
    with pytest.raises(native.EcmInvalid, match="max_value_bytes"):
        MetadataServer(port=0, open=True, max_value_bytes=1 << 20, max_total_bytes=1024)


def test_metadata_server_cli_token_file_and_loopback(tmp_path):
    token_file = tmp_path / "metadata.token"
    token_file.write_text("file-token\n")
    token_file.chmod(0o600)
    with _metadata_server_cli("--port", "0", "--token-file", str(token_file), "--max-keys", "1",
                              MC_METADATA_HTTP_TOKEN="env-token") as (proc, url, died):
        assert url.startswith("http://127.0.0.1:"), (url, died)
        assert _http("PUT", _key_url(url, "k"), 1)[0] == 401
        assert _http("PUT", _key_url(url, "k"), 1, token="env-token")[0] == 401, "the file wins over the environment"
        assert _http("PUT", _key_url(url, "k"), 1, token="file-token")[0] == 200
        assert _http("PUT", _key_url(url, "k2"), 1, token="file-token")[0] == 507
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert b"file-token" not in f.read()


# Each setting a native config takes from the environment: its variable and
# the function that fills it in.
FROM_ENVIRONMENT = {
    "metadata token": (native.METADATA_TOKEN_ENV, native.with_metadata_token),
    "library path": (native.MOONCAKE_LIBRARY_ENV, native.with_mooncake_library),
}


@pytest.mark.parametrize(
    "setting, config, env, want",
    [
        ("metadata token", {"mooncake_metadata_server": "h:1"}, "t", {"mooncake_metadata_server": "h:1", "mooncake_metadata_token": "t"}),
        ("metadata token", '{"mooncake_metadata_server": "h:1"}', "t", {"mooncake_metadata_server": "h:1", "mooncake_metadata_token": "t"}),
        ("metadata token", {"mooncake_metadata_server": "h:1", "mooncake_metadata_token": "mine"}, "t", {"mooncake_metadata_server": "h:1", "mooncake_metadata_token": "mine"}),
        ("metadata token", {"transport": "mooncake"}, "t", {"transport": "mooncake"}),
        ("metadata token", {"mooncake_metadata_server": "h:1"}, None, {"mooncake_metadata_server": "h:1"}),
        ("library path", {"transport": "mooncake"}, "/x/libte.so", {"transport": "mooncake", "mooncake_library": "/x/libte.so"}),
        ("library path", '{"transport": "mooncake"}', "/x/libte.so", {"transport": "mooncake", "mooncake_library": "/x/libte.so"}),
        ("library path", {"transport": "mooncake", "mooncake_library": "/mine.so"}, "/x/libte.so", {"transport": "mooncake", "mooncake_library": "/mine.so"}),
        ("library path", {"transport": "tcp"}, "/x/libte.so", {"transport": "tcp"}),
        ("library path", {"transport": "mooncake"}, None, {"transport": "mooncake"}),
        ("library path", "not json", "/x/libte.so", "not json"),
    ],
)
def test_a_setting_comes_from_the_environment(monkeypatch, setting, config, env, want):
    variable, fill_in = FROM_ENVIRONMENT[setting]
    # Whether this host has a Mooncake wheel is test_an_installed_wheel_fills_the_library's case.
    monkeypatch.setattr(environment, "mooncake_wheel", lambda: None)
    if env is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, env)
    assert fill_in(config) == want


WHEEL = {"engine": "/site/mooncake/engine.so", "version": "0.3.12.post1", "shim": "/pkg/libecmooncake_mooncake.so"}


@pytest.mark.parametrize(
    "config, env, want",
    [
        ({"transport": "mooncake"}, None,
         {"transport": "mooncake", "mooncake_library": WHEEL["shim"], "mooncake_engine": WHEEL["engine"]}),
        ('{"transport": "mooncake"}', None,
         {"transport": "mooncake", "mooncake_library": WHEEL["shim"], "mooncake_engine": WHEEL["engine"]}),
        ({"transport": "mooncake"}, "/x/libte.so", {"transport": "mooncake", "mooncake_library": "/x/libte.so"}),
        ({"transport": "mooncake", "mooncake_library": "/mine.so"}, None, {"transport": "mooncake", "mooncake_library": "/mine.so"}),
        ({"transport": "mooncake", "mooncake_engine": "/e.so"}, None, {"transport": "mooncake", "mooncake_engine": "/e.so"}),
        ({"transport": "tcp"}, None, {"transport": "tcp"}),
    ],
)
def test_an_installed_wheel_fills_the_library(monkeypatch, config, env, want):
    """A library the user names wins over the wheel; the wheel fills both
    keys only when neither is set."""
    monkeypatch.setattr(environment, "mooncake_wheel", lambda: dict(WHEEL))
    if env is None:
        monkeypatch.delenv(native.MOONCAKE_LIBRARY_ENV, raising=False)
    else:
        monkeypatch.setenv(native.MOONCAKE_LIBRARY_ENV, env)
    assert native.with_mooncake_library(config) == want


def test_the_wheel_is_found_without_importing_it(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "mooncake").mkdir(parents=True)
    (site / "mooncake" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (site / "mooncake" / "engine.so").write_bytes(b"")
    dist = site / "mooncake_transfer_engine_non_cuda-0.3.12.post1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mooncake-transfer-engine-non-cuda\nVersion: 0.3.12.post1\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "mooncake", raising=False)
    got = native.mooncake_wheel()
    assert got is not None
    assert got["engine"] == str(site / "mooncake" / "engine.so")
    assert got["version"] == "0.3.12.post1"
    assert got["shim"].endswith(native.SHIM_NAME)
    assert "mooncake" not in sys.modules


def test_missing_library_is_unavailable(monkeypatch):
    monkeypatch.setenv(native.MOONCAKE_LIBRARY_ENV, "/nonexistent/env/libtransfer_engine.so")
    with pytest.raises(EcmUnavailable, match="/nonexistent/env/libtransfer_engine.so"):
        Producer({"transport": "mooncake"})
    with pytest.raises(EcmUnavailable, match="/nonexistent/key/libtransfer_engine.so"):
        Producer({"transport": "mooncake", "mooncake_library": "/nonexistent/key/libtransfer_engine.so"})
    # Other transports do not need the library.
    with Producer({"transport": "tcp"}):
        pass


def _consumer(port: int, rank: int, tp: int, **extra) -> dict:
    return {
        "ec_ip": IP, "ec_port": port, "tp_rank": rank, "tp_size": tp, "dp_rank": 0,
        "transport": "mooncake", "mooncake_host": IP, **extra,
    }


def _items(tag: str) -> list[dict]:
    sizes = [1, 4099, 3 * MiB + 5, 9 * MiB]
    out = [{"transfer_id": f"t-{tag}-{i}", "mm_hash": f"{tag}{i}" * 8, "nbytes": n, "seed": 100 + i} for i, n in enumerate(sizes)]
    out.append({**out[1], "transfer_id": f"t-{tag}-dup"})  # same content in the same batch
    return out


def _round_trip(workers, port: int, tp: int, consumer_extra: dict, producer_config: dict, tag: str) -> None:
    shards = [
        workers("consumer", f"consumer-{tag}-{rank}", config=_consumer(port, rank, tp, **consumer_extra), slab_bytes=48 * MiB)
        for rank in range(tp)
    ]
    producer = workers("producer", f"producer-{tag}", config=producer_config)
    for worker in [*shards, producer]:
        worker.wait_ready(60)
    items = _items(tag)
    with Scheduler({"ec_ip": IP, "ec_port": port, "tp_size": tp, "push_wait_timeout_s": 30}) as scheduler:
        _deliver(scheduler, producer, port, items)
    _verify(shards, items)


def _expect(scheduler, items: list[dict]) -> None:
    out = scheduler.step({"expect": [{"request_id": f"r-{it['transfer_id']}", "items": [{"transfer_id": it["transfer_id"], "mm_hash": it["mm_hash"]}]} for it in items]})
    assert not out.get("expect_errors"), out


def _deliver(scheduler, producer, port: int, items: list[dict]) -> None:
    """Expects, pushes and waits for items: every one done and available."""
    _expect(scheduler, items)
    tids = [it["transfer_id"] for it in items]
    pushed = producer.call("push", 120, items=items, consumer=f"tcp://{IP}:{port}", timeout_s=90)
    assert pushed["failed"] == {} and pushed["timed_out"] == [], pushed
    assert pushed["held_sources"] == 0
    waited = scheduler.wait(tids, 20_000)
    assert sorted(waited["available"]) == sorted(tids), waited


def _verify(shards, items: list[dict]) -> None:
    """Every byte of every item on every shard."""
    for shard in shards:
        assert shard.call("info", 10)["data"].startswith("mooncake://")
        results = shard.call("verify", 60, items=items)
        assert [r["ok"] for r in results] == [True] * len(items), (shard.name, results)


def test_two_processes_over_the_double(workers, double, monkeypatch):
    """The library path travels as ECMOONCAKE_MOONCAKE_LIBRARY (read by
    Python, passed to Go as mooncake_library) into every worker."""
    monkeypatch.setenv(native.MOONCAKE_LIBRARY_ENV, str(double))
    port = free_port_range(2, IP)
    producer = {"transport": "mooncake", "mooncake_host": IP, "mooncake_staging_bytes": 16 * MiB, "control_timeout_s": 10, "push_wait_timeout_s": 30}
    _round_trip(workers, port, 2, {}, producer, "p2p")


def test_consumer_serves_the_metadata_store(workers, double, monkeypatch):
    """mooncake_metadata_server starts the store with the consumer; both
    engines then publish and find each other through it (HTTP mode)."""
    monkeypatch.setenv(native.MOONCAKE_LIBRARY_ENV, str(double))
    monkeypatch.delenv(native.METADATA_TOKEN_ENV, raising=False)
    port = free_port_range(1, IP)
    store = f"{IP}:{_free_port()}"
    url = f"http://{store}/metadata"
    producer = {"transport": "mooncake", "mooncake_host": IP, "mooncake_metadata": url, "control_timeout_s": 10, "push_wait_timeout_s": 30}
    _round_trip(workers, port, 1, {"mooncake_metadata_server": store, "mooncake_metadata_open": True}, producer, "http")
    assert _http("GET", f"http://{store}/health") == (200, b"ok")


def test_the_store_a_consumer_serves_takes_the_engines_token(workers, double, monkeypatch):
    """With MC_METADATA_HTTP_TOKEN set (Mooncake's engines send it), the
    store a consumer serves requires it: both engines still find each other,
    anyone else is refused."""
    monkeypatch.setenv(native.MOONCAKE_LIBRARY_ENV, str(double))
    monkeypatch.setenv(native.METADATA_TOKEN_ENV, "deployment-metadata-token")
    port = free_port_range(1, IP)
    store = f"{IP}:{_free_port()}"
    url = f"http://{store}/metadata"
    producer = {"transport": "mooncake", "mooncake_host": IP, "mooncake_metadata": url, "control_timeout_s": 10, "push_wait_timeout_s": 30}
    _round_trip(workers, port, 1, {"mooncake_metadata_server": store}, producer, "http-token")
    assert _http("PUT", _key_url(url, "mooncake/ram/rogue"), {"buffers": []})[0] == 401
    assert _http("GET", _key_url(url, "mooncake/ram/rogue"), token="deployment-metadata-token")[0] == 404


# Processes killed with SIGKILL in the middle of a write, over the double
# and (inside the namespace below) the real engine: a consumer shard, then
# restarted as a new process with a fresh segment; and a producer, whose
# item a second producer then pushes again.

# Large enough that a write outlasts the moments between handing over the
# source and the kill, over the double's TCP and the engine's alike. The
# slab is twice that: a producer may have pending on a shard at most 3/4 of
# its slab (max_pending_bytes_per_producer's default).
KILL_BIG = 96 * MiB
KILL_SLAB = 2 * KILL_BIG
# Generous: a 96 MiB write over the real engine's TCP on a loaded 2-core
# machine takes seconds, and a write that outlives two leases is ended by
# the shard. The slabs must be back within two leases of a kill.
KILL_LEASE_S = 10


def _in_use(shard) -> int:
    return shard.call("stats", 10)["bytes_in_use"]


def _writing(shard) -> int:
    return shard.call("stats", 10)["table"]["WritesInFlight"]


def _big(tag: str, seed: int) -> dict:
    return {"transfer_id": f"t-{tag}-big", "mm_hash": f"{tag}-big".ljust(64, "k"), "nbytes": KILL_BIG, "seed": seed}


def _push_of(item: dict, port: int) -> dict:
    return {"transfer_id": item["transfer_id"], "mm_hash": item["mm_hash"], "nbytes": item["nbytes"], "consumer": f"tcp://{IP}:{port}"}


def _start_write(producer, shards, item: dict, port: int) -> None:
    """Submits item's push, waits until every shard has admitted the write
    (from its grant on), then hands over the source: the next moment is
    mid-write."""
    (submitted,) = producer.call("submit", 30, pushes=[_push_of(item, port)])
    assert not submitted.get("error"), submitted
    wait_until(lambda: all(_writing(s) > 0 for s in shards), 60, what="the write admitted on every shard")
    producer.call("source", 60, mm_hash=item["mm_hash"], nbytes=item["nbytes"], seed=item["seed"])


def _verdict(producer, tid: str, bound_s: float) -> dict:
    """Polls the producer until it has decided tid; the bound detects a
    hang, it measures nothing."""
    outcome: dict[str, list] = {"done": [], "failed": []}

    def decided():
        out = producer.call("poll", 10, timeout_ms=200)
        outcome["done"] += out.get("done") or []
        outcome["failed"] += out.get("failed") or []
        return tid in outcome["done"] or any(f["transfer_id"] == tid for f in outcome["failed"])

    wait_until(decided, bound_s, interval=0, what=f"the producer's verdict on {tid}")
    return outcome


def _shard_killed_mid_write(workers, consumer_extra: dict, producer_config: dict, tag: str) -> None:
    """Shard 1 of two is killed while a 96 MiB item is written to both: the
    push fails within its deadline, shard 0 still serves what it held, bit
    for bit, and gets the failed item's memory back; shard 1, restarted as a
    new process (a fresh segment), then receives a batch bit-exact."""
    port = free_port_range(2, IP)
    started = iter(range(10))

    def shard(rank: int):
        config = _consumer(port, rank, 2, lease_s=KILL_LEASE_S, **consumer_extra)
        return workers("consumer", f"consumer-{tag}-{rank}-{next(started)}", config=config, slab_bytes=KILL_SLAB)

    shards = [shard(0), shard(1)]
    producer = workers("producer", f"producer-{tag}", config=producer_config)
    for worker in [*shards, producer]:
        worker.wait_ready(60)
    before = _items(f"{tag}a")
    big = _big(tag, 7)
    with Scheduler({"ec_ip": IP, "ec_port": port, "tp_size": 2, "push_wait_timeout_s": 30}) as scheduler:
        _deliver(scheduler, producer, port, before)
        _verify(shards, before)
        held = _in_use(shards[0])
        segment = shards[1].call("info", 10)["data"]

        _expect(scheduler, [big])
        _start_write(producer, shards, big, port)
        shards[1].kill()

        outcome = _verdict(producer, big["transfer_id"], 120)
        assert outcome["done"] == [], "a push cannot be done when a shard died before it was written"
        (failure,) = [f for f in outcome["failed"] if f["transfer_id"] == big["transfer_id"]]
        assert failure["reason"], failure
        wait_until(lambda: producer.call("poll", 10, timeout_ms=100) is not None and producer.call("held_sources", 10) == 0,
                   30, what="the source released")
        verdict = scheduler.wait([big["transfer_id"]], 60_000)
        assert big["transfer_id"] not in (verdict.get("available") or []), verdict
        wait_until(lambda: _in_use(shards[0]) == held and _writing(shards[0]) == 0, 2 * KILL_LEASE_S + 60,
                   what="shard 0 back to the memory it held before")
        (got,) = shards[0].call("acquire", 10, mm_hashes=[big["mm_hash"]])
        assert got.get("error"), f"shard 0 serves {big['mm_hash']}, which was never published"
        _verify(shards[:1], before)

        shards[1] = shard(1)
        shards[1].wait_ready(60)
        assert shards[1].call("info", 10)["data"] != segment, "the restarted shard has a fresh segment"
        after = _items(f"{tag}b")
        _deliver(scheduler, producer, port, after)
        again = {**big, "transfer_id": f"t-{tag}-big-again"}
        _deliver(scheduler, producer, port, [again])
        after.append(again)
    _verify(shards, after)
    _verify(shards[:1], before)
    assert producer.alive and shards[0].alive


def _producer_killed_mid_write(workers, consumer_extra: dict, producer_config: dict, tag: str) -> None:
    """A producer killed while its 96 MiB item is written: nothing hangs,
    the half-written item is never served, the slab is back to 0 within two
    leases, and a second producer's push of the same mm_hash is bit-exact."""
    port = free_port_range(1, IP)
    shard = workers("consumer", f"consumer-{tag}", config=_consumer(port, 0, 1, lease_s=KILL_LEASE_S, **consumer_extra),
                    slab_bytes=KILL_SLAB)
    first = workers("producer", f"producer-{tag}-0", config=producer_config)
    for worker in (shard, first):
        worker.wait_ready(60)
    big = _big(tag, 9)
    with Scheduler({"ec_ip": IP, "ec_port": port, "tp_size": 1, "push_wait_timeout_s": 30, "load_timeout_s": 5}) as scheduler:
        _expect(scheduler, [big])
        _start_write(first, [shard], big, port)
        first.kill()

        verdict = scheduler.wait([big["transfer_id"]], 90_000)
        assert verdict["failed"] == [big["transfer_id"]], verdict
        assert scheduler.has(big["mm_hash"]) is False
        wait_until(lambda: _in_use(shard) == 0 and _writing(shard) == 0, 2 * KILL_LEASE_S + 60, what="the slab emptied")
        (got,) = shard.call("acquire", 10, mm_hashes=[big["mm_hash"]])
        assert got.get("error"), "a half-written item must not be served"

        second = workers("producer", f"producer-{tag}-1", config=producer_config)
        second.wait_ready(60)
        _deliver(scheduler, second, port, [{**big, "transfer_id": f"t-{tag}-big-again"}])
    _verify([shard], [big])
    assert shard.alive


def _double_producer() -> dict:
    return {"transport": "mooncake", "mooncake_host": IP, "mooncake_staging_bytes": 16 * MiB, "control_timeout_s": 10, "push_wait_timeout_s": 30}


def test_shard_killed_mid_write_over_the_double(workers, double, monkeypatch):
    monkeypatch.setenv(native.MOONCAKE_LIBRARY_ENV, str(double))
    _shard_killed_mid_write(workers, {}, _double_producer(), "dkill")


def test_producer_killed_mid_write_over_the_double(workers, double, monkeypatch):
    monkeypatch.setenv(native.MOONCAKE_LIBRARY_ENV, str(double))
    _producer_killed_mid_write(workers, {}, _double_producer(), "dpkill")


# The real engine of Mooncake's pip wheel, carried by this package's shim:
# the outer test starts this file's inner tests again inside a network
# namespace of its own (loopback plus a veth pair on 10.231.0.1/24, for
# Mooncake advertises the first interface that is not loopback), so that
# the engines' traffic cannot leave it. ECMOONCAKE_REQUIRE_MOONCAKE=1
# (build/test.sh) makes a missing wheel or namespace a failure.
NETNS_ENV = "ECMOONCAKE_TEST_IN_NETNS"
REQUIRE_MOONCAKE = os.environ.get("ECMOONCAKE_REQUIRE_MOONCAKE") == "1"
NETNS_SETUP = (
    "set -e; ip link set lo up; ip link add ecm0 type veth peer name ecm1; "
    "ip addr add 10.231.0.1/24 dev ecm0; ip link set ecm0 up; ip link set ecm1 up; exec \"$@\""
)


def _skip_or_fail(why: str) -> None:
    if REQUIRE_MOONCAKE:
        pytest.fail(f"{why} (ECMOONCAKE_REQUIRE_MOONCAKE=1; bash build/setup.sh installs the wheel)")
    pytest.skip(f"the real Mooncake engine is NOT tested: {why}")


# The scenarios run inside the namespace, one outer test each (each outer
# test has its own deadline).
INNER = [
    "test_real_engine_p2p_inside_the_namespace",
    "test_real_engine_http_metadata_inside_the_namespace",
    "test_real_engine_shard_killed_mid_write_inside_the_namespace",
    "test_real_engine_shard_killed_mid_write_http_inside_the_namespace",
    "test_real_engine_producer_killed_mid_write_inside_the_namespace",
]


@pytest.mark.parametrize("inner", INNER)
def test_processes_over_the_real_engine_in_a_namespace(inner):
    wheel = environment.mooncake_wheel()
    if wheel is None:
        _skip_or_fail("no Mooncake wheel installed")
    if not Path(wheel["shim"]).is_file():
        _skip_or_fail(f"the shim {wheel['shim']} was not built (no g++)")
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        _skip_or_fail("a network namespace needs root, unshare and ip")
    env = dict(subprocess_env(), **{NETNS_ENV: "1"})
    env.pop(native.MOONCAKE_LIBRARY_ENV, None)
    cmd = ["unshare", "--net", "sh", "-c", NETNS_SETUP, "sh",
           sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{Path(__file__)}::{inner}"]
    done = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-6000:]
    assert "1 passed" in done.stdout, done.stdout[-3000:]


inside = pytest.mark.skipif(os.environ.get(NETNS_ENV) != "1", reason="runs inside the namespace the test above creates")


def _real_producer(**extra) -> dict:
    return {"transport": "mooncake", "mooncake_host": IP, "mooncake_protocol": "tcp", "mooncake_staging_bytes": 16 * MiB,
            "control_timeout_s": 10, "push_wait_timeout_s": 30, **extra}


@inside
def test_real_engine_p2p_inside_the_namespace(workers, monkeypatch):
    """Two TP shards and a producer, each a process of its own, over the
    wheel's engine found by the import machinery (no library named)."""
    monkeypatch.delenv(native.MOONCAKE_LIBRARY_ENV, raising=False)
    port = free_port_range(2, IP)
    _round_trip(workers, port, 2, {"mooncake_protocol": "tcp"}, _real_producer(), "real-p2p")


@inside
def test_real_engine_http_metadata_inside_the_namespace(workers, monkeypatch):
    monkeypatch.delenv(native.MOONCAKE_LIBRARY_ENV, raising=False)
    monkeypatch.delenv(native.METADATA_TOKEN_ENV, raising=False)
    port = free_port_range(1, IP)
    store = f"{IP}:{_free_port()}"
    url = f"http://{store}/metadata"
    consumer = {"mooncake_protocol": "tcp", "mooncake_metadata_server": store, "mooncake_metadata_open": True}
    _round_trip(workers, port, 1, consumer, _real_producer(mooncake_metadata=url), "real-http")


@inside
def test_real_engine_shard_killed_mid_write_inside_the_namespace(workers, monkeypatch):
    monkeypatch.delenv(native.MOONCAKE_LIBRARY_ENV, raising=False)
    _shard_killed_mid_write(workers, {"mooncake_protocol": "tcp"}, _real_producer(), "rkill")


@inside
def test_real_engine_shard_killed_mid_write_http_inside_the_namespace(workers, monkeypatch):
    """The same over our HTTP metadata store: the restarted shard's engine
    publishes its fresh segment there, and the producer finds it."""
    monkeypatch.delenv(native.MOONCAKE_LIBRARY_ENV, raising=False)
    monkeypatch.delenv(native.METADATA_TOKEN_ENV, raising=False)
    with MetadataServer(IP, 0, open=True) as store:
        consumer = {"mooncake_protocol": "tcp", "mooncake_metadata": store.url}
        _shard_killed_mid_write(workers, consumer, _real_producer(mooncake_metadata=store.url), "rhkill")


@inside
def test_real_engine_producer_killed_mid_write_inside_the_namespace(workers, monkeypatch):
    monkeypatch.delenv(native.MOONCAKE_LIBRARY_ENV, raising=False)
    _producer_killed_mid_write(workers, {"mooncake_protocol": "tcp"}, _real_producer(), "rpkill")



def test_the_double_is_no_cuda_build_so_a_pd_slab_stays_in_pinned_host_memory(double):
    from ecmooncake import ec_config

    info = native.mooncake_info(str(double), "")
    assert info["available"] and info["cuda"] is False, info
    extra = {"mooncake_library": str(double)}
    assert ec_config.mooncake_registers_gpu(extra) is False
