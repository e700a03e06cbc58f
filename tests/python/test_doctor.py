"""``python -m ecmooncake doctor``: one line per check, a fix for each
problem, a non-zero exit on any failure. On this build VM (no GPU, no
Mooncake) the GPU and Mooncake lines are warnings unless the config asks
for them."""

from __future__ import annotations

import os
import importlib.util
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, subprocess_env
from ecmooncake import environment
from ecmooncake.tools import doctor
from ecmooncake.tools.harness import free_port_range

pytestmark = pytest.mark.usefixtures("library")

MiB = 1 << 20


def config(**fields) -> str:
    base = {"ec_connector": "ECMooncakeConnector", "ec_role": "ec_consumer", "ec_buffer_device": "cpu", "ec_buffer_size": 64 * MiB}
    return json.dumps({**base, **fields})


def by_name(checks) -> dict[str, doctor.Check]:
    return {c.name: c for c in checks}


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ecmooncake", "doctor", *args], capture_output=True, text=True, timeout=240, env=subprocess_env(**env)
    )


def test_this_vm_passes_with_warnings_for_gpu_and_mooncake(monkeypatch):
    # A host with a Mooncake wheel has the engine: test_the_wheel_is_named covers it.
    from ecmooncake import native

    monkeypatch.setattr(environment, "mooncake_wheel", lambda: None)
    monkeypatch.delenv(native.MOONCAKE_LIBRARY_ENV, raising=False)
    port = free_port_range(2)
    checks = by_name(doctor.run(config(ec_port=port), tensor_parallel_size=2))
    assert checks["library"].status == "ok" and checks["libzmq"].status == "ok", checks
    assert "libzmq" in checks["libzmq"].message
    for name in ("gpu", "mooncake"):
        assert checks[name].status == "warn", checks[name]
        assert "not available" in checks[name].message and checks[name].fix
    assert checks["ports"].status == "ok" and f"{port}, {port + 1}" in checks["ports"].message
    assert checks["vllm"].status == "ok", checks["vllm"]
    assert checks["config"].status == "ok"
    assert doctor.exit_status(checks.values()) == 0


def test_cli_prints_one_line_per_check_and_exits_zero_here():
    done = cli("--ec-transfer-config", config(ec_port=free_port_range(1)))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == len(doctor.CHECKS)
    assert all(line.split()[0] in ("ok", "warn", "fail") for line in lines), lines
    assert any(line.startswith("warn") and " gpu " in line for line in lines)


def test_a_port_in_use_fails_naming_the_port_and_the_fix():
    port = free_port_range(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        checks = by_name(doctor.run(config(ec_port=port), tensor_parallel_size=2))
    ports = checks["ports"]
    assert ports.status == "fail"
    assert f"127.0.0.1:{port + 1}" in ports.message and "in use" in ports.message
    assert "ec_port" in ports.fix
    assert doctor.exit_status(checks.values()) == 1


def test_data_and_metrics_ports_are_checked_too():
    port = free_port_range(1)
    data = free_port_range(1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", data))
        taken.listen()
        checks = by_name(doctor.run(config(ec_port=port, ec_connector_extra_config={"data_port": data})))
    assert checks["ports"].status == "fail" and f":{data}" in checks["ports"].message
    assert "data_port" in checks["ports"].fix


def test_a_missing_libzmq_fails_naming_the_fix(tmp_path):
    # A stand-in library that needs a libzmq no loader can find, as a host
    # without libzmq installed sees the real one.
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("a C compiler is needed to build the stand-in library")
    (tmp_path / "zmq.c").write_text("int zmq_stand_in(void) { return 0; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", tmp_path / "libzmq.so.999", tmp_path / "zmq.c", "-Wl,-soname,libzmq.so.999"], check=True)
    (tmp_path / "lib.c").write_text("int zmq_stand_in(void); int ecm_stand_in(void) { return zmq_stand_in(); }\n")
    lib = tmp_path / "libecmooncake.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", lib, tmp_path / "lib.c", tmp_path / "libzmq.so.999"], check=True)
    (tmp_path / "libzmq.so.999").unlink()
    done = cli("--ec-transfer-config", config(ec_port=free_port_range(1)), ECMOONCAKE_LIBRARY=str(lib))
    assert done.returncode == 1, done.stdout + done.stderr
    zmq = next(line for line in done.stdout.splitlines() if " libzmq " in line)
    assert zmq.startswith("fail") and "libzmq.so.999" in zmq and "apt-get install libzmq5" in zmq, zmq
    library = next(line for line in done.stdout.splitlines() if " library " in line)
    assert library.startswith("fail") and str(lib) in library


