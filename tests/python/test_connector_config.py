"""--ec-transfer-config as the connector reads it: every setting checked
before anything starts, with a message naming the key, the value and what is
allowed; and docs/vllm.md's table of extra-config keys kept in step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_engine import make_config, require_vllm, tiny_model

require_vllm()

from vllm.config import DeviceConfig, ECTransferConfig, ModelConfig, ParallelConfig, VllmConfig  # noqa: E402

from ecmooncake import ec_config  # noqa: E402
from ecmooncake.ec_config import EXTRA_KEYS, ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


def consumer(model_dir, **ec):
    extra = ec.pop("extra", {})
    config = make_config("ec_consumer", model_dir=model_dir, port=ec.pop("port", 14579), extra=extra)
    for key, value in ec.items():
        setattr(config.ec_transfer_config, key, value)
    return config


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"ec_buffer_size": 0}, ["ec_buffer_size", "0", "an integer in ["]),
        ({"ec_buffer_size": "lots"}, ["ec_buffer_size", "'lots'", "an integer"]),
        ({"ec_buffer_size": 1.5e6 + 0.5}, ["ec_buffer_size", "an integer"]),
        ({"ec_port": 70000}, ["ec_port", "70000", "[1, 65535]"]),
        ({"ec_ip": "not a host!"}, ["ec_ip", "'not a host!'", "IPv4 or IPv6 address or a hostname"]),
        ({"ec_buffer_device": "tpu"}, ["ec_buffer_device", "'tpu'", "'cpu', 'cuda' or 'cuda:N'"]),
        ({"extra": {"transport": "carrier-pigeon"}}, ["transport", "'carrier-pigeon'", "'tcp', 'mooncake'"]),
        ({"ec_buffer_device": "cuda", "extra": {"transport": "shm"}}, ["transport 'shm'", "ec_buffer_device = 'cpu'", "'cuda'"]),
        ({"extra": {"push_wait_timeout_s": -1}}, ["push_wait_timeout_s", "-1", "positive number of seconds"]),
        ({"extra": {"load_timeout_s": "soon"}}, ["load_timeout_s", "'soon'", "positive number of seconds"]),
        ({"extra": {"tcp_conns": 0}}, ["tcp_conns", "0", "[1, 64]"]),
        ({"extra": {"data_handshake_timeout_s": 0}}, ["data_handshake_timeout_s", "0", "(0, 60]"]),
        ({"extra": {"data_handshake_timeout_s": 61}}, ["data_handshake_timeout_s", "61", "(0, 60]"]),
        ({"extra": {"tcp_conns": 2.5}}, ["tcp_conns", "2.5", "an integer"]),
        ({"extra": {"gomaxprocs": True}}, ["gomaxprocs", "True", "an integer"]),
        ({"extra": {"log_level": "loud"}}, ["log_level", "'loud'", "'debug', 'info', 'warn', 'error'"]),
        ({"extra": {"mooncake_library": 7}}, ["mooncake_library", "7", "a string"]),
        ({"extra": {"shared_storage_path": "/tmp"}}, ["unknown key 'shared_storage_path'", "'/tmp'", "push_wait_timeout_s"]),
        ({"ec_role": "ec_kv_both"}, ["ec_role", "'ec_kv_both'", "'ec_producer', 'ec_consumer' or 'ec_both'"]),
    ],
)
def test_bad_settings_are_refused_with_key_value_and_allowed(model_dir, settings, words):
    with pytest.raises(ConfigError) as info:
        ec_config.from_vllm_config(consumer(model_dir, **settings))
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    "parallel, key",
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
        ({"data_parallel_size": 2}, "data_parallel_size"),
    ],
)
def test_an_encoder_instance_must_be_unsharded(model_dir, parallel, key):
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16"),
        ec_transfer_config=ECTransferConfig(ec_connector="ECMooncakeConnector", ec_role="ec_producer"),
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(**parallel),
    )
    with pytest.raises(ConfigError, match=f"needs {key} = 1, got 2"):
        ec_config.from_vllm_config(config)


def test_a_gpu_buffer_on_a_host_without_a_gpu_names_the_key_and_the_fix(model_dir):
    # vLLM's default ec_buffer_device is "cuda": on a CPU-only host the PD
    # instance must stop at startup with the setting to change, not with
    # torch's "Found no NVIDIA driver" at its first load.
    import torch
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from ecmooncake import plugin

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    plugin.register()
    for device in ("cuda", "cuda:0"):
        config = consumer(model_dir, ec_buffer_device=device)
        with pytest.raises(ConfigError) as info:
            ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
        message = str(info.value)
        assert f"ec_buffer_device = {device!r}" in message
        assert "no usable CUDA device" in message
        assert '"ec_buffer_device": "cpu"' in message


def test_consumer_shard_ports_must_fit(model_dir):
    config = make_config("ec_consumer", model_dir=model_dir, port=65535, tp_size=2)
    with pytest.raises(ConfigError, match="shard ports reach 65536"):
        ec_config.from_vllm_config(config)


def test_vllm_defaults_are_accepted(model_dir):
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16"),
        ec_transfer_config=ECTransferConfig(ec_connector="ECMooncakeConnector", ec_role="ec_consumer"),
        device_config=DeviceConfig(device="cpu"),
    )
    cfg = ec_config.from_vllm_config(config)
    assert (cfg.ec_ip, cfg.ec_port, cfg.buffer_size, cfg.buffer_device) == ("127.0.0.1", 14579, 10**9, "cuda")
    assert cfg.consumer_endpoint == "tcp://127.0.0.1:14579"


def test_settings_reach_the_objects_that_take_them(model_dir):
    extra = {"push_wait_timeout_s": 12, "tcp_conns": "8", "data_port": 20000, "lease_s": 90, "log_level": "WARN", "mooncake_protocol": "tcp"}
    config = make_config("ec_consumer", model_dir=model_dir, port=30000, extra=extra)
    cfg = ec_config.from_vllm_config(config, ec_config.Topology(tp_rank=1, tp_size=2, dp_rank=1, dp_size=2))
    assert cfg.consumer_settings() == {
        "ec_ip": "127.0.0.1",
        "ec_port": 30000,
        "tp_rank": 1,
        "tp_size": 2,
        "dp_rank": 1,
        "transport": "tcp",
        "lease_s": 90.0,
        "data_port": 20000 + 1 * 2 + 1,
        "max_resident_bytes": 0,
        "mooncake_protocol": "tcp",
    }
    assert cfg.scheduler_settings() == {
        "ec_ip": "127.0.0.1",
        "ec_port": 30000,
        "tp_size": 2,
        "dp_rank": 1,
        "push_wait_timeout_s": 12.0,
        "load_timeout_s": 30.0,
    }
    producer = ec_config.from_vllm_config(make_config("ec_producer", model_dir=model_dir, port=30000, extra=extra)).producer_settings()
    assert producer["tcp_conns"] == 8 and producer["push_wait_timeout_s"] == 12.0
    assert "control_timeout_s" not in producer, "unset, the library's own default applies"
    assert cfg.process_settings(worker=False) == {"gomaxprocs": 2, "log_level": "warn"}
    assert cfg.consumer_endpoint == "tcp://127.0.0.1:30002", "first shard of DP rank 1"


def shown(default) -> str:
    """A default as docs/vllm.md's table writes it."""
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, str):
        return f"`{default}`" if default else "(empty)"
    return str(default)


