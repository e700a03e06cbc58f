"""The CPU-checkable parts of the GPU host's mooncake step
(``bash build/gpu_run.sh mooncake``): the script's syntax and commands, the
connector bench's path selection, and the table that sets our figures
against the engine's own."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import REPO
from ecmooncake.tools import connector_gpu, mooncake_gpu

SCRIPT = REPO / "build" / "gpu_run.sh"


def test_the_script_parses_and_names_its_steps():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    out = subprocess.run(["bash", str(SCRIPT), "no-such-step"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "mooncake [DIR]" in out.stderr and "fetch-mooncake" in out.stderr


def test_the_mooncake_step_needs_the_carried_wheels(tmp_path):
    env = {**os.environ, "ECM_ARTIFACTS": str(tmp_path / "artifacts"), "ECM_WHEELS": str(tmp_path / "whl")}
    out = subprocess.run(["bash", str(SCRIPT), "mooncake", str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 1
    assert "no ecmooncake wheel" in out.stderr and "gpu_run.sh pack" in out.stderr


def test_all_paths_leave_mooncake_to_a_run_that_names_it():
    assert [p[0] for p in connector_gpu.select_paths("all")] == ["cuda_ipc", "staged tcp", "pinned host"]
    (name, common, pd_extra), = connector_gpu.select_paths("mooncake")
    assert name == "mooncake"
    assert common == {"transport": "mooncake", "mooncake_protocol": "tcp"}
    assert pd_extra == {"buffer_memory": "device"}, "the PD's slab is GPU memory"


def test_our_figures_are_ratios_to_the_engines(tmp_path):
    ours = {"rows": [{"path": "mooncake", "mib": 32, "batch": 8, "batch_s": 0.400}, {"path": "mooncake", "mib": 4, "batch": 1, "batch_s": 0.010}]}
    engine = {
        "protocol": "tcp",
        "rows": [{"mib": 4, "batch": 1, "batch_s": 0.004}, {"mib": 32, "batch": 8, "batch_s": 0.200}, {"mib": 128, "batch": 1, "batch_s": 0.1}],
        "register_vs_copy": [{"mib": 4, "register_s_with_0": 0.002, "unregister_s_with_0": 0.001, "register_s_with_16": 0.004, "unregister_s_with_16": 0.001, "device_copy_s": 0.00001}],
    }
    lines = mooncake_gpu.compare(ours, engine)
    rows = {tuple(line.split()[:2]): line.split() for line in lines if line.split()[:1] and line.split()[0].isdigit()}
    assert rows[("4", "1")][-1] == "0.400"
    assert rows[("32", "8")][-1] == "0.500"
    assert rows[("128", "1")][-1] == "-", "a size the bench did not run has no ratio"
    (a, b) = (tmp_path / "ours.json", tmp_path / "engine.json")
    a.write_text(json.dumps(ours))
    b.write_text(json.dumps(engine))
    out = subprocess.run(["python3", "-m", "ecmooncake.tools.mooncake_gpu", "--compare", str(a), str(b)], capture_output=True, text=True, cwd=REPO / "python")
    assert out.returncode == 0, out.stderr
    assert "register ms" in out.stdout and "0.500" in out.stdout


def _so(tmp_path, name, needs=()):
    """A shared library named name needing the libraries in needs."""
    src = tmp_path / "s.c"
    src.write_text("int f(void) { return 0; }\n")
    args = ["cc", "-shared", "-fPIC", "-o", str(tmp_path / name), f"-Wl,-soname,{name}", str(src), "-Wl,--no-as-needed", f"-L{tmp_path}"]
    subprocess.run(args + [f"-l:{n}" for n in needs], check=True)
    return (tmp_path / name).read_bytes()


def test_the_carried_mooncake_wheel_keeps_what_the_engine_loads(tmp_path):
    import importlib.util
    import zipfile

    spec = importlib.util.spec_from_file_location("slim", REPO / "build" / "slim_mooncake_wheel.py")
    slim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(slim)
    libs = {"libdep.so.1": _so(tmp_path, "libdep.so.1")}
    libs["libmid.so"] = _so(tmp_path, "libmid.so", ["libdep.so.1"])
    files = {
        "mooncake/__init__.py": b"",
        "mooncake/engine.so": _so(tmp_path, "engine.so", ["libmid.so"]),
        "mooncake/libmid.so": libs["libmid.so"],
        "mooncake.libs/libdep.so.1": libs["libdep.so.1"],
        "mooncake/_store.so": _so(tmp_path, "_store.so", ["libdep.so.1"]),
        "mooncake/mooncake_master": _so(tmp_path, "master"),
    }
    record = "".join(f"{n},sha256=x,{len(d)}\n" for n, d in files.items()) + "mooncake-0.1.dist-info/RECORD,,\n"
    whl = tmp_path / "in" / "mooncake-0.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    whl.parent.mkdir()
    with zipfile.ZipFile(whl, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr("mooncake-0.1.dist-info/RECORD", record)
    out = slim.slim(str(whl), str(tmp_path / "out"))
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        kept_record = z.read("mooncake-0.1.dist-info/RECORD").decode()
        assert z.read("mooncake/engine.so") == files["mooncake/engine.so"], "kept byte for byte"
    assert names == {"mooncake/__init__.py", "mooncake/engine.so", "mooncake/libmid.so", "mooncake.libs/libdep.so.1", "mooncake-0.1.dist-info/RECORD"}
    assert "_store.so" not in kept_record and "mooncake_master" not in kept_record
    assert "mooncake/libmid.so" in kept_record


def test_every_function_of_the_script_is_defined_once():
    import re
    from collections import Counter

    names = Counter(re.findall(r"^([a-z_]+)\(\) \{", SCRIPT.read_text(), re.M))
    assert names and all(n == 1 for n in names.values()), names
