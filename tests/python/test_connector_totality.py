"""The connector's hooks are total: whatever the library answers, every
entry vLLM will gather is filled (a tensor, or a stand-in for a request that
is failed), every failure reaches take_unavailable_requests, and plugin
registration survives a vLLM whose factory changed shape."""

from __future__ import annotations

import logging

import pytest

from vllm_engine import make_config, require_vllm, tiny_model

require_vllm()

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402

from ecmooncake import plugin  # noqa: E402
from ecmooncake.connector import LoadSpec, _StepMetadata  # noqa: E402
from ecmooncake.tools.harness import free_port_range  # noqa: E402
from ecmooncake.native import EcmError  # noqa: E402

pytestmark = pytest.mark.usefixtures("library")

EXTRA = {"push_wait_timeout_s": 10, "control_timeout_s": 5, "log_level": "warn"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def worker(model_dir):
    """A started consumer worker whose native shard a test may replace."""
    plugin.register()
    config = make_config("ec_consumer", model_dir=model_dir, port=free_port_range(1), buffer_size=16 << 20, extra=EXTRA)
    c = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
    c.start_worker_services()
    w = c._consumer_worker
    real = w._native
    yield w
    w._native = real
    c.shutdown()


class FakeShard:
    """Answers acquire and release as told, and records what it was asked."""

    def __init__(self, acquired=None, acquire_error=None, release_error=None):
        self.acquired = acquired
        self.acquire_error = acquire_error
        self.release_error = release_error
        self.released: list[str] = []

    def acquire(self, hashes):
        if self.acquire_error is not None:
            raise self.acquire_error
        return self.acquired(hashes)

    def release(self, hashes):
        self.released += hashes
        if self.release_error is not None:
            raise self.release_error
        return [{"mm_hash": h} for h in hashes]

    def close(self):
        pass


def _specs(n: int) -> list[LoadSpec]:
    return [LoadSpec(f"{i:064x}", f"t{i}", 16, "image") for i in range(n)]


GOOD_META = '{"dtype": "float32", "shape": [16, 128]}'


def _item(h: str, offset: int = 0, meta: str = GOOD_META) -> dict:
    return {"mm_hash": h, "offset": offset, "nbytes": 16 * 128 * 4, "meta": meta}


@pytest.mark.parametrize(
    "case, shard",
    [
        # fewer answers than items asked: zip() used to drop the rest
        ("short answer", lambda: FakeShard(acquired=lambda hs: [_item(hs[0])])),
        # an answer without "offset": a KeyError used to escape the hook
        ("missing field", lambda: FakeShard(acquired=lambda hs: [{"mm_hash": h, "nbytes": 8192, "meta": GOOD_META} for h in hs])),
        # a bad description, and the release of it failing too
        (
            "bad meta, release fails",
            lambda: FakeShard(acquired=lambda hs: [_item(h, meta='{"dtype": "int4"}') for h in hs], release_error=EcmError("closed")),
        ),
        # the library failing in a way it never should
        ("acquire raises", lambda: FakeShard(acquire_error=RuntimeError("boom"))),
    ],
)
def test_every_wanted_entry_is_filled_and_each_failure_reported(worker, case, shard):
    fake = shard()
    worker._native = fake
    specs = _specs(3)
    cache: dict = {}
    worker.load(_StepMetadata(loads=specs), cache)
    assert sorted(cache) == sorted(s.mm_hash for s in specs), case
    for s in specs:
        # a real view, or a stand-in as wide as the model's hidden size
        assert cache[s.mm_hash].shape[0] == 16, case
    failed = set(worker._failed)
    loaded = set(worker._loaded)
    assert failed | loaded == {s.transfer_id for s in specs}, case
    assert failed, case


def test_a_request_whose_ensure_keeps_raising_is_reported(model_dir):
    from vllm_engine import Item, make_request

    plugin.register()
    port = free_port_range(1)
    config = make_config("ec_consumer", model_dir=model_dir, port=port, extra=EXTRA)
    c = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    try:
        sched = c._consumer_sched

        class Broken:
            def __init__(self, real):
                self.real = real

            def step(self, body):
                raise EcmError("the native scheduler is gone")

            def __getattr__(self, name):
                return getattr(self.real, name)

        sched._native = Broken(sched._native)
        req = make_request("pd-raise", [Item("raise/a", 16, 128)], {"ec_items": [{"transfer_id": "r0"}]})
        for _ in range(5):
            assert c.ensure_cache_available(req, 0) is False
        assert req.request_id in c.take_unavailable_requests()
        sched._native = sched._native.real
    finally:
        c.shutdown()


def test_plugin_registration_survives_a_changed_factory(monkeypatch, caplog):
    monkeypatch.setattr(ECConnectorFactory, "_registry", None, raising=False)
    caplog.set_level(logging.WARNING, logger="vllm.ecmooncake")
    plugin.register()  # must not raise into vLLM's plugin loader
    plugin.register()
    warnings = [r for r in caplog.records if "factory" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "ec_connector_module_path" in warnings[0].getMessage()