def test_readme_lists_every_extra_key_with_its_default():
    text = (ROOT / "docs" / "vllm.md").read_text()
    # Only the settings table: other tables (the version table) also begin rows with a code span.
    start = text.index("**`ec_connector_extra_config`**")
    section = text[start:].split("\n\n| key |", 1)[1].split("\n\n", 1)[0]
    rows = {key: default.strip() for key, default in re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", section, flags=re.M)}
    assert sorted(rows) == sorted(EXTRA_KEYS)
    for key, spec in EXTRA_KEYS.items():
        if spec.default is not None:
            assert rows[key] == shown(spec.default), f"{key}: docs/vllm.md says {rows[key]!r}, the code {spec.default!r}"


def test_metrics_ports_do_not_collide_across_an_instances_processes(model_dir):
    extra = {"metrics_port": 9400}
    ports = set()
    for tp_rank in range(2):
        topo = ec_config.Topology(tp_rank=tp_rank, tp_size=2, dp_rank=1, dp_size=2)
        cfg = ec_config.from_vllm_config(make_config("ec_consumer", model_dir=model_dir, port=30000, extra=extra), topo)
        ports.add(cfg.process_settings(worker=True)["metrics_port"])
        engine = cfg.process_settings(worker=False)
    assert engine["metrics_port"] == 9400 and engine["metrics_ip"] == "127.0.0.1"
    assert ports == {9400 + 1 + 2 + 0, 9400 + 1 + 2 + 1}, "one port per shard above the engine core's"
    off = ec_config.from_vllm_config(make_config("ec_consumer", model_dir=model_dir, port=30000))
    assert "metrics_port" not in off.process_settings(worker=True), "unset: no metrics server"
