"""build/wheel.sh: the manylinux wheel installs into a fresh venv with pip
alone, every native file it installs resolves its libraries inside the wheel
or in the base system, and the demo pushes and verifies items from that venv
with no library of this tree or of the host's libzmq in the process.

The wheel is $ECMOONCAKE_WHEEL when the test command built one, else built
here by build/wheel.sh from the library the other tests load
($ECMOONCAKE_PREBUILT), so no Go is relinked.

The base system is glibc (libc, libm, libpthread, libdl, librt, libresolv,
the loader, the vDSO) and the GCC runtime (libstdc++, libgcc_s): each is in
every manylinux policy, so pip on any host the tag admits has them, and
PyTorch needs the host's libstdc++ rather than one bundled here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy
import pytest

from conftest import REPO

WHEEL_ENV = "ECMOONCAKE_WHEEL"
BASE_SYSTEM = {
    "linux-vdso.so.1",
    "ld-linux-x86-64.so.2",
    "libc.so.6",
    "libm.so.6",
    "libpthread.so.0",
    "libdl.so.2",
    "librt.so.1",
    "libresolv.so.2",
    "libstdc++.so.6",
    "libgcc_s.so.1",
}
WHEEL_NAME = re.compile(r"^ecmooncake-[^-]+-py3-none-manylinux_2_(\d+)_x86_64\.whl$")
# A loaded build machine: the first run also makes build/wheel.sh's tools venv.
BUILD_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def wheel(library, tmp_path_factory) -> Path:
    given = os.environ.get(WHEEL_ENV)
    if given:
        path = Path(given)
        assert path.is_file(), f"${WHEEL_ENV}={given} is not a file"
        return path
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        ["bash", str(REPO / "build" / "wheel.sh"), str(out)],
        env=dict(os.environ, ECMOONCAKE_PREBUILT=str(library.parent)),
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"build/wheel.sh failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path.parent == out and path.is_file(), f"build/wheel.sh printed {path}, not a wheel in {out}"
    return path


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> dict:
    """A fresh venv with the wheel installed by pip (no index, no deps), and
    an environment that sees nothing of this tree: numpy alone is lent from
    this interpreter, as the GPU host's python3 lends it."""
    root = tmp_path_factory.mktemp("venv")
    # Nothing of this tree: its python/ (with the egg-info a build leaves)
    # on PYTHONPATH would make pip take the package as installed already.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ECMOONCAKE_") and k != "PYTHONPATH"}
    env.update(PYTHONNOUSERSITE="1", LD_LIBRARY_PATH="")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "env")], check=True, timeout=300)
    python = root / "env" / "bin" / "python"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"pip install of {wheel.name} failed:\n{proc.stderr}"
    site = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"], env=env, text=True
        ).strip()
    )
    assert (site / "ecmooncake" / "__init__.py").is_file(), f"pip did not install ecmooncake into {site}:\n{proc.stdout}"
    lent = root / "lent"
    lent.mkdir()
    numpy_dir = Path(numpy.__file__).parent
    for name in (numpy_dir.name, numpy_dir.name + ".libs"):
        if (numpy_dir.parent / name).exists():
            (lent / name).symlink_to(numpy_dir.parent / name)
    env.update(PYTHONPATH=str(lent))
    return {"python": python, "site": site, "env": env, "cwd": root}


def run_in(venv: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv["python"]), *args], cwd=venv["cwd"], env=venv["env"], capture_output=True, text=True, timeout=timeout
    )


def is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def ldd(path: Path) -> list[tuple[str, str]]:
    """(name, resolved path or 'not found') per library the loader would
    map for path, the system's search path included; [] for a static file."""
    proc = subprocess.run(["ldd", str(path)], env={"LD_LIBRARY_PATH": "", "PATH": os.environ["PATH"]},
                          capture_output=True, text=True, timeout=60)
    if "not a dynamic executable" in proc.stdout + proc.stderr or "statically linked" in proc.stdout:
        return []
    assert proc.returncode == 0, f"ldd {path}: {proc.stderr}"
    found = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if "=>" in line:
            name, rest = (s.strip() for s in line.split("=>", 1))
            found.append((name, "not found" if rest.startswith("not found") else rest.split(" (")[0]))
        elif line:
            target = line.split(" (")[0]
            found.append((Path(target).name, target))
    return found


