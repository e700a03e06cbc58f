"""The raw C exports refuse bad arguments before doing any work, and refuse
every call from a child forked after the library was loaded, instead of
hanging, aborting the process or leaving an object nobody can close."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from ctypes import byref, c_int32, c_uint64, c_void_p

import pytest

from conftest import subprocess_env, without_hanging
from ecmooncake import _ffi, native, packed

pytestmark = pytest.mark.usefixtures("library")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw(name: str, *args) -> tuple[int, str | None]:
    """Calls an export with args + (&err,); returns (status, message)."""
    dll = _ffi.lib()
    err = c_void_p()
    rc = getattr(dll, name)(*args, byref(err))
    return rc, _ffi.take_string(dll, err)


def _consumer_config(port: int) -> bytes:
    return json.dumps({"ec_ip": "127.0.0.1", "ec_port": port}).encode()


def test_consumer_open_with_null_out_opens_nothing():
    port = _free_port()
    slab = (ctypes.c_uint8 * (1 << 20))()
    rc, msg = _raw("ecm_consumer_open", _consumer_config(port), ctypes.addressof(slab), len(slab), None)
    assert rc == _ffi.ECM_ERR_INVALID
    assert "out is NULL" in msg
    # Had it opened a shard, the port would still be bound by a shard that
    # no handle names.
    out = c_uint64()
    rc, msg = _raw("ecm_consumer_open", _consumer_config(port), ctypes.addressof(slab), len(slab), byref(out))
    assert rc == _ffi.ECM_OK, msg
    assert _raw("ecm_close", out.value) == (_ffi.ECM_OK, None)


def test_metadata_server_open_with_null_out_opens_nothing():
    port = _free_port()
    # A token, because the store refuses to serve without one (or open).
    cfg = json.dumps({"port": port, "token": "abi-guards"}).encode()
    rc, msg = _raw("ecm_metadata_server_open", cfg, None)
    assert rc == _ffi.ECM_ERR_INVALID and "out is NULL" in msg
    out = c_uint64()
    rc, msg = _raw("ecm_metadata_server_open", cfg, byref(out))
    assert rc == _ffi.ECM_OK, msg
    assert _raw("ecm_close", out.value)[0] == _ffi.ECM_OK


@pytest.mark.parametrize(
    "name, args",
    [
        ("ecm_abi_version", (None,)),
        ("ecm_gpu_info", (None,)),
        ("ecm_mooncake_info", (b"{}", None)),
        ("ecm_stats", (1, None)),
        ("ecm_trace", (b"{}", None)),
        ("ecm_consumer_info", (1, None)),
        ("ecm_consumer_acquire", (1, b"{}", None)),
        ("ecm_consumer_release", (1, b"{}", None)),
        ("ecm_producer_open", (b"{}", None)),
        ("ecm_producer_submit_packed", (1, 0, None, 0, None)),
        ("ecm_producer_poll", (1, 0, None)),
        ("ecm_scheduler_open", (b"{}", None)),
        ("ecm_scheduler_step", (1, b"{}", None)),
        ("ecm_scheduler_has", (1, b"h", None)),
        ("ecm_scheduler_wait", (1, b"{}", 0, None)),
        ("ecm_proxy_open", (b'{"host": "127.0.0.1", "port": 0, "pd": ["http://127.0.0.1:1"]}', None)),
        ("ecm_registrar_open", (b'{"proxies": ["http://127.0.0.1:1"], "role": "encode", "url": "http://127.0.0.1:2"}', None)),
        ("ecm_metrics_text", (None,)),
    ],
)
def test_null_out_is_refused(name, args):
    # Refused before any work: no socket opened, no server started, so the
    # call returns an error instead of waiting on something (the bound only
    # catches a hang).
    rc, msg = without_hanging(lambda: _raw(name, *args), what=name)
    assert rc == _ffi.ECM_ERR_INVALID, (rc, msg)
    assert f"{name}: out" in msg and "is NULL" in msg


def test_the_hang_bound_reports_a_hang_and_passes_errors_through():
    # What the refusals above rely on: a call that never returns fails the
    # test instead of passing, and a call that raises raises.
    stuck = threading.Event()
    try:
        with pytest.raises(pytest.fail.Exception, match="stuck call hung"):
            without_hanging(stuck.wait, bound_s=0.01, what="stuck call")
    finally:
        stuck.set()
    with pytest.raises(ZeroDivisionError):
        without_hanging(lambda: 1 // 0)
    assert without_hanging(lambda: "value") == "value"


def _source(ptr: int, nbytes: int, mm_hash: bytes = b"h", device: int = -1, stream: int = 0) -> bytes:
    return packed.SOURCE_HEAD.pack(ptr, nbytes, stream, device, len(mm_hash)) + mm_hash


@pytest.mark.parametrize("name", ["ecm_producer_submit_packed", "ecm_producer_sources_packed"])
@pytest.mark.parametrize("count", [_ffi.ECM_MAX_SOURCES + 1, 1 << 62, (1 << 64) - 1])
def test_lying_count_is_refused(name, count):
    with native.Producer({}) as p:
        rc, msg = _raw(name, p.handle, count, None, 0, byref(c_void_p() if "submit" in name else c_uint64()))
        assert rc == _ffi.ECM_ERR_INVALID
        assert f"n = {count}" in msg and str(_ffi.ECM_MAX_SOURCES) in msg


def test_null_arrays_and_lying_lengths_are_refused():
    with native.Producer({}) as p:
        out = (c_uint64 * 2)()
        rc, msg = _raw("ecm_producer_sources_packed", p.handle, 2, None, 64, out)
        assert rc == _ffi.ECM_ERR_INVALID and "in is NULL but its length is 64 bytes" in msg
        rc, msg = _raw("ecm_producer_sources_packed", p.handle, 2, None, 0, out)
        assert rc == _ffi.ECM_ERR_INVALID and "2 items need at least" in msg
        body = _source(0, 16)
        rc, msg = _raw("ecm_producer_sources_packed", p.handle, 1, body, len(body), None)
        assert rc == _ffi.ECM_ERR_INVALID and "out_sources is NULL" in msg
        rc, msg = _raw("ecm_producer_sources_packed", p.handle, 1, body, len(body), out)
        assert rc == _ffi.ECM_ERR_INVALID and "item 0 (h) is NULL" in msg and "16 bytes" in msg
        buf = (ctypes.c_uint8 * 16)()
        body = _source(ctypes.addressof(buf), (1 << 64) - 1)
        rc, msg = _raw("ecm_producer_sources_packed", p.handle, 1, body, len(body), out)
        assert rc == _ffi.ECM_ERR_INVALID and "address space" in msg
        rc, msg = _raw("ecm_producer_sources_packed", p.handle, 1, body[:-1], len(body) - 1, out)
        assert rc == _ffi.ECM_ERR_INVALID and "mm_hash is 1 bytes, 0 remain" in msg
        assert list(out) == [0, 0], "nothing was sourced"
        assert p.stats() is not None, "the producer still answers"
    slab = (ctypes.c_uint8 * 256)()
    out = c_uint64()
    rc, msg = _raw("ecm_consumer_open", _consumer_config(_free_port()), None, 1 << 20, byref(out))
    assert rc == _ffi.ECM_ERR_INVALID and "slab is NULL" in msg
    rc, msg = _raw("ecm_consumer_open", _consumer_config(_free_port()), ctypes.addressof(slab), 1 << 63, byref(out))
    assert rc == _ffi.ECM_ERR_INVALID and "address space" in msg


def _in_child(body, timeout: float = 30.0) -> dict:
    """Runs body() in a forked child; returns the dict it returned. A child
    that hangs is killed, and the test fails instead of blocking."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3
        try:
            os.close(r)
            signal.alarm(int(timeout) + 5)
            out = body()
            os.write(w, json.dumps(out).encode())
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            try:
                os.write(w, json.dumps({"exception": repr(exc)}).encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            pytest.fail(f"the forked child hung for {timeout}s instead of failing")
        time.sleep(0.02)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, data)
    return json.loads(data)


