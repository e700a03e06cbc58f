#!/usr/bin/env python3
"""Builds libecmooncake.so and the ecm-ceiling command from the Go sources.

    python build/build_lib.py [--out DIR]

Runs ``go build -buildmode=c-shared`` on ./export from the repository root and
writes DIR/libecmooncake.so (default: python/ecmooncake/, where the Python
package looks for it), then builds ./core/transport/cmd/ecm-ceiling, the
benchmarks' TCP ceiling, into DIR/ecm-ceiling beside it (a static binary: it
needs neither cgo nor libzmq), and compiles the shim that carries the
``mooncake`` transport over a Mooncake pip wheel
(core/transport/mooncake/shim) into DIR/libecmooncake_mooncake.so with g++
($CXX); without a C++ compiler the shim is left out, said on stderr, and
``python -m ecmooncake doctor`` says so too. setup.py imports this file for ``pip install``,
so it uses the standard library only.

With ``$ECMOONCAKE_PREBUILT`` naming the folder of an earlier build (what
``--out`` wrote), setup.py packages that build instead of building again:
build/wheel.sh and its test reuse the library the tests already load rather
than spend minutes relinking it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = ROOT / "python" / "ecmooncake"
VERSION_SCRIPT = ROOT / "export" / "ecmooncake.map"
LIBRARY_NAME = "libecmooncake.so"
CEILING_NAME = "ecm-ceiling"
CEILING_PACKAGE = "./core/transport/cmd/ecm-ceiling"
SHIM_NAME = "libecmooncake_mooncake.so"
SHIM_SOURCE = ROOT / "core" / "transport" / "mooncake" / "shim" / "ecm_mooncake_shim.cpp"
# The same in core/transport/mooncake/mooncaketest.ShimFlags.
SHIM_FLAGS = ["-std=c++17", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
ZMQ_HINT = "install libzmq and its headers (Debian/Ubuntu: apt-get install libzmq3-dev)"
INCLUDE_DIRS = [Path("/usr/include"), Path("/usr/local/include")]
PREBUILT_ENV = "ECMOONCAKE_PREBUILT"


class BuildError(RuntimeError):
    pass


def check_toolchain(env: dict[str, str]) -> str:
    """The go binary to use; raises BuildError naming what is missing."""
    go = shutil.which("go", path=env.get("PATH"))
    if go is None:
        raise BuildError(
            "the Go toolchain ('go') is not on PATH: install Go 1.26 or newer "
            "from https://go.dev/dl/ and put its bin/ on PATH"
        )
    cc = env.get("CC") or "gcc"
    if shutil.which(cc.split()[0], path=env.get("PATH")) is None:
        raise BuildError(
            f"no C compiler ('{cc}'): cgo needs one (Debian/Ubuntu: apt-get install gcc)"
        )
    if not _has_libzmq(env):
        raise BuildError(f"libzmq was not found (pkg-config libzmq, zmq.h): {ZMQ_HINT}")
    return go


def _has_libzmq(env: dict[str, str]) -> bool:
    pkg_config = shutil.which("pkg-config", path=env.get("PATH"))
    if pkg_config is not None:
        probe = subprocess.run(
            [pkg_config, "--exists", "libzmq"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if probe.returncode == 0:
            return True
    # The zmq4 binding asks pkg-config, but a plain system install is found by
    # the compiler's default search paths even when pkg-config is absent.
    include_dirs = INCLUDE_DIRS + [Path(p) for p in env.get("CPATH", "").split(os.pathsep) if p]
    return any((d / "zmq.h").is_file() for d in include_dirs)


def build(out_dir: Path | str = PACKAGE_DIR, verbose: bool = True) -> Path:
    """Builds the library and ecm-ceiling into out_dir and returns the
    library's path."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LIBRARY_NAME
    env = dict(os.environ, CGO_ENABLED="1")
    go = check_toolchain(env)
    cmd = [
        go,
        "build",
        "-buildmode=c-shared",
        "-trimpath",
        # $ORIGIN lets libzmq and its dependencies travel beside the library
        # to hosts that lack them. An old-style DT_RPATH rather than RUNPATH:
        # the loader also searches it for libzmq's own dependencies.
        # The version script keeps every symbol but the gated ABI local:
        # no caller reaches the Go runtime past the fork gate (export/gate.c).
        # cgo refuses the flag in a #cgo directive, so it is passed here.
        f"-ldflags=-extldflags=-Wl,-rpath,$ORIGIN,--disable-new-dtags,--version-script={VERSION_SCRIPT}",
        "-o",
        str(target),
        "./export",
    ]
    if verbose:
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    result = subprocess.run(cmd, cwd=ROOT, env=env)
    # go writes its own generated header beside the library; the contract is
    # include/ecmooncake.h, so a second, different header must not ship.
    target.with_suffix(".h").unlink(missing_ok=True)
    if result.returncode != 0:
        raise BuildError(f"go build failed with exit status {result.returncode}")
    build_ceiling(out_dir, go, verbose)
    build_shim(out_dir, verbose)
    return target