def test_wheel_is_manylinux_for_any_python3(wheel, library):
    match = WHEEL_NAME.match(wheel.name)
    assert match, f"{wheel.name}: want ecmooncake-V-py3-none-manylinux_2_N_x86_64.whl"
    # The tag's glibc: 2.35 runs on Ubuntu 22.04 and 24.04 and Debian 12; a
    # build host newer than this must be said in docs/operations.md.
    assert int(match.group(1)) <= 36, f"{wheel.name} needs glibc 2.{match.group(1)}"
    names = zipfile.ZipFile(wheel).namelist()
    want = ["ecmooncake/libecmooncake.so", "ecmooncake/ecm-ceiling", "ecmooncake/settings.json", "ecmooncake/connector/__init__.py"]
    if (library.parent / "libecmooncake_mooncake.so").is_file():
        want.append("ecmooncake/libecmooncake_mooncake.so")
    assert [n for n in want if n not in names] == []
    bundled = [Path(n).name for n in names if n.startswith("ecmooncake.libs/")]
    assert any(n.startswith("libzmq-") for n in bundled), f"libzmq is not bundled: {bundled}"
    assert [n for n in bundled if n.startswith(("libstdc++", "libgcc_s", "libc.", "libm."))] == []


def test_installed_native_files_resolve_inside_the_wheel(venv):
    package, libs = venv["site"] / "ecmooncake", venv["site"] / "ecmooncake.libs"
    files = sorted(p for d in (package, libs) for p in d.rglob("*") if p.is_file() and is_elf(p))
    assert package / "libecmooncake.so" in files
    outside = {}
    for path in files:
        for name, target in ldd(path):
            inside = target != "not found" and Path(target).resolve().is_relative_to(venv["site"].resolve())
            if not inside and name not in BASE_SYSTEM:
                outside.setdefault(str(path.relative_to(venv["site"])), []).append(f"{name} => {target}")
    assert outside == {}, "resolved outside the wheel and the base system:\n" + json.dumps(outside, indent=1)
    assert any(p.parent == libs for p in files), f"nothing bundled in {libs}"
    zmq = [target for name, target in ldd(package / "libecmooncake.so") if "libzmq" in name]
    assert len(zmq) == 1 and Path(zmq[0]).parent.resolve() == libs.resolve(), zmq


def test_library_loads_from_the_venv_without_the_hosts_libzmq(venv):
    proc = run_in(
        venv,
        "-c",
        "import json, ecmooncake\n"
        "from ecmooncake import _ffi\n"
        "print(ecmooncake.gpu_info()['available'] in (True, False))\n"
        "maps = sorted({l.split()[-1] for l in open('/proc/self/maps') if '/' in l})\n"
        "print(json.dumps({'package': ecmooncake.__file__, 'library': str(_ffi.find()), 'maps': maps}))",
    )
    assert proc.returncode == 0, proc.stderr
    ok, report = proc.stdout.splitlines()[-2:]
    assert ok == "True"
    report = json.loads(report)
    site = str(venv["site"])
    assert report["package"].startswith(site) and report["library"].startswith(site), report
    zmq = [m for m in report["maps"] if "libzmq" in m]
    assert zmq and all(m.startswith(site + "/ecmooncake.libs/") for m in zmq), zmq
    assert [m for m in report["maps"] if str(REPO) in m] == []


def test_demo_pushes_and_verifies_from_the_venv(venv):
    # Two shards and a producer in processes of their own, and the TCP
    # ceiling from the wheel's ecm-ceiling, each byte checked.
    proc = run_in(
        venv, "-m", "ecmooncake", "demo", "--items", "4", "--min-mb", "0.05", "--max-mb", "0.25",
        "--ceiling-mb", "8", "--json", "--quiet",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert (result["ok"], result["items"], result["verified"], result["failed"], result["mismatched"]) == (True, 4, 4, 0, 0)
    assert result["ceiling"]["gb_per_s"] > 0
