"""``python -m ecmooncake doctor``: is this host ready to serve the connector?

One line per check, ``ok``, ``warn`` or ``fail``, each problem with its fix;
the exit status is 1 when any check fails. Without ``--ec-transfer-config``
the doctor checks what every deployment needs and reports optional
features (a GPU, Mooncake) as warnings; with one, what that config asks
for must be there.

Each check is a function of the settings it is given and of what it probes
(a library load, a port bind, ``statvfs``); none changes the host.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import sys
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any, Callable

from .. import _ffi, auth, ec_config

OK, WARN, FAIL = "ok", "warn", "fail"
ZMQ_FIX = (
    "install libzmq (Debian/Ubuntu: apt-get install libzmq5; building the library also needs libzmq3-dev), "
    "or put libzmq.so.5 beside libecmooncake.so"
)
LIBRARY_FIX = f"build it with 'python build/build_lib.py' or 'pip install .', or point {_ffi.LIBRARY_ENV} at a build"
MOONCAKE_FIX = (
    "build Mooncake with -DBUILD_SHARED_LIBS=ON and set mooncake_library (or ECMOONCAKE_MOONCAKE_LIBRARY) "
    "to libtransfer_engine.so; see the README's 'Mooncake (RDMA)'"
)
CONNECTOR_NAMES = ("ECMooncakeConnector", "EcmooncakeConnector")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    message: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status:<4} {self.name:<8} {self.message}"
        return text + (f"; fix: {self.fix}" if self.fix and self.status != OK else "")


@dataclass
class Setup:
    """What the checks are asked about: the parsed config, if any."""

    given: bool
    cfg: ec_config.ECMooncakeConfig | None
    config_error: str
    connector: str
    tensor_parallel_size: int
    data_parallel_size: int
    mooncake_library: str | None
    library_error: str = ""


def _parse(raw: str | None, tp: int, dp: int, mooncake_library: str | None) -> Setup:
    if raw is None:
        # A consumer at vLLM's default address, in host memory so that a
        # GPU stays optional.
        fields: dict[str, Any] = {"ec_role": "ec_consumer", "ec_buffer_device": "cpu"}
    else:
        try:
            fields = json.loads(raw)
        except ValueError as exc:
            return Setup(True, None, f"--ec-transfer-config is not JSON: {exc}", "", tp, dp, mooncake_library)
        if not isinstance(fields, dict):
            return Setup(True, None, "--ec-transfer-config is not a JSON object", "", tp, dp, mooncake_library)
    role = fields.get("ec_role")
    ec = SimpleNamespace(
        ec_role=role,
        is_ec_producer=role in ("ec_producer", "ec_both"),
        is_ec_consumer=role in ("ec_consumer", "ec_both"),
        ec_ip=fields.get("ec_ip", "127.0.0.1"),
        ec_port=fields.get("ec_port", 14579),
        ec_buffer_size=fields.get("ec_buffer_size", 1e9),
        ec_buffer_device=fields.get("ec_buffer_device", "cuda"),
        ec_connector_extra_config=fields.get("ec_connector_extra_config") or {},
    )
    # The topology a consumer's shards have; an encoder is checked as TP 1.
    topology = ec_config.Topology(tp_size=tp if ec.is_ec_consumer else 1, dp_size=dp if ec.is_ec_consumer else 1)
    try:
        cfg = ec_config.from_vllm_config(SimpleNamespace(ec_transfer_config=ec), topology)
        error = ""
    except ec_config.ConfigError as exc:
        cfg, error = None, str(exc)
    return Setup(raw is not None, cfg, error, str(fields.get("ec_connector") or ""), tp, dp, mooncake_library)


# --- checks --------------------------------------------------------------------


def check_config(s: Setup) -> Check:
    if not s.given:
        return Check("config", OK, "none given: checking a host-memory consumer at vLLM's default 127.0.0.1:14579; pass --ec-transfer-config for yours")
    if s.cfg is None:
        return Check("config", FAIL, s.config_error, "correct --ec-transfer-config as the message says")
    if s.connector not in CONNECTOR_NAMES:
        return Check("config", WARN, f"ec_connector is {s.connector!r}, not this connector", f"set ec_connector to {CONNECTOR_NAMES[0]!r}")
    cfg = s.cfg
    role = "+".join(r for r, on in (("producer", cfg.is_producer), ("consumer", cfg.is_consumer)) if on)
    return Check("config", OK, f"{role}, transport {cfg.value('transport')}, ec_ip {cfg.ec_ip}, ec_port {cfg.ec_port}")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def check_auth(s: Setup) -> Check:
    """Which mode the control plane runs in, as the shard's startup line says."""
    if s.cfg is None:
        return Check("auth", WARN, "no valid config to read the auth settings of", "correct --ec-transfer-config")
    cfg = s.cfg
    settings = cfg.consumer_settings() if cfg.is_consumer else cfg.producer_settings()
    mode = auth.describe(settings)
    if cfg.is_consumer and mode != "configured secret" and not settings.get("allow_unauthenticated") and not _loopback(cfg.ec_ip):
        return Check(
            "auth", FAIL, f"ec_ip {cfg.ec_ip} is beyond loopback and there is no auth_secret: the shard refuses to start",
            f"set the same auth_secret_file (or {ec_config.SECRET_ENV}) on every instance, or allow_unauthenticated: true to serve anybody",
        )
    if mode == "unauthenticated":
        who = "anybody who reaches ec_ip" if not _loopback(cfg.ec_ip) else "every user of this host"
        return Check("auth", WARN, f"unauthenticated (allow_unauthenticated): {who} can reserve and complete transfers",
                     "set auth_secret_file, or drop allow_unauthenticated to share a per-user secret")
    if mode.startswith("per-user"):
        path = os.path.join(auth.with_auth_default(settings)[auth.DIR_KEY], "secret")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return Check("auth", OK, f"{mode} (created on first use): processes of this uid on this host only")
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return Check("auth", FAIL, f"{mode}: it has mode {st.st_mode & 0o777:04o} and uid {st.st_uid}; the library refuses it",
                         f"chmod 600 {path}, or remove it to have a fresh one made")
        return Check("auth", OK, f"{mode}: processes of this uid on this host only")
    return Check("auth", OK, f"{mode}: CURVE with keys derived from it")


