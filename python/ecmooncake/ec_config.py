"""Settings of the vLLM connector, read from vLLM's ``ECTransferConfig``.

Everything is checked here, before any native object exists, so that a bad
``--ec-transfer-config`` stops ``vllm serve`` at startup with a message that
names the key, the value given and what is allowed, instead of surfacing as
a failure deep inside an engine process. The library checks its own inputs
again; the ranges, choices and defaults of its keys come from the
library's schema (settings.json, generated from core/config), so the two
agree by construction.

This module imports neither vLLM nor torch: it reads the config object by
attribute, so it works on any vLLM release that has these fields.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from . import schema

logger = logging.getLogger("vllm.ecmooncake")

BUFFER_DEVICES = ("cpu", "cuda")
# The control plane's secret, for deployments that keep it off the command
# line: read here, by Python, because the library reads no environment.
SECRET_ENV = "ECMOONCAKE_SECRET"
# The ranges, choices and defaults of the library's own keys come from its
# schema (core/config/schema.go, checked in as settings.json), so that a bad
# value fails here, at config time, exactly where the library would refuse it.
TRANSPORTS = tuple(schema.setting("producer", "transport")["choices"])
LOG_LEVELS = tuple(schema.setting("runtime", "log_level")["choices"])
# Shorter secrets fall to offline guessing; ones of fewer distinct bytes (a
# repeated letter is long and guessable) too.
MIN_SECRET_LEN = schema.secret_rules()["min_len"]
MIN_SECRET_DISTINCT = schema.secret_rules()["min_distinct"]
SECRET_FIX = schema.secret_rules()["fix"]
# The slab must hold at least one item; below this it is a typo (a size in
# MB or GB given as bytes), not a choice.
MIN_BUFFER_BYTES = 1 << 20
# Where the keys of ec_connector_extra_config go, as ExtraKey.targets names
# them, and the schema object of each.
TARGET_OBJECTS = {"producer": "producer", "consumer": "consumer", "scheduler": "scheduler", "process": "runtime"}


class ConfigError(ValueError):
    """A setting of ``--ec-transfer-config`` that ECMooncakeConnector refuses."""


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"ECMooncakeConnector: {key} = {value!r} is not allowed; want {allowed}")


def _number(key: str, value: Any, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _fail(key, value, allowed)
    try:
        number = float(value)
    except ValueError:
        raise _fail(key, value, allowed) from None
    if not math.isfinite(number):
        raise _fail(key, value, allowed)
    return number


MAX_SECONDS = schema.setting("consumer", "lease_s")["max"]


def seconds(key: str, value: Any) -> float:
    allowed = f"a positive number of seconds, at most {MAX_SECONDS:g}"
    number = _number(key, value, allowed)
    if not 0 < number <= MAX_SECONDS:
        raise _fail(key, value, allowed)
    return number


def seconds_up_to(key: str, value: Any, high: float) -> float:
    allowed = f"seconds in (0, {high:g}]"
    number = _number(key, value, allowed)
    if not 0 < number <= high:
        raise _fail(key, value, allowed)
    return number


def integer(key: str, value: Any, low: int, high: int) -> int:
    allowed = f"an integer in [{low}, {high}]"
    number = _number(key, value, allowed)
    if not number.is_integer() or not low <= number <= high:
        raise _fail(key, value, allowed)
    return int(number)


def one_of(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise _fail(key, value, "one of " + ", ".join(repr(c) for c in choices))
    return value.lower()


def text(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _fail(key, value, "a string")
    return value


_HOSTNAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def host(key: str, value: Any) -> str:
    allowed = "an IPv4 or IPv6 address or a hostname"
    if not isinstance(value, str) or not value:
        raise _fail(key, value, allowed)
    try:
        ipaddress.ip_address(value.strip("[]"))
        return value
    except ValueError:
        pass
    if not _HOSTNAME.match(value):
        raise _fail(key, value, allowed)
    return value


@dataclass(frozen=True)
class ExtraKey:
    """One key of ``ec_connector_extra_config``."""

    default: Any
    check: Callable[[str, Any], Any]
    # Which native objects take it: "producer", "consumer" (each TP shard),
    # "scheduler" (the consumer's engine core), "process" (configure()).
    targets: tuple[str, ...]
    meaning: str
    # Sent to the library only when the user sets it, so that the library's
    # own default applies (and a build without the feature never sees it).
    only_if_set: bool = False


class Secret(str):
    """A secret that reprs as a placeholder, so that a logged config never
    shows it; it is still the plain string to json and to the library."""

    def __repr__(self) -> str:
        return "'[redacted]'"


def secret(key: str, value: Any) -> Secret:
    # The value is never echoed: an error message may end up in a log.
    if not isinstance(value, str) or len(value) < MIN_SECRET_LEN:
        raise ConfigError(
            f"ECMooncakeConnector: {key} is not allowed; want a string of at least {MIN_SECRET_LEN} "
            f"characters (e.g. `{SECRET_FIX}`), the same on every producer and consumer"
        )
    distinct = len(set(value.encode()))
    if distinct < MIN_SECRET_DISTINCT:
        raise ConfigError(
            f"ECMooncakeConnector: {key} is weak: {distinct} distinct bytes in {len(value.encode())}; want at least "
            f"{MIN_SECRET_DISTINCT}, from a random source (e.g. `{SECRET_FIX}`)"
        )
    return Secret(value)


def flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(key, value, "true or false")
    return value


def _path(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value or value.strip() != value:
        raise _fail(key, value, "a file path")
    return value


def _optional_host(key: str, value: Any) -> str:
    return value if value == "" else host(key, value)


def _check_of(spec: dict[str, Any]) -> Callable[[str, Any], Any]:
    """The check of one schema setting, by its kind."""
    kind = spec["kind"]
    if kind == "int":
        return lambda k, v: integer(k, v, int(spec["min"]), int(spec["max"]))
    if kind == "seconds":
        if float(spec["max"]) < MAX_SECONDS:
            return lambda k, v: seconds_up_to(k, v, float(spec["max"]))
        return seconds
    if kind == "enum":
        choices = tuple(spec["choices"])
        return lambda k, v: one_of(k, v, choices)
    if kind == "host":
        return _optional_host if spec["default"] == "" else host
    checks = {"text": text, "path": _path, "secret": secret, "bool": flag}
    if kind not in checks:
        raise schema.SchemaError(f"setting {spec['key']!r} of kind {kind!r} cannot be set from vLLM")
    return checks[kind]


def _native(
    key: str, targets: tuple[str, ...], meaning: str, only_if_set: bool = False
) -> ExtraKey:
    """A key the library takes: its check and default come from the schema
    of the objects it goes to. Where those objects' defaults differ
    (control_timeout_s), it is sent only when set, so that each applies its
    own."""
    specs = [schema.setting(TARGET_OBJECTS[t], key) for t in targets]
    defaults = {json.dumps(s["default"]) for s in specs}
    if len(defaults) != 1 and not only_if_set:
        raise schema.SchemaError(f"{key} has different defaults on {', '.join(targets)}; send it only when set")
    default = specs[0]["default"] if len(defaults) == 1 else None
    return ExtraKey(default, _check_of(specs[0]), targets, meaning, only_if_set=only_if_set)


def _natives(targets: tuple[str, ...], only_if_set: bool = False, **meanings: str) -> dict[str, ExtraKey]:
    """Several keys of :func:`_native` that go to the same objects, in order."""
    return {key: _native(key, targets, meaning, only_if_set) for key, meaning in meanings.items()}


@dataclass(frozen=True)
class StoreSettings:
    """The ``store`` object of ``ec_connector_extra_config``, checked
    against the library's schema (core/config/store.go)."""

    enabled: bool = False
    master_address: str = ""
    metadata_address: str = ""
    local_hostname: str = ""
    mooncake_protocol: str = "tcp"
    segment_bytes: int = 512 << 20
    local_buffer_bytes: int = 16 << 20
    put_inflight_bytes: int = 256 << 20
    put_rate_bytes_s: int = 0
    get_staging_bytes: int = 256 << 20
    max_gets: int = 4
    get_timeout_s: float = 2.0
    put_timeout_s: float = 10.0
    retry_after_s: float = 5.0

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> "StoreSettings":
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"store = {raw!r}; want an object of store settings")
        specs = schema.settings("store")
        unknown = sorted(set(raw) - set(specs))
        if unknown:
            raise ConfigError(f"store: unknown key(s) {', '.join(unknown)}; want some of {', '.join(sorted(specs))}")
        values = {}
        for f in fields(cls):
            spec = specs[f.name]
            value = raw.get(f.name, spec["default"])
            values[f.name] = _check_of(spec)(f"store.{f.name}", value)
        s = cls(**values)
        s._check_addresses()
        return s

    def _check_addresses(self) -> None:
        if self.master_address:
            host, sep, port = self.master_address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"store.master_address = {self.master_address!r}; want host:port of mooncake_master")
        meta = self.metadata_address
        if meta and meta != "P2PHANDSHAKE":
            scheme = meta.split("://", 1)[0] if "://" in meta else ""
            # Mooncake aborts the process on a metadata scheme its build lacks.
            if scheme not in ("http", "https", "etcd"):
                raise ConfigError(
                    f"store.metadata_address = {meta!r}; want http://host:port/metadata, etcd://host:port or P2PHANDSHAKE"
                )
        # Mooncake's client refuses an empty local_hostname at setup.
        if self.enabled and not (self.master_address and self.metadata_address and self.local_hostname):
            raise ConfigError("store.enabled without master_address, metadata_address and local_hostname; "
                              "name mooncake_master, its metadata service and this host's address")