def test_forked_child_fails_clearly_instead_of_hanging():
    dll = _ffi.lib()
    parent = os.getpid()
    # A producer with its goroutines and ZMQ threads running: the state in
    # which a child's calls used to hang.
    p = native.Producer({})
    try:

        def child() -> dict:
            out = {}
            err, h = c_void_p(), c_uint64()
            rc = dll.ecm_producer_open(b"{}", byref(h), byref(err))
            out["open"] = (rc, _ffi.take_string(dll, err))
            rc = dll.ecm_close(p.handle, byref(err))
            out["close"] = (rc, _ffi.take_string(dll, err))
            v = c_int32(-1)
            rc = dll.ecm_abi_version(byref(v), byref(err))
            out["abi"] = (rc, _ffi.take_string(dll, err))
            try:
                native.Producer({})
                out["python"] = None
            except Exception as exc:  # noqa: BLE001
                out["python"] = f"{type(exc).__name__}: {exc}"
            out["pid"] = os.getpid()
            return out

        got = _in_child(child)
        want = f"libecmooncake was loaded in pid {parent} and called from forked child {got['pid']}; load it after fork"
        for call in ("open", "close", "abi"):
            rc, msg = got[call]
            assert rc == _ffi.ECM_ERR_STATE, (call, got[call])
            assert want in msg, (call, msg)
        assert got["python"] is not None and want in got["python"]
        assert isinstance(p.stats(), dict), "the parent's producer is untouched"
    finally:
        p.close()