def copy_prebuilt(src_dir: Path | str, out_dir: Path | str, verbose: bool = True) -> Path:
    """Copies an earlier build's library, ecm-ceiling and shim from src_dir
    into out_dir and returns the library's path. The library and ecm-ceiling
    must be there; a missing shim is left out, said on stderr, as build()
    does without a C++ compiler."""
    src_dir, out_dir = Path(src_dir).resolve(), Path(out_dir).resolve()
    missing = [name for name in (LIBRARY_NAME, CEILING_NAME) if not (src_dir / name).is_file()]
    if missing:
        raise BuildError(
            f"${PREBUILT_ENV}={src_dir} lacks {' and '.join(missing)}: "
            f"run 'python build/build_lib.py --out {src_dir}' first, or unset {PREBUILT_ENV} to build from source"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (LIBRARY_NAME, CEILING_NAME, SHIM_NAME):
        source = src_dir / name
        if not source.is_file():
            print(
                f"build_lib: {source} is absent: {SHIM_NAME} not packaged, so the mooncake transport "
                "cannot use a Mooncake pip wheel",
                file=sys.stderr,
            )
            continue
        if source != out_dir / name:
            if verbose:
                print(f"+ cp {source} {out_dir / name}", file=sys.stderr, flush=True)
            shutil.copy2(source, out_dir / name)
    return out_dir / LIBRARY_NAME


def build_shim(out_dir: Path, verbose: bool = True) -> Path | None:
    """Compiles the Mooncake wheel shim into out_dir; None, said on stderr,
    when there is no C++ compiler (only the wheel path needs it)."""
    cxx = (os.environ.get("CXX") or "g++").split()
    target = out_dir / SHIM_NAME
    if shutil.which(cxx[0]) is None:
        target.unlink(missing_ok=True)
        print(
            f"build_lib: no C++ compiler ('{cxx[0]}'): {SHIM_NAME} not built, so the mooncake transport "
            "cannot use a Mooncake pip wheel (Debian/Ubuntu: apt-get install g++)",
            file=sys.stderr,
        )
        return None
    cmd = [*cxx, *SHIM_FLAGS, "-o", str(target), str(SHIM_SOURCE), "-ldl"]
    if verbose:
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    result = subprocess.run(cmd, cwd=ROOT)
    if result.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed with exit status {result.returncode}")
    return target


def build_ceiling(out_dir: Path, go: str, verbose: bool = True) -> Path:
    """Builds ecm-ceiling into out_dir and returns its path."""
    target = out_dir / CEILING_NAME
    cmd = [go, "build", "-trimpath", "-o", str(target), CEILING_PACKAGE]
    if verbose:
        print("+ CGO_ENABLED=0 " + " ".join(cmd), file=sys.stderr, flush=True)
    result = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, CGO_ENABLED="0"))
    if result.returncode != 0:
        raise BuildError(f"go build of {CEILING_NAME} failed with exit status {result.returncode}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=str(PACKAGE_DIR),
        help=f"directory for {LIBRARY_NAME} and {CEILING_NAME} (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        path = build(args.out)
    except BuildError as exc:
        print(f"build_lib: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
