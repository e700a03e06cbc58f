"""The loader and the error path of the Python layers, against a stub library
generated from the header (no Go needed): lookup, ABI check, status to
exception mapping, and that every string the library returns is freed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

import header
from conftest import subprocess_env
from ecmooncake import _ffi

STUB_OUT_JSON = '{"items": [], "stub": true}'


def stub_source() -> str:
    """C source of a library with every header function: each returns
    $STUB_STATUS (default 1) and, on failure, an error text; on success it
    fills its out-params."""
    out = [
        "#include <stdint.h>",
        "#include <stdlib.h>",
        "#include <string.h>",
        '#include "ecmooncake.h"',
        "int stub_frees = 0;",
        "int stub_calls = 0;",
        "static int status(void) { const char *s = getenv(\"STUB_STATUS\"); return s ? atoi(s) : 1; }",
    ]
    for fn in header.functions():
        sig = f"{fn.returns} {fn.name}({', '.join(p.decl for p in fn.params)})"
        names = {p.name for p in fn.params}
        if fn.name == "ecm_abi_version":
            body = "*out_version = STUB_ABI; if (err) *err = NULL; return 0;"
        elif fn.name == "ecm_free":
            body = "if (p) { stub_frees++; free(p); }"
        else:
            fill = []
            if "out_json" in names:
                fill.append(f"*out_json = strdup({json.dumps(STUB_OUT_JSON)});")
            for p in fn.params:
                if p.name.startswith("out") and p.name != "out_json":
                    fill.append(f"*{p.name} = 42;")
            body = (
                "stub_calls++; int rc = status();"
                f' if (rc != 0) {{ if (err) *err = strdup("stub refuses {fn.name}"); return rc; }}'
                f" {' '.join(fill)} return 0;"
            )
        out.append(f"{sig} {{ {body} }}")
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stub library")
    folder = tmp_path_factory.mktemp("stub")
    src = folder / "stub.c"
    src.write_text(stub_source())
    built = {}
    for abi in (_ffi.ABI_VERSION, _ffi.ABI_VERSION + 1):
        path = folder / f"libstub{abi}.so"
        subprocess.run(
            [cc, "-shared", "-fPIC", f"-DSTUB_ABI={abi}", f"-I{header.HEADER.parent}", "-o", str(path), str(src)],
            check=True,
            timeout=120,
        )
        built[abi] = path
    return built


def run_with(library, code: str, status: int = 1) -> dict:
    """Runs code in a fresh interpreter using library; returns the JSON it prints."""
    prelude = textwrap.dedent(
        """
        import ctypes, json
        import numpy as np
        import ecmooncake
        from ecmooncake import _ffi, native
        def frees():
            return ctypes.c_int.in_dll(_ffi.lib(), "stub_frees").value
        def calls():
            return ctypes.c_int.in_dll(_ffi.lib(), "stub_calls").value
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=subprocess_env(ECMOONCAKE_LIBRARY=str(library), STUB_STATUS=str(status)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_wrong_abi_is_refused_clearly(stubs):
    out = run_with(
        stubs[_ffi.ABI_VERSION + 1],
        """
        try:
            _ffi.lib()
            print(json.dumps({"error": None}))
        except _ffi.LibraryError as exc:
            print(json.dumps({"error": str(exc), "loaded": _ffi.loaded()}))
        """,
    )
    assert f"ABI version {_ffi.ABI_VERSION + 1}" in out["error"]
    assert f"speaks {_ffi.ABI_VERSION}" in out["error"]
    assert out["loaded"] is False


def test_missing_library_names_paths_tried(monkeypatch, tmp_path):
    missing = [tmp_path / "nowhere" / _ffi.LIBRARY_NAME, tmp_path / "elsewhere" / _ffi.LIBRARY_NAME]
    monkeypatch.setattr(_ffi, "candidates", lambda: missing)
    with pytest.raises(_ffi.LibraryError) as info:
        _ffi._load()
    for path in missing:
        assert str(path) in str(info.value)
    assert _ffi.LIBRARY_ENV in str(info.value)


def test_env_var_comes_first(monkeypatch, tmp_path):
    monkeypatch.setenv(_ffi.LIBRARY_ENV, str(tmp_path / "custom.so"))
    paths = _ffi.candidates()
    assert paths[0] == tmp_path / "custom.so"
    assert paths[-1].parent.name == "ecmooncake"


def test_every_error_status_has_one_class():
    from ecmooncake import errors

    statuses = {v for k, v in vars(_ffi).items() if k.startswith("ECM_ERR_")}
    assert set(errors.ERRORS) == statuses
    assert all(cls.code == status for status, cls in errors.ERRORS.items())
    with pytest.raises(TypeError, match="already EcmTimeout"):
        type("AnotherTimeout", (errors.EcmError,), {}, status=_ffi.ECM_ERR_TIMEOUT)
    # A caller's refinement names no status and keeps its parent's.
    assert type("Mine", (errors.EcmInvalid,), {}).code == _ffi.ECM_ERR_INVALID
    assert errors.ERRORS[_ffi.ECM_ERR_INVALID] is errors.EcmInvalid


@pytest.mark.parametrize(
    "status, cls",
    [
        (_ffi.ECM_ERR_INVALID, "EcmInvalid"),
        (_ffi.ECM_ERR_HANDLE, "EcmHandleError"),
        (_ffi.ECM_ERR_STATE, "EcmStateError"),
        (_ffi.ECM_ERR_IO, "EcmIOError"),
        (_ffi.ECM_ERR_TIMEOUT, "EcmTimeout"),
        (_ffi.ECM_ERR_INTERNAL, "EcmInternal"),
        (_ffi.ECM_ERR_UNAVAILABLE, "EcmUnavailable"),
        (99, "EcmError"),
    ],
)
def test_status_becomes_exception_with_message(stubs, status, cls):
    out = run_with(
        stubs[_ffi.ABI_VERSION],
        """
        try:
            native.configure(log_level="warn")
        except native.EcmError as exc:
            print(json.dumps({"cls": type(exc).__name__, "code": exc.code, "msg": str(exc), "frees": frees()}))
        """,
        status=status,
    )
    assert out["cls"] == cls
    assert out["code"] == status
    assert out["msg"] == "ecm_configure: stub refuses ecm_configure"
    assert out["frees"] == 1


def test_success_paths_free_every_string(stubs):
    out = run_with(
        stubs[_ffi.ABI_VERSION],
        """
        slab = np.zeros(64, dtype=np.float32)
        c = native.Consumer({"ec_port": 1}, slab)
        handle = c.handle
        before = frees()
        stats = c.stats()
        info = c.info()
        items = c.acquire(["a"])
        after = frees()
        v = c.view(8, 16)
        slab.view(np.uint8)[8:24] = 7
        shares = bool((v == 7).all())
        try:
            c.view(250, 10)
            outside = None
        except native.EcmInvalid as exc:
            outside = str(exc)
        c.close()
        with native.Producer({}) as p:
            sid = p.source("h", np.ones(5, dtype=np.uint8))
            held = p.held_sources
        print(json.dumps({
            "handle": handle, "stats": stats, "info": info, "items": items, "freed": after - before,
            "shares": shares, "outside": outside,
            "sid": sid, "held": held, "held_after_close": p.held_sources, "closed": p.closed,
            "view_nbytes": int(v.nbytes),
        }))
        """,
        status=0,
    )
    assert out["handle"] == 42
    assert out["stats"]["stub"] is True and out["info"]["stub"] is True
    assert out["items"] == []
    assert out["freed"] == 3
    assert out["shares"] is True and out["view_nbytes"] == 16
    assert "outside the 256-byte slab" in out["outside"]
    assert out["sid"] == 42 and out["held"] == 1
    assert out["held_after_close"] == 0 and out["closed"] is True


def test_close_twice_calls_library_once(stubs):
    out = run_with(
        stubs[_ffi.ABI_VERSION],
        """
        s = native.Scheduler({})
        n0 = calls()
        s.close()
        n1 = calls()
        s.close()
        n2 = calls()
        try:
            s.has("x")
            err = None
        except native.EcmHandleError as exc:
            err = str(exc)
        print(json.dumps({"first": n1 - n0, "second": n2 - n1, "err": err, "calls_after": calls() - n2}))
        """,
        status=0,
    )
    assert out == {"first": 1, "second": 0, "err": "scheduler is closed", "calls_after": 0}


def test_loads_once_across_threads(stubs):
    out = run_with(
        stubs[_ffi.ABI_VERSION],
        """
        import threading
        got = []
        barrier = threading.Barrier(8)
        def worker():
            barrier.wait()
            got.append(id(_ffi.lib()))
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join(30)
        print(json.dumps({"distinct": len(set(got)), "count": len(got)}))
        """,
    )
    assert out == {"distinct": 1, "count": 8}
