"""build/build_lib.py: clear errors for a missing toolchain, and nothing but
the library left beside it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = REPO / "build" / "build_lib.py"


@pytest.fixture
def build_lib():
    spec = importlib.util.spec_from_file_location("build_lib_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_tools(folder: Path, *names: str, pkg_config_ok: bool = True) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        tool = folder / name
        status = 0 if name != "pkg-config" or pkg_config_ok else 1
        tool.write_text(f"#!/bin/sh\nexit {status}\n")
        tool.chmod(0o755)
    return str(folder)


def test_missing_go_is_named(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")],
        env=dict(os.environ, PATH=fake_tools(tmp_path / "bin", "gcc", "pkg-config")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "'go'" in proc.stderr and "not on PATH" in proc.stderr
    assert not (tmp_path / "out" / "libecmooncake.so").exists()


def test_missing_libzmq_names_the_debian_package(build_lib, tmp_path, monkeypatch):
    monkeypatch.setattr(build_lib, "INCLUDE_DIRS", [tmp_path / "include"])
    env = {"PATH": fake_tools(tmp_path / "bin", "go", "gcc", "pkg-config", pkg_config_ok=False)}
    with pytest.raises(build_lib.BuildError, match="libzmq3-dev"):
        build_lib.check_toolchain(env)


def test_libzmq_found_by_header_without_pkg_config(build_lib, tmp_path, monkeypatch):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "zmq.h").write_text("")
    monkeypatch.setattr(build_lib, "INCLUDE_DIRS", [tmp_path / "include"])
    env = {"PATH": fake_tools(tmp_path / "bin", "go", "gcc")}
    assert build_lib.check_toolchain(env) == str(tmp_path / "bin" / "go")


def test_missing_c_compiler_is_named(build_lib, tmp_path):
    env = {"PATH": fake_tools(tmp_path / "bin", "go", "pkg-config"), "CC": "clang-404"}
    with pytest.raises(build_lib.BuildError, match="clang-404"):
        build_lib.check_toolchain(env)


def test_go_header_is_not_left_beside_the_library(library):
    assert not library.with_suffix(".h").exists()


def test_prebuilt_without_the_library_is_named(build_lib, tmp_path):
    (tmp_path / "prebuilt").mkdir()
    (tmp_path / "prebuilt" / "ecm-ceiling").write_text("")
    with pytest.raises(build_lib.BuildError, match=r"lacks libecmooncake\.so: run 'python build/build_lib.py --out"):
        build_lib.copy_prebuilt(tmp_path / "prebuilt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_prebuilt_is_copied_and_a_missing_shim_said(build_lib, tmp_path, capsys):
    src = tmp_path / "prebuilt"
    src.mkdir()
    for name in ("libecmooncake.so", "ecm-ceiling"):
        (src / name).write_text(name)
    assert build_lib.copy_prebuilt(src, tmp_path / "out") == tmp_path / "out" / "libecmooncake.so"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ecm-ceiling", "libecmooncake.so"]
    assert (tmp_path / "out" / "ecm-ceiling").read_text() == "ecm-ceiling"
    assert "libecmooncake_mooncake.so not packaged" in capsys.readouterr().err
