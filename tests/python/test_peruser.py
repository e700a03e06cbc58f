"""One host without any secret settings: every process of a uid shares a
per-user secret the library creates on first use, so same-uid producers and
consumers interoperate over CURVE, and a process of another uid, which
cannot read the file, is refused instead of poisoning an mm_hash."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from conftest import subprocess_env, wait_until
from ecmooncake import _ffi
from ecmooncake.native import Consumer, EcmInvalid, Producer
from ecmooncake.tools.harness import free_port_range

IP = "127.0.0.1"
NOBODY = 65534

# Run as another uid: pushes EVILEVIL for the hash given and prints how
# the push ended.
ATTACKER = r"""
import ctypes, json, struct, sys, time
from ctypes import byref, c_int32, c_uint64, c_void_p
try:
    import numpy
except ImportError:  # another uid may not reach this interpreter's packages; ctypes is enough here
    import types
    sys.modules["numpy"] = types.ModuleType("numpy")
from ecmooncake import _ffi
from ecmooncake.auth import with_auth_default
endpoint, mm_hash = sys.argv[1], sys.argv[2]
dll = _ffi.lib()

def call(name, *args, out=False):
    err, text = c_void_p(), c_void_p()
    rc = getattr(dll, name)(*args, *((byref(text),) if out else ()), byref(err))
    message, text = _ffi.take_string(dll, err), _ffi.take_string(dll, text)
    if rc:
        print(json.dumps({"failed": [message]})); sys.exit(0)
    return json.loads(text) if out and text is not None else None

config = with_auth_default({"transport": "tcp", "control_timeout_s": 5})
h = c_uint64(0)
call("ecm_producer_open", json.dumps(config).encode(), byref(h))
# The packed records of include/ecmooncake.h, written out by hand.
fields = [b"evil", mm_hash.encode(), endpoint.encode(), b""]
body = struct.pack("<QIIII", 4096, *map(len, fields)) + b"".join(fields)
reasons = call("ecm_producer_submit_packed", h, 1, body, len(body), out=True)
if reasons:
    print(json.dumps({"failed": reasons})); sys.exit(0)
data = ctypes.create_string_buffer(b"EVILEVIL" * 512, 4096)
ids = (c_uint64 * 1)()
source = struct.pack("<QQQiI", ctypes.addressof(data), 4096, 0, -1, len(mm_hash)) + mm_hash.encode()
call("ecm_producer_sources_packed", h, 1, source, len(source), ids)
end = time.monotonic() + 60
while time.monotonic() < end:
    got = call("ecm_producer_poll", h, c_int32(200), out=True)
    if got.get("done") or got.get("failed"):
        print(json.dumps(got)); sys.exit(0)
print(json.dumps({"stuck": True}))
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A HOME of this test's own, so the per-user secret is made afresh."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def push(producer: Producer, endpoint: str, tid: str, mm_hash: str, data: np.ndarray) -> dict:
    out = producer.submit([{"transfer_id": tid, "mm_hash": mm_hash, "nbytes": data.nbytes, "consumer": endpoint}])
    assert not out[0].get("error"), out
    producer.source(mm_hash, data)
    seen: dict = {}

    def ended():
        got = producer.poll(200)
        for key in ("done", "failed"):
            seen.setdefault(key, []).extend(got.get(key) or [])
        return seen["done"] or seen["failed"]

    wait_until(ended, 30, interval=0, what=f"push {tid} ended")
    return seen


@pytest.mark.usefixtures("library")
def test_same_uid_interoperates_without_secret_settings(home):
    port = free_port_range(1, IP)
    slab = np.zeros(1 << 20, np.uint8)
    data = np.arange(8192, dtype=np.uint32).view(np.uint8)[:8192].copy()
    with Consumer({"ec_ip": IP, "ec_port": port}, slab) as consumer, \
            Producer({"transport": "tcp", "control_timeout_s": 10}) as producer:
        seen = push(producer, f"tcp://{IP}:{port}", "mine", "m" * 64, data)
        assert seen["done"] == ["mine"] and not seen["failed"], seen
        (got,) = consumer.acquire(["m" * 64])
        assert not got.get("error"), got
        assert consumer.view(got["offset"], got["nbytes"]).tobytes() == data.tobytes()
        consumer.release(["m" * 64])
    path = home / ".cache" / "ecmooncake" / "secret"
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(path.read_text().strip()) == 44, "32 random bytes, base64"


