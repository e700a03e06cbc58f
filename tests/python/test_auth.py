"""The control plane's secret as Python hands it down: validated without
ever being echoed, taken from ECMOONCAKE_SECRET when the extra config has
none, and accepted by the library's config decoding for every object."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import wait_until
from ecmooncake import ec_config
from ecmooncake.ec_config import ConfigError, Secret, parse_extra
from ecmooncake.tools.harness import free_port_range
from ecmooncake.native import Consumer, EcmInvalid, Producer, Scheduler

SECRET = "python-tests-deployment-secret-01"
IP = "127.0.0.1"


def config(extra: dict) -> ec_config.ECMooncakeConfig:
    return ec_config.ECMooncakeConfig(
        is_producer=True,
        is_consumer=True,
        ec_ip=IP,
        ec_port=30000,
        buffer_size=1 << 20,
        buffer_device="cpu",
        topology=ec_config.Topology(),
        extra=parse_extra(extra),
    )


def test_secret_is_checked_and_never_echoed():
    for bad in ("hunter2", 12345678901234567890, None):
        with pytest.raises(ConfigError) as info:
            parse_extra({"auth_secret": bad})
        assert "auth_secret" in str(info.value) and "hunter2" not in str(info.value)
    with pytest.raises(ConfigError, match="both"):
        parse_extra({"auth_secret": SECRET, "auth_secret_file": "/run/secrets/ecm"})
    with pytest.raises(ConfigError, match="true or false"):
        parse_extra({"allow_unauthenticated": "yes"})


def test_weak_secret_is_refused_naming_the_fix(monkeypatch):
    # Long enough, and guessable: one repeated letter, or two in turn.
    for weak in ("a" * 32, "ab" * 16):
        with pytest.raises(ConfigError) as info:
            parse_extra({"auth_secret": weak})
        assert "distinct" in str(info.value) and "/dev/urandom" in str(info.value) and weak not in str(info.value)
    monkeypatch.setenv(ec_config.SECRET_ENV, "z" * 40)
    with pytest.raises(ConfigError, match=ec_config.SECRET_ENV):
        config({}).producer_settings()
    parse_extra({"auth_secret": "0123456789abcdef"})


@pytest.mark.usefixtures("library")
def test_library_refuses_a_secret_file_others_can_read(tmp_path):
    # Python defers the file to the library, which reads it when each
    # object opens: a file the rest of the host can read is refused there.
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    for mode in (0o644, 0o640):
        path.chmod(mode)
        with pytest.raises(EcmInvalid) as info:
            Producer({"auth_secret_file": str(path)})
        assert f"{mode:04o}" in str(info.value) and "chmod 600" in str(info.value) and SECRET not in str(info.value)
    path.chmod(0o600)
    with Producer({"auth_secret_file": str(path)}):
        pass


def test_secret_reaches_every_object_and_stays_out_of_reprs(monkeypatch):
    monkeypatch.delenv(ec_config.SECRET_ENV, raising=False)
    cfg = config({"auth_secret": SECRET, "allow_unauthenticated": True})
    for settings in (cfg.consumer_settings(), cfg.producer_settings(), cfg.scheduler_settings()):
        assert settings["auth_secret"] == SECRET
        assert json.loads(json.dumps(settings))["auth_secret"] == SECRET, "the library gets the plain value"
        assert SECRET not in repr(settings)
    for settings in (cfg.consumer_settings(), cfg.producer_settings(), cfg.scheduler_settings()):
        assert settings["allow_unauthenticated"] is True, "every end runs without the per-user secret alike"
    assert SECRET not in repr(cfg)
    assert "auth_secret" not in config({}).consumer_settings(), "no secret unless one is given"


def test_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv(ec_config.SECRET_ENV, SECRET)
    cfg = config({})
    for settings in (cfg.consumer_settings(), cfg.producer_settings(), cfg.scheduler_settings()):
        assert settings["auth_secret"] == SECRET and isinstance(settings["auth_secret"], Secret)
    assert "auth_secret" not in config({"auth_secret_file": "/run/secrets/ecm"}).producer_settings(), "a file set in the config wins"
    monkeypatch.setenv(ec_config.SECRET_ENV, "short")
    with pytest.raises(ConfigError) as info:
        config({}).producer_settings()
    assert ec_config.SECRET_ENV in str(info.value) and "short" not in str(info.value).split(ec_config.SECRET_ENV)[1]


@pytest.mark.usefixtures("library")
def test_library_takes_the_auth_settings(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    port = free_port_range(1, IP)
    slab = np.zeros(1 << 20, np.uint8)
    with Consumer({"ec_ip": IP, "ec_port": port, "auth_secret_file": str(path), "allow_unauthenticated": True}, slab) as consumer:
        assert SECRET not in json.dumps(consumer.stats())
    with Producer({"auth_secret": SECRET}), Scheduler({"ec_ip": IP, "ec_port": port, "auth_secret_file": str(path)}):
        pass
    for open_object in (
        lambda: Producer({"auth_secret": "hunter2"}),
        lambda: Scheduler({"auth_secret": SECRET, "auth_secret_file": str(path)}),
        lambda: Consumer({"ec_ip": IP, "ec_port": port, "auth_secret_file": str(tmp_path / "missing")}, slab),
    ):
        with pytest.raises(EcmInvalid) as info:
            open_object()
        assert "auth_secret" in str(info.value) and "hunter2" not in str(info.value)


@pytest.mark.usefixtures("library")
def test_a_producer_without_the_secret_is_told_so_and_counted(tmp_path):
    """The refusal names the setting on every try, never a bare deadline,
    and both ends count it where their other counters are."""
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    port = free_port_range(1, IP)
    slab = np.zeros(1 << 20, np.uint8)
    data = np.ones(4096, np.uint8)
    # allow_unauthenticated: no secret at all, not even the per-user one.
    with Consumer({"ec_ip": IP, "ec_port": port, "auth_secret_file": str(path)}, slab) as consumer, \
            Producer({"transport": "tcp", "control_timeout_s": 10, "allow_unauthenticated": True}) as producer:
        for attempt in range(3):
            tid, mm_hash = f"refused-{attempt}", f"{attempt}" * 64
            submitted = producer.submit([{"transfer_id": tid, "mm_hash": mm_hash, "nbytes": data.nbytes, "consumer": f"tcp://{IP}:{port}"}])
            assert not submitted[0].get("error"), submitted
            producer.source(mm_hash, data)
            failed: list = []

            def refused():
                out = producer.poll(200)
                assert not out.get("done"), out
                failed.extend(out.get("failed") or [])
                return failed

            wait_until(refused, 30, interval=0, what=f"push {tid} failed")
            reason = json.dumps(failed)
            assert "auth_secret" in reason and "deadline" not in reason, reason
        assert producer.stats().get("control_refused"), "the producer counts the refusals it saw"
        wait_until(lambda: consumer.stats()["control"].get("Refused"), 10, what="the shard counts the refusals")
        assert set(consumer.stats()["control"]["Refused"]) <= {"auth_no_secret", "auth_aborted"}