def test_a_library_override_that_is_not_there_is_named(tmp_path):
    # The loader falls back to the package's own copy: a build other than
    # the one asked for, which the doctor says.
    missing = tmp_path / "nowhere" / "libecmooncake.so"
    done = cli("--json", "--ec-transfer-config", config(ec_port=free_port_range(1)), ECMOONCAKE_LIBRARY=str(missing))
    checks = {c["name"]: c for c in json.loads(done.stdout)}
    library = checks["library"]
    assert library["status"] == "warn" and str(missing) in library["message"], library
    assert "ECMOONCAKE_LIBRARY" in library["fix"]
    assert done.returncode == 0, "the library that loaded works"


def test_a_config_that_asks_for_a_gpu_or_mooncake_fails_here():
    checks = by_name(doctor.run(config(ec_port=free_port_range(1), ec_buffer_device="cuda")))
    assert checks["gpu"].status == "fail" and '"ec_buffer_device": "cpu"' in checks["gpu"].fix
    checks = by_name(doctor.run(config(ec_port=free_port_range(1), ec_connector_extra_config={"transport": "mooncake"}), mooncake_library="/nonexistent/libtransfer_engine.so"))
    mooncake = checks["mooncake"]
    assert mooncake.status == "fail" and "/nonexistent/libtransfer_engine.so" in mooncake.message
    assert "mooncake_library" in mooncake.fix