def _store(key: str, value: Any) -> Any:
    """The ``store`` object, checked against the library's schema."""
    try:
        return StoreSettings.from_mapping(value)
    except ConfigError as exc:
        raise ConfigError(f"ECMooncakeConnector: {key}: {exc}") from None


# Where a consumer's slab lives when ec_buffer_device is cuda (see
# buffer_memory below).
BUFFER_MEMORY = ("auto", "device", "pinned_host")

_BOTH = ("producer", "consumer")

EXTRA_KEYS: dict[str, ExtraKey] = {
    "transport": _native(
        "transport", _BOTH,
        "data plane: `tcp` (any two hosts, host memory), `mooncake` (RDMA, needs libtransfer_engine.so) "
        "or `shm` (encoder and PD on one host; PD needs ec_buffer_device cpu)",
    ),
    # The one key of the connector alone: it picks how the slab is allocated.
    "buffer_memory": ExtraKey(
        "auto", lambda k, v: one_of(k, v, BUFFER_MEMORY), (),
        "consumer with ec_buffer_device `cuda`: `device` receives into GPU memory of the shard's device "
        "(same-host encoders write with cuda_ipc, others through staged TCP), `pinned_host` into pinned host "
        "memory copied to the GPU at load; `auto` is `device`, except `pinned_host` with transport `mooncake` "
        "when its engine is no CUDA build (only a CUDA build registers GPU memory)",
    ),
    "push_wait_timeout_s": _native(
        "push_wait_timeout_s", ("producer", "scheduler"),
        "consumer: a request whose encoder output has not arrived by then fails (retryable); "
        "producer: how long a push waits for its encoder output and for its write",
    ),
    "control_timeout_s": _native(
        "control_timeout_s", ("producer", "scheduler"),
        "deadline of one control round trip: 30 on the producer, 5 for the consumer scheduler's background loop",
        only_if_set=True,
    ),
    "load_timeout_s": _native(
        "load_timeout_s", ("scheduler",),
        "a load handed to the workers that is not reported back by then fails the request (retryable)",
    ),
    "lease_s": _native(
        "lease_s", ("consumer",),
        "a reservation not completed, or an arrived item never loaded, is reclaimed after this",
    ),
    **_natives(
        ("consumer",),
        only_if_set=True,
        max_data_conns="data-plane connections each shard serves at once; at the cap an idle one makes room, else the new one is closed at once",
        data_idle_timeout_s="a data-plane connection with no frame in flight is closed after this",
        data_frame_timeout_s="one data-plane frame must arrive within this (at most lease_s); a stalled producer's region is reclaimed by its lease",
        data_handshake_timeout_s="a new data-plane connection must prove itself within this (at most 60); until then it holds a place among the unproven ones",
    ),
    "tcp_conns": _native(
        "tcp_conns", ("producer",),
        "TCP connections from the producer to each consumer shard",
    ),
    "complete_window": _native(
        "complete_window", ("producer",),
        "completes the producer has out to one shard and unanswered; below it the producer never waits for an answer",
    ),
    "credit_window_bytes": _native(
        "credit_window_bytes", _BOTH,
        "standing credit (0: off): the slab room each PD shard grants an encoder ahead, and the window the encoder asks each shard for; set on both, a batch over shm or mooncake moves with no reserve round trip (cuda_ipc and tcp complete in-band and keep it)",
        only_if_set=True,
    ),
    "tcp_chunk_bytes": _native(
        "tcp_chunk_bytes", ("producer",),
        "large items are split into chunks of at most this many bytes, spread over the connections",
    ),
    "data_port": _native(
        "data_port", ("consumer",),
        "first TCP data-plane port; shard i listens at `data_port + dp_rank*tp_size + tp_rank` (0: any free port)",
    ),
    "max_resident_bytes": _native(
        "max_resident_bytes", ("consumer",),
        "bytes of each shard's slab kept as resident copies after the engine freed them (0: the slab is the cap)",
    ),
    "host": _native(
        "host", _BOTH,
        "this machine's identity, used to pick a same-host transport (empty: the hostname)",
        only_if_set=True,
    ),
    "gomaxprocs": _native(
        "gomaxprocs", ("process",),
        "threads of the Go runtime in each vLLM process; small, so that it does not compete with PyTorch",
    ),
    "log_level": _native(
        "log_level", ("process",),
        "the library's log level (to stderr)",
    ),
    "metrics_port": _native(
        "metrics_port", ("process",),
        "Prometheus `/metrics` of each vLLM process, on an encoder as on a PD instance: the engine core "
        "at this port, the worker of rank r = dp_rank*tp_size + tp_rank at `metrics_port + 1 + r` "
        "(an encoder's engine core holds no transfer state: its pushes are counted on its worker) (0: off)",
        only_if_set=True,
    ),
    # Mooncake's settings are sent only when set, so that the engine's own
    # default applies (and a build without Mooncake never sees them).
    **_natives(
        _BOTH,
        only_if_set=True,
        mooncake_library="path of `libtransfer_engine.so` (empty: the installed Mooncake pip wheel through ecmooncake's shim, "
        "else the loader's search path)",
        mooncake_engine="path of a Mooncake pip wheel's `mooncake/engine.so`, carried by the shim `mooncake_library` then names "
        "(empty: filled in when the wheel is installed and `mooncake_library` is not set)",
        mooncake_protocol="Mooncake transport; both ends must name the same one",
        mooncake_metadata="`P2PHANDSHAKE`, `http://host:port/metadata` or `etcd://host:port` (empty: P2PHANDSHAKE, or the shard's own metadata server)",
    ),
    "mooncake_metadata_server": _native(
        "mooncake_metadata_server", ("consumer",),
        "`host:port` at which a consumer shard serves a Mooncake metadata store", only_if_set=True,
    ),
    "mooncake_local_server_name": _native(
        "mooncake_local_server_name", _BOTH,
        "the engine's segment name in HTTP metadata mode (empty: host:port)", only_if_set=True,
    ),
    "mooncake_host": _native(
        "mooncake_host", _BOTH,
        "address peers reach the Mooncake engine at (empty: ec_ip on a consumer)", only_if_set=True,
    ),
    "auth_secret": _native(
        "auth_secret", ("producer", "consumer", "scheduler"),
        "the deployment's secret: the control plane is authenticated and encrypted (CURVE) with keys derived "
        f"from it; prefer `{SECRET_ENV}` or `auth_secret_file` to keep it off the command line (empty: none)",
        only_if_set=True,
    ),
    "auth_secret_file": _native(
        "auth_secret_file", ("producer", "consumer", "scheduler"),
        "a file holding the secret (read by the library when each object opens; trailing line break ignored)",
        only_if_set=True,
    ),
    "mooncake_metadata_open": _native(
        "mooncake_metadata_open", ("consumer",),
        "serve the shard's metadata store (`mooncake_metadata_server`) without a token; without one and "
        "without this the shard does not start (logged loudly)",
        only_if_set=True,
    ),
    "allow_unauthenticated": _native(
        "allow_unauthenticated", ("producer", "consumer", "scheduler"),
        "run without any secret: no per-user secret, and a consumer bound beyond loopback serves anybody who reaches "
        "it (logged loudly); without it and without a secret, every process of this uid shares a per-user secret "
        "and a consumer beyond loopback does not start",
        only_if_set=True,
    ),
    # The connector's own: the Store tier runs in Python (ecmooncake.store).
    "store": ExtraKey(
        None, lambda k, v: _store(k, v), (),
        "the optional second tier in Mooncake Store (an object of `store` settings, off by default): an encoder "
        "puts each output it hands over there, asynchronously and bounded (a CUDA output through a pinned pool "
        "copied into on a stream of the tier's own), with a small index; a PD gets the items a proxy with "
        "store_reuse says come from the Store, and encodes them itself when they do not",
    ),
    "mooncake_staging_bytes": _native(
        "mooncake_staging_bytes", ("producer",),
        "registered staging memory the producer copies encoder outputs into before a write: host memory, and as much "
        "GPU memory of each device outputs come from with a CUDA build of the engine",
        only_if_set=True,
    ),
}