def check_library(s: Setup) -> Check:
    try:
        _ffi.lib()
    except _ffi.LibraryError as exc:
        s.library_error = str(exc)
        fix = ZMQ_FIX if "libzmq" in s.library_error else LIBRARY_FIX
        return Check("library", FAIL, s.library_error, fix)
    override = os.environ.get(_ffi.LIBRARY_ENV)
    if override and not os.path.isfile(override):
        return Check(
            "library", WARN, f"{_ffi.LIBRARY_ENV} names {override}, which does not exist; loaded {_ffi.find()} instead",
            f"correct or unset {_ffi.LIBRARY_ENV}",
        )
    return Check("library", OK, f"loaded {_ffi.find()} (ABI {_ffi.ABI_VERSION})")


def _mapped(fragment: str) -> str | None:
    """The path of a shared object this process has mapped, by name."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if fragment in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def check_libzmq(s: Setup) -> Check:
    if s.library_error:
        if "libzmq" in s.library_error:
            return Check("libzmq", FAIL, f"not found: {s.library_error}", ZMQ_FIX)
        return Check("libzmq", WARN, "not checked: the library did not load", LIBRARY_FIX)
    path = _mapped("libzmq")
    if path is None:
        return Check("libzmq", OK, "libzmq linked into the library")
    return Check("libzmq", OK, f"libzmq loaded from {path}")


def _wants_gpu(s: Setup) -> bool:
    return s.cfg is not None and s.cfg.is_consumer and s.cfg.buffer_device.startswith("cuda")


def check_gpu(s: Setup) -> Check:
    wanted = _wants_gpu(s)
    if s.library_error:
        return Check("gpu", FAIL if wanted else WARN, "not checked: the library did not load", LIBRARY_FIX)
    from ..native import gpu_info

    info = gpu_info()
    if info.get("available"):
        return Check("gpu", OK, f"CUDA driver {info.get('driver_version')}, {info.get('devices')} device(s)")
    reason = info.get("reason") or "no CUDA driver"
    if wanted:
        device = s.cfg.buffer_device if s.cfg is not None else "cuda"
        return Check(
            "gpu", FAIL, f"ec_buffer_device {device!r} needs a GPU, not available: {reason}",
            'run on a host with a GPU and its driver, or add "ec_buffer_device": "cpu" to --ec-transfer-config',
        )
    return Check("gpu", WARN, f"not available: {reason}", "only GPU slabs and GPU encoder outputs need it; install the NVIDIA driver for them")


def check_mooncake(s: Setup) -> Check:
    wanted = s.cfg is not None and s.cfg.value("transport") == "mooncake"
    if s.library_error:
        return Check("mooncake", FAIL if wanted else WARN, "not checked: the library did not load", LIBRARY_FIX)
    from ..native import mooncake_info

    library = s.mooncake_library
    if library is None and s.cfg is not None and s.cfg.extra.get("mooncake_library"):
        library = s.cfg.extra["mooncake_library"]
    info = mooncake_info(library, "" if library is not None else None)
    gpu_slab = wanted and _wants_gpu(s)
    return describe_mooncake(info, wanted, gpu_slab, rdma_devices(), nvidia_peermem_loaded())


def describe_mooncake(info: dict, wanted: bool, gpu_slab: bool, devices: list[str], peermem: bool) -> Check:
    """The mooncake line from what the library's probe says (info) and
    the host's facts: which engine and wheel version would load, whether
    it can register GPU memory (a CUDA build), which protocols it can
    install here, whether GPUDirect RDMA is there (nvidia_peermem), and
    whether it has the etcd client."""
    if not info.get("available"):
        reason = info.get("reason") or f"cannot load {info.get('library')}"
        if wanted:
            return Check("mooncake", FAIL, f"transport mooncake, but {reason}", MOONCAKE_FIX)
        return Check("mooncake", WARN, f"not available: {reason}", "only transport mooncake needs it; see the README's 'Mooncake (RDMA)'")
    wheel = info.get("wheel") or {}
    if info.get("engine"):
        name = info.get("distribution") or "Mooncake wheel"
        what = f"{name} {info.get('version') or '(version unknown)'} ({info['engine']}) through {info['library']}"
    else:
        what = f"{info['library']}"
    if info.get("cuda"):
        runtime = info.get("cuda_runtime")
        memory = f"can register GPU memory (CUDA build{', ' + runtime if runtime else ''})"
    else:
        memory = "host memory only (not a CUDA build: GPU slabs need mooncake-transfer-engine or -cuda13)"
    if devices:
        protocols = f"tcp, rdma (devices: {', '.join(devices)})"
    else:
        protocols = "tcp only: no RDMA device in /sys/class/infiniband, so mooncake_protocol rdma cannot install here"
    if peermem:
        gpudirect = "GPUDirect RDMA: nvidia_peermem loaded"
    else:
        gpudirect = "GPUDirect RDMA: no (nvidia_peermem not loaded; GPU memory over rdma needs it: modprobe nvidia_peermem)"
    etcd = "etcd client: yes" if info.get("etcd") else "etcd client: no (mooncake_metadata etcd:// is refused)"
    message = (
        f"would load {what}: every function the transport calls ({len(info.get('symbols') or ())}); "
        f"{memory}; protocols: {protocols}; {gpudirect}; {etcd}"
    )
    if gpu_slab and not info.get("cuda"):
        return Check(
            "mooncake", FAIL, f"{message}; but ec_buffer_device asks for a GPU slab, which this engine cannot register",
            "pip install mooncake-transfer-engine (CUDA 12) or mooncake-transfer-engine-cuda13 (CUDA 13) instead of -non-cuda, "
            'or add "ec_buffer_device": "cpu"',
        )
    if wheel.get("warning"):
        return Check(
            "mooncake", WARN, f"{message}; {wheel['warning']}",
            f"install a checked version ({wheel.get('checked_versions')}), e.g. pip install mooncake-transfer-engine-non-cuda",
        )
    return Check("mooncake", OK, message)


def rdma_devices(root: str = "/sys/class/infiniband") -> list[str]:
    """The RDMA devices the kernel lists (what Mooncake's rdma protocol needs)."""
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


def nvidia_peermem_loaded(root: str = "/sys/module") -> bool:
    """Whether the nvidia_peermem kernel module is loaded: what lets an RDMA
    NIC read and write GPU memory directly (GPUDirect RDMA)."""
    return os.path.isdir(os.path.join(root, "nvidia_peermem"))


def shm_free_bytes(path: str = "/dev/shm") -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _size(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def check_shm(s: Setup) -> Check:
    try:
        free = shm_free_bytes()
    except OSError as exc:
        free, error = 0, str(exc)
    else:
        error = ""
    cfg = s.cfg
    wanted = cfg is not None and cfg.is_consumer and cfg.value("transport") == "shm"
    if not wanted:
        have = error or f"{_size(free)} free"
        return Check("shm", OK, f"/dev/shm: {have} (only transport shm keeps slabs there)")
    shards = cfg.topology.tp_size * s.data_parallel_size
    need = cfg.buffer_size * shards
    # The slab is a memfd: it is shared memory, limited as /dev/shm's tmpfs is.
    what = f"{shards} slab(s) of {_size(cfg.buffer_size)} as memfd shared memory need {_size(need)}"
    if error or free < need:
        return Check(
            "shm", FAIL, f"{what}; /dev/shm has {error or _size(free) + ' free'}",
            "lower ec_buffer_size, free /dev/shm, or give the container more (docker run --shm-size)",
        )
    return Check("shm", OK, f"{what}; /dev/shm has {_size(free)} free")


def _bind_error(host: str, port: int) -> str:
    """Why port cannot be bound on host now, or "" when it can."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return str(exc)
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # As the library's listeners do: a port held only by connections in
        # TIME_WAIT is free for them.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as exc:
            return exc.strerror or str(exc)
    return ""


def _ports(s: Setup) -> list[tuple[str, str, int]]:
    """(what, host, port) for every port this instance's processes listen on."""
    cfg = s.cfg
    if cfg is None:
        return []
    out: list[tuple[str, str, int]] = []
    tp = cfg.topology.tp_size
    if cfg.is_consumer:
        for dp in range(s.data_parallel_size):
            for rank in range(tp):
                out.append(("ec_port", cfg.ec_ip, cfg.ec_port + dp * tp + rank))
                if cfg.value("data_port"):
                    out.append(("data_port", cfg.ec_ip, cfg.value("data_port") + dp * tp + rank))
    metrics = cfg.extra.get("metrics_port")
    if metrics:
        # The engine core at metrics_port, each worker above it.
        workers = tp * s.data_parallel_size if cfg.is_consumer else 1
        out += [("metrics_port", cfg.ec_ip, metrics + n) for n in range(1 + workers)]
    return list(dict.fromkeys(out))


def check_ports(s: Setup) -> Check:
    ports = _ports(s)
    if not ports:
        if s.cfg is None:
            return Check("ports", WARN, "not checked: no valid config")
        return Check("ports", OK, "none: an encoder listens on no port unless metrics_port is set")
    taken = [(what, host, port, why) for what, host, port in ports if (why := _bind_error(host, port))]
    listed = ", ".join(str(p) for _, _, p in ports)
    host = ports[0][1]
    if taken:
        details = ", ".join(f"{h}:{p} ({w}: {why})" for w, h, p, why in taken)
        keys = sorted({w for w, _, _, _ in taken})
        return Check(
            "ports", FAIL if s.given else WARN, f"in use or not bindable: {details}",
            f"choose another {' / '.join(keys)} or stop what holds it (ss -ltnp 'sport = :{taken[0][2]}')",
        )
    return Check("ports", OK, f"free on {host}: {listed}")


def check_vllm(s: Setup) -> Check:
    needed = FAIL if s.given else WARN
    try:
        import vllm  # noqa: F401
        from vllm.distributed.ec_transfer.ec_connector import base  # noqa: F401
    except ImportError as exc:
        return Check("vllm", needed, f"not importable: {exc}", "install vLLM (the tested release: tests/python/requirements-vllm.txt)")
    from .. import connector

    version = getattr(vllm, "__version__", "unknown")
    cls = connector.ECMooncakeConnector
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if abstract:
        return Check(
            "vllm", FAIL, f"vLLM {version} requires hooks this connector lacks: {', '.join(abstract)}",
            "use a vLLM release this ecmooncake supports (0.26 to 0.33) or upgrade ecmooncake",
        )
    missing = [f"{name} ({connector.OPTIONAL_HOOKS[name]})" for name, present in cls._hooks.items() if not present]
    if missing:
        return Check("vllm", WARN, f"vLLM {version} does not call {', '.join(missing)}", "vLLM 0.31 and newer call every hook the connector has (docs/vllm.md)")
    return Check("vllm", OK, f"vLLM {version} calls every hook the connector uses ({len(cls._hooks)} optional ones included)")


def check_plugin(s: Setup) -> Check:
    import importlib.metadata

    found = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "ecmooncake"]
    if found:
        return Check("plugin", OK, f"vLLM loads {found[0].value}, which makes ECMooncakeConnector this one")
    return Check(
        "plugin", WARN, "the ecmooncake vLLM plugin is not installed: ECMooncakeConnector is vLLM's built-in one",
        "pip install . (or set ec_connector 'EcmooncakeConnector' and ec_connector_module_path 'ecmooncake.connector')",
    )


# In the order they print; later checks read what the library check found.
CHECKS: list[Callable[[Setup], Check]] = [
    check_config,
    check_auth,
    check_library,
    check_libzmq,
    check_gpu,
    check_mooncake,
    check_shm,
    check_ports,
    check_vllm,
    check_plugin,
]


def run(
    ec_transfer_config: str | None = None,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    mooncake_library: str | None = None,
) -> list[Check]:
    setup = _parse(ec_transfer_config, tensor_parallel_size, data_parallel_size, mooncake_library)
    out = []
    for check in CHECKS:
        try:
            out.append(check(setup))
        except Exception as exc:  # a broken probe is a finding, not a crash
            name = check.__name__.removeprefix("check_")
            out.append(Check(name, FAIL, f"the check itself failed: {type(exc).__name__}: {exc}"))
    return out


def exit_status(checks: Any) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ec-transfer-config", metavar="JSON", help="the JSON given to vllm serve --ec-transfer-config")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="of the PD instance: one shard port each (default %(default)s)")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="DP ranks of the PD instance on this host (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def main(args: argparse.Namespace) -> int:
    checks = run(args.ec_transfer_config, args.tensor_parallel_size, args.data_parallel_size)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(c.line())
    sys.stdout.flush()
    return exit_status(checks)