def give_package(theirs: str, library) -> dict[str, str]:
    """Copies the package and the library this process loaded into theirs,
    a folder of the other uid's, and returns the environment that runs
    them: the checkout may lie where that uid cannot enter (under /root,
    or a 0700 folder), and what it runs must not depend on that."""
    package = Path(_ffi.__file__).resolve().parent
    root = Path(theirs) / "pkg"
    copy = root / "ecmooncake"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy2(library, copy / _ffi.LIBRARY_NAME)
    for path in [root, *root.rglob("*")]:
        os.chown(path, NOBODY, NOBODY)
    env = subprocess_env(HOME=theirs, PYTHONPATH=str(root), **{_ffi.LIBRARY_ENV: str(copy / _ffi.LIBRARY_NAME)})
    env.pop("XDG_RUNTIME_DIR", None)
    return env


def test_another_uid_is_refused_and_cannot_poison(home, library):
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("running a process as another uid needs root and setpriv")
    port = free_port_range(1, IP)
    endpoint, mm_hash = f"tcp://{IP}:{port}", "p" * 64
    slab = np.zeros(1 << 20, np.uint8)
    theirs = tempfile.mkdtemp(prefix="ecm-nobody-")
    try:
        os.chown(theirs, NOBODY, NOBODY)
        env = give_package(theirs, library)
        with Consumer({"ec_ip": IP, "ec_port": port}, slab) as consumer:
            run = subprocess.run(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                 sys.executable, "-c", ATTACKER, endpoint, mm_hash],
                env=env, capture_output=True, text=True, timeout=120, cwd=theirs,
            )
            assert run.returncode == 0, run.stderr
            outcome = json.loads(run.stdout.strip().splitlines()[-1])
            assert not outcome.get("done") and outcome.get("failed"), outcome
            assert "auth" in json.dumps(outcome["failed"]), outcome
            (got,) = consumer.acquire([mm_hash])
            assert got.get("error"), "the other uid's bytes must not be served"
            # The real producer of this uid still gets its bytes in.
            data = np.frombuffer(b"GOODGOOD" * 512, np.uint8).copy()
            with Producer({"transport": "tcp", "control_timeout_s": 10}) as producer:
                seen = push(producer, endpoint, "real", mm_hash, data)
            assert seen["done"] == ["real"], seen
            (got,) = consumer.acquire([mm_hash])
            assert consumer.view(got["offset"], got["nbytes"]).tobytes() == data.tobytes()
            consumer.release([mm_hash])
            assert consumer.stats()["control"].get("Refused"), "the shard counts the other uid's refusal"
    finally:
        shutil.rmtree(theirs, ignore_errors=True)


def test_secret_dir_is_resolved_in_python(home, monkeypatch):
    from ecmooncake import auth

    assert auth.secret_dir() == str(home / ".cache" / "ecmooncake")
    runtime = home / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert auth.secret_dir() == str(runtime / "ecmooncake")
    if os.geteuid() == 0:
        os.chown(runtime, NOBODY, NOBODY)
        assert auth.secret_dir() == str(home / ".cache" / "ecmooncake"), "a runtime dir of another uid is not ours"
    assert auth.with_auth_default({"auth_secret": "x" * 20}) == {"auth_secret": "x" * 20}
    assert auth.with_auth_default({"allow_unauthenticated": True}) == {"allow_unauthenticated": True}
    assert auth.with_auth_default({}) == {"auth_secret_dir": auth.secret_dir()}


@pytest.mark.usefixtures("library")
def test_secret_of_wrong_mode_or_beyond_loopback_is_refused(home):
    # The library makes the file on first use and refuses one that others
    # can read or change.
    with Producer({}):
        pass
    path = home / ".cache" / "ecmooncake" / "secret"
    path.chmod(0o644)
    with pytest.raises(EcmInvalid, match="chmod 600"):
        Producer({})
    path.chmod(0o600)
    path.parent.chmod(0o755)
    with pytest.raises(EcmInvalid, match="0755"):
        Producer({})
    path.parent.chmod(0o700)
    slab = np.zeros(1 << 20, np.uint8)
    with pytest.raises(EcmInvalid, match="allow_unauthenticated"):
        Consumer({"ec_ip": "0.0.0.0", "ec_port": free_port_range(1, IP)}, slab)


def test_refusals_by_name():
    from ecmooncake.native import REFUSED_IN_PROGRESS, REFUSED_OVER_QUOTA, refusal_of

    assert refusal_of("reserve refused: over_quota: reserve transfer t (h): over quota") == REFUSED_OVER_QUOTA
    assert refusal_of("reserve refused: in_progress: reserve transfer t (h): in progress") == REFUSED_IN_PROGRESS
    assert refusal_of("reserve refused: slab full") is None
    assert refusal_of("over_quota: not a reserve refusal") is None