@dataclass(frozen=True)
class Topology:
    """Where this process sits in its vLLM instance."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    first_pp_stage: bool = True
    dp_rank: int = 0
    dp_size: int = 1


@dataclass(frozen=True)
class ECMooncakeConfig:
    """The connector's validated settings."""

    is_producer: bool
    is_consumer: bool
    ec_ip: str
    ec_port: int
    buffer_size: int
    buffer_device: str
    topology: Topology
    extra: dict[str, Any] = field(default_factory=dict)

    def value(self, key: str) -> Any:
        return self.extra.get(key, EXTRA_KEYS[key].default)

    @property
    def store(self) -> Any:
        """The Store tier's settings (a disabled StoreSettings when unset)."""
        if self.extra.get("store") is not None:
            return self.extra["store"]
        return StoreSettings()

    @property
    def slab_memory(self) -> str:
        """Where a consumer shard's slab lives: ``device`` (GPU memory of
        the buffer device), ``pinned_host`` (host memory copied to the GPU
        at load) or ``host`` (ec_buffer_device cpu)."""
        if not self.buffer_device.startswith("cuda"):
            return "host"
        chosen = self.value("buffer_memory")
        if chosen == "auto":
            if self.value("transport") == "mooncake":
                return "device" if mooncake_registers_gpu(self.extra) else "pinned_host"
            return "device"
        return chosen

    @property
    def consumer_endpoint(self) -> str:
        """The control endpoint a proxy names for this consumer instance:
        its first TP shard (each shard describes all of them)."""
        t = self.topology
        port = self.ec_port + t.dp_rank * t.tp_size
        ip = self.ec_ip.strip("[]")
        if ":" in ip:
            ip = f"[{ip}]"
        return f"tcp://{ip}:{port}"

    def _settings(self, target: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, spec in EXTRA_KEYS.items():
            if target not in spec.targets:
                continue
            if key in self.extra:
                out[key] = self.extra[key]
            elif not spec.only_if_set:
                out[key] = spec.default
        if target in EXTRA_KEYS["auth_secret"].targets:
            env = os.environ.get(SECRET_ENV, "")
            if env and "auth_secret" not in out and "auth_secret_file" not in out:
                out["auth_secret"] = secret(SECRET_ENV, env)
        return out

    def consumer_settings(self) -> dict[str, Any]:
        t = self.topology
        out = {
            "ec_ip": self.ec_ip,
            "ec_port": self.ec_port,
            "tp_rank": t.tp_rank,
            "tp_size": t.tp_size,
            "dp_rank": t.dp_rank,
            **self._settings("consumer"),
        }
        if out.get("data_port"):
            out["data_port"] += t.dp_rank * t.tp_size + t.tp_rank
        return out

    def producer_settings(self) -> dict[str, Any]:
        return self._settings("producer")

    def scheduler_settings(self) -> dict[str, Any]:
        t = self.topology
        return {
            "ec_ip": self.ec_ip,
            "ec_port": self.ec_port,
            "tp_size": t.tp_size,
            "dp_rank": t.dp_rank,
            **self._settings("scheduler"),
        }

    def process_settings(self, worker: bool) -> dict[str, Any]:
        """configure() settings for this process: the engine core, or a
        worker (whose metrics port sits above the engine core's, one per
        rank, so that the processes of one instance never collide)."""
        out = self._settings("process")
        if out.get("metrics_port") and worker:
            t = self.topology
            out["metrics_port"] += 1 + t.dp_rank * t.tp_size + t.tp_rank
        if out.get("metrics_port") and out["metrics_port"] > 65535:
            raise _fail("metrics_port", self.extra["metrics_port"], "a port that leaves room for every rank above it")
        if out.get("metrics_port"):
            out.setdefault("metrics_ip", self.ec_ip.strip("[]"))
        return out


def parse_extra(extra: Any) -> dict[str, Any]:
    """Checks ``ec_connector_extra_config``; returns the keys set, normalised."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise _fail("ec_connector_extra_config", extra, "a JSON object")
    out: dict[str, Any] = {}
    for key, value in extra.items():
        spec = EXTRA_KEYS.get(key)
        if spec is None:
            raise ConfigError(
                f"ECMooncakeConnector: ec_connector_extra_config has unknown key {key!r} "
                f"(value {value!r}); allowed keys: {', '.join(sorted(EXTRA_KEYS))}"
            )
        out[key] = spec.check(f"ec_connector_extra_config.{key}", value)
    if "auth_secret" in out and "auth_secret_file" in out:
        raise ConfigError(
            "ECMooncakeConnector: ec_connector_extra_config sets both auth_secret and auth_secret_file; set one"
        )
    return out


def topology_of(vllm_config: Any) -> Topology:
    """TP/PP/DP placement of this process.

    Inside a vLLM worker the model-parallel groups are set up before the
    connector is built, and they are the truth. Elsewhere (the engine-core
    process, tools, tests) the parallel config is: vLLM numbers a worker's
    ranks with TP innermost, so tp_rank = rank % tp_size.
    """
    pc = getattr(vllm_config, "parallel_config", None)
    tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
    dp_rank = getattr(pc, "data_parallel_index", None)
    if dp_rank is None:
        dp_rank = getattr(pc, "data_parallel_rank", 0)
    rank = int(getattr(pc, "rank", 0) or 0)
    tp_rank = rank % tp_size
    first_pp = rank // tp_size % pp_size == 0
    try:
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            tp = parallel_state.get_tp_group()
            tp_rank, tp_size = tp.rank_in_group, tp.world_size
            first_pp = parallel_state.get_pp_group().is_first_rank
    except (ImportError, AttributeError, AssertionError):
        pass
    return Topology(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_size=pp_size,
        first_pp_stage=first_pp,
        dp_rank=int(dp_rank or 0),
        dp_size=dp_size,
    )


def from_vllm_config(vllm_config: Any, topology: Topology | None = None) -> ECMooncakeConfig:
    """Validates the EC settings of ``vllm_config``; raises ConfigError."""
    ec = getattr(vllm_config, "ec_transfer_config", None)
    if ec is None:
        raise ConfigError("ECMooncakeConnector: vllm_config has no ec_transfer_config")
    is_producer = bool(getattr(ec, "is_ec_producer", False))
    is_consumer = bool(getattr(ec, "is_ec_consumer", False))
    if not (is_producer or is_consumer):
        raise _fail("ec_role", getattr(ec, "ec_role", None), "'ec_producer', 'ec_consumer' or 'ec_both'")
    topology = topology or topology_of(vllm_config)
    if is_producer:
        for key, size in (
            ("tensor_parallel_size", topology.tp_size),
            ("pipeline_parallel_size", topology.pp_size),
            ("data_parallel_size", topology.dp_size),
        ):
            if size != 1:
                raise ConfigError(
                    f"ECMooncakeConnector: an encoder (ec_producer) instance needs {key} = 1, "
                    f"got {size}; run more encoder instances instead of sharding one"
                )
    ec_ip = host("ec_ip", getattr(ec, "ec_ip", "127.0.0.1"))
    port = schema.setting("consumer", "ec_port")
    ec_port = integer("ec_port", getattr(ec, "ec_port", port["default"]), int(port["min"]), int(port["max"]))
    highest = ec_port + topology.dp_rank * topology.tp_size + topology.tp_size - 1
    if is_consumer and highest > 65535:
        raise ConfigError(
            f"ECMooncakeConnector: ec_port = {ec_port} is not allowed with tp_size "
            f"{topology.tp_size} and dp_rank {topology.dp_rank}: shard ports reach {highest}; "
            f"want ec_port + dp_rank*tp_size + tp_size - 1 <= 65535"
        )
    buffer_size = integer("ec_buffer_size", getattr(ec, "ec_buffer_size", 1e9), MIN_BUFFER_BYTES, 1 << 50)
    device = getattr(ec, "ec_buffer_device", None) or "cuda"
    if not isinstance(device, str) or device.split(":")[0].lower() not in BUFFER_DEVICES or (
        ":" in device and not device.split(":", 1)[1].isdigit()
    ):
        raise _fail("ec_buffer_device", device, "'cpu', 'cuda' or 'cuda:N'")
    extra = parse_extra(getattr(ec, "ec_connector_extra_config", None))
    if is_consumer and extra.get("transport") == "shm" and device.lower() != "cpu":
        # The slab must be a file in /dev/shm that producers map; pinned
        # host memory for a GPU cannot be one.
        raise ConfigError(
            f"ECMooncakeConnector: transport 'shm' needs ec_buffer_device = 'cpu' on the consumer, "
            f"got {device!r}; set ec_buffer_device to 'cpu' or use transport 'tcp'"
        )
    return ECMooncakeConfig(
        is_producer=is_producer,
        is_consumer=is_consumer,
        ec_ip=ec_ip,
        ec_port=ec_port,
        buffer_size=buffer_size,
        buffer_device=device.lower(),
        topology=topology,
        extra=extra,
    )


def mooncake_registers_gpu(extra: dict[str, Any]) -> bool:
    """Whether the Mooncake engine these settings load (``mooncake_library``
    and ``mooncake_engine``, else the installed wheel) is a CUDA build,
    which registers GPU memory; False, logged, when the library cannot say
    (the shard then fails to open on its own, with the cause)."""
    from . import native

    try:
        info = native.mooncake_info(extra.get("mooncake_library"), extra.get("mooncake_engine"))
    except Exception as exc:  # the library itself is missing: the shard's open reports it
        logger.warning("ecmooncake: cannot ask the library whether the Mooncake engine registers GPU memory (%s); "
                       "a Mooncake PD's slab stays in pinned host memory", exc)
        return False
    if not info.get("available"):
        return False
    return bool(info.get("cuda"))