# Forks from the main thread while two threads keep calling into the
# library, so that a fork often lands while a Go thread holds the only P
# (GOMAXPROCS=1) or a runtime lock; each child then calls exports. A child
# that entered the Go runtime would wait forever for what the parent's
# threads held. It prints, as JSON, the (status, message) of each child's
# calls, or null for a child that did not answer before the deadline.
_FORK_DURING_CALLS = r"""
import json, os, signal, sys, threading, time
from ctypes import byref, c_int32, c_uint64, c_void_p
from ecmooncake import _ffi, native
children, deadline_s = int(sys.argv[1]), float(sys.argv[2])
dll = _ffi.lib()
producer = native.Producer({})
stop = threading.Event()
def hammer():
    v, e = c_int32(), c_void_p()
    while not stop.is_set():
        dll.ecm_abi_version(byref(v), byref(e))
        dll.ecm_stats(producer.handle, byref(c_void_p()), byref(e))
threads = [threading.Thread(target=hammer, daemon=True) for _ in range(2)]
for t in threads:
    t.start()
pipes = {}
for _ in range(children):
    time.sleep(0.005)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(int(deadline_s) + 5)
        out = []
        for call in (
            lambda err: dll.ecm_abi_version(byref(c_int32()), err),
            lambda err: dll.ecm_producer_open(b"{}", byref(c_uint64()), err),
            lambda err: dll.ecm_close(producer.handle, err),
        ):
            err = c_void_p()
            rc = call(byref(err))
            out.append((rc, _ffi.take_string(dll, err)))
        os.write(w, json.dumps({"pid": os.getpid(), "calls": out}).encode())
        os._exit(0)
    os.close(w)
    pipes[pid] = r
stop.set()
deadline = time.monotonic() + deadline_s
results = []
for pid, r in pipes.items():
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            results.append(None)
            break
        time.sleep(0.02)
    else:
        with os.fdopen(r, "rb") as f:
            data = f.read()
        results.append(json.loads(data) if data else None)
for t in threads:
    t.join()
producer.close()
print(json.dumps({"parent": os.getpid(), "results": results}))
"""


def test_children_forked_during_calls_are_refused_without_entering_the_runtime():
    # The check must come before the Go runtime is entered: in a child,
    # entering it can wait forever on a P or a lock that a parent's thread
    # held at the fork.
    children = 24
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_DURING_CALLS, str(children), "60"],
        env=subprocess_env(GOMAXPROCS="1"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    hung = sum(r is None for r in got["results"])
    assert hung == 0, f"{hung} of {children} forked children hung in a call instead of being refused"
    for r in got["results"]:
        want = f"libecmooncake was loaded in pid {got['parent']} and called from forked child {r['pid']}; load it after fork"
        for rc, msg in r["calls"]:
            assert rc == _ffi.ECM_ERR_STATE, (rc, msg)
            assert want in msg, msg