def test_mooncake_with_every_symbol_is_ok(tmp_path):
    spec = importlib.util.spec_from_file_location("build_mooncake_double", REPO / "build" / "build_mooncake_double.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ok = module.build(tmp_path / "ok")
    partial = module.build(tmp_path / "partial", omit_free_batch_id=True)
    cfg = config(ec_port=free_port_range(1), ec_connector_extra_config={"transport": "mooncake"})
    assert by_name(doctor.run(cfg, mooncake_library=str(ok)))["mooncake"].status == "ok"
    lacking = by_name(doctor.run(cfg, mooncake_library=str(partial)))["mooncake"]
    assert lacking.status == "fail" and "freeBatchID" in lacking.message


def test_shm_needs_room_for_every_slab_in_dev_shm():
    free = doctor.shm_free_bytes()
    small = by_name(doctor.run(config(ec_port=free_port_range(1), ec_connector_extra_config={"transport": "shm"})))["shm"]
    assert small.status == "ok" and "memfd" in small.message
    huge = by_name(doctor.run(config(ec_port=free_port_range(1), ec_buffer_size=free + (1 << 30), ec_connector_extra_config={"transport": "shm"})))["shm"]
    assert huge.status == "fail" and "ec_buffer_size" in huge.fix


def test_a_bad_config_fails_with_the_connectors_message():
    checks = by_name(doctor.run(config(ec_port=free_port_range(1), ec_connector_extra_config={"no_such_key": 1})))
    assert checks["config"].status == "fail" and "no_such_key" in checks["config"].message
    assert doctor.exit_status(checks.values()) == 1


def test_the_readme_documents_the_doctor():
    readme = (REPO / "README.md").read_text()
    assert "python -m ecmooncake doctor" in readme
    assert Path(doctor.__file__).name == "doctor.py"


def test_the_wheel_is_named_with_its_version_and_protocols():
    from ecmooncake import native

    wheel = native.mooncake_wheel()
    if wheel is None or not os.path.exists(wheel["shim"]):
        pytest.skip("no Mooncake pip wheel installed (pip install mooncake-transfer-engine-non-cuda), or no shim built")
    check = doctor.check_mooncake(doctor._parse(None, 1, 1, None))
    assert check.status == "ok", check
    assert wheel["version"] in check.message and wheel["engine"] in check.message, check.message
    assert "mooncake-transfer-engine" in check.message
    assert "protocols: tcp" in check.message
    assert "GPUDirect RDMA: " in check.message
    assert "etcd client: yes" in check.message, "every pip wheel carries the etcd client"
    cuda = "can register GPU memory (CUDA build" in check.message
    assert cuda != ("host memory only" in check.message)
    assert cuda == ("non-cuda" not in check.message), "the non-CUDA wheel is the one build that cannot register GPU memory"


WHEEL_INFO = {
    "available": True, "library": "/pkg/libecmooncake_mooncake.so", "engine": "/site/mooncake/engine.so",
    "version": "0.3.14", "distribution": "mooncake-transfer-engine-cuda13", "symbols": ["f"] * 12,
    "wheel": {"version": "0.3.14", "checked": True, "request_bytes": 72, "checked_versions": "0.3.12.post1, 0.3.14"},
    "cuda": True, "cuda_runtime": "libcudart.so.13", "etcd": True,
}


def test_the_mooncake_line_says_wheel_gpu_memory_protocols_gpudirect_and_etcd():
    check = doctor.describe_mooncake(WHEEL_INFO, True, True, ["mlx5_0"], True)
    assert check.status == "ok", check
    for want in ("mooncake-transfer-engine-cuda13 0.3.14 (/site/mooncake/engine.so)", "can register GPU memory (CUDA build, libcudart.so.13)",
                 "protocols: tcp, rdma (devices: mlx5_0)", "GPUDirect RDMA: nvidia_peermem loaded", "etcd client: yes"):
        assert want in check.message, (want, check.message)

    host = {**WHEEL_INFO, "distribution": "mooncake-transfer-engine-non-cuda", "cuda": False, "cuda_runtime": "", "etcd": False}
    check = doctor.describe_mooncake(host, True, False, [], False)
    assert check.status == "ok", check
    for want in ("host memory only (not a CUDA build", "tcp only: no RDMA device", "nvidia_peermem not loaded", "etcd client: no"):
        assert want in check.message, (want, check.message)


def test_a_gpu_slab_on_an_engine_without_cuda_fails_naming_the_cuda_wheels():
    host = {**WHEEL_INFO, "cuda": False, "cuda_runtime": ""}
    check = doctor.describe_mooncake(host, True, True, [], False)
    assert check.status == "fail" and "GPU slab" in check.message
    assert "mooncake-transfer-engine-cuda13" in check.fix and '"ec_buffer_device": "cpu"' in check.fix


def test_a_wheel_newer_than_the_checked_ones_warns_with_the_shims_words():
    newer = {**WHEEL_INFO, "version": "0.3.15",
             "wheel": {**WHEEL_INFO["wheel"], "version": "0.3.15", "checked": False, "warning": "Mooncake wheel version 0.3.15 is not one this shim was checked against (0.3.12.post1, 0.3.14)"}}
    check = doctor.describe_mooncake(newer, True, False, [], False)
    assert check.status == "warn" and "0.3.15 is not one this shim was checked against" in check.message
    assert "0.3.12.post1, 0.3.14" in check.fix


def test_nvidia_peermem_is_read_from_sys_module(tmp_path):
    assert not doctor.nvidia_peermem_loaded(str(tmp_path))
    (tmp_path / "nvidia_peermem").mkdir()
    assert doctor.nvidia_peermem_loaded(str(tmp_path))


def test_rdma_devices_are_listed(tmp_path):
    assert doctor.rdma_devices(str(tmp_path / "none")) == []
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    assert doctor.rdma_devices(str(tmp_path)) == ["mlx5_0", "mlx5_1"]


def test_the_auth_mode_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("ECMOONCAKE_SECRET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    port = free_port_range(1)
    per_user = by_name(doctor.run(config(ec_port=port)))["auth"]
    assert per_user.status == "ok" and f"per-user secret at {tmp_path}/.cache/ecmooncake/secret" in per_user.message
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdefghijklmnop\n")
    configured = by_name(doctor.run(config(ec_port=port, ec_connector_extra_config={"auth_secret_file": str(secret)})))["auth"]
    assert configured.status == "ok" and "configured secret" in configured.message
    open_ = by_name(doctor.run(config(ec_port=port, ec_connector_extra_config={"allow_unauthenticated": True})))["auth"]
    assert open_.status == "warn" and "unauthenticated" in open_.message
    beyond = by_name(doctor.run(config(ec_port=port, ec_ip="0.0.0.0")))["auth"]
    assert beyond.status == "fail" and "allow_unauthenticated" in beyond.fix
