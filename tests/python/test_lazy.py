"""Importing the package must not load libecmooncake.so: vLLM imports it in
processes that fork afterwards, and a Go runtime does not survive a fork."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from conftest import subprocess_env

PROBE = textwrap.dedent(
    """
    import importlib, json, os, pkgutil, sys
    import numpy  # its BLAS may start threads of its own: count after it

    def threads():
        return len(os.listdir("/proc/self/task"))

    def mapped():
        with open("/proc/self/maps") as maps:
            return "libecmooncake" in maps.read()

    before = threads()
    import ecmooncake
    imported, skipped = [], []
    for mod in pkgutil.walk_packages(ecmooncake.__path__, "ecmooncake."):
        spec = mod.module_finder.find_spec(mod.name)
        if not spec.origin.endswith(".py"):
            continue  # the library itself: a .so looks like an extension module
        try:
            importlib.import_module(mod.name)
            imported.append(mod.name)
        except ImportError as exc:
            # Modules that need torch or vLLM are exempt where those are absent.
            if (exc.name or "").split(".")[0] in ("torch", "vllm"):
                skipped.append(mod.name)
                continue
            raise
    result = {"before": before, "after": threads(), "mapped": mapped(),
              "loaded": ecmooncake._ffi.loaded(), "imported": imported, "skipped": skipped}
    if "--load" in sys.argv:
        ecmooncake._ffi.lib()
        result.update(after_load=threads(), mapped_after_load=mapped())
    print(json.dumps(result))
    """
)


def probe(*args: str, **env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_loads_nothing():
    out = probe()
    assert "ecmooncake.native" in out["imported"]
    assert "ecmooncake.tools.demo" in out["imported"]
    assert "ecmooncake.__main__" in out["imported"]
    assert out["mapped"] is False
    assert out["loaded"] is False
    assert out["after"] == out["before"], "importing started threads"


def test_probe_sees_the_library_once_loaded(library):
    out = probe("--load", ECMOONCAKE_LIBRARY=str(library))
    assert out["mapped"] is False
    assert out["mapped_after_load"] is True
    assert out["after_load"] > out["after"], "the Go runtime starts threads when it loads"
