"""The connector's stamps in the ready path's trace, logged one line each
with ECMOONCAKE_TRACE_LOG=1 (ecmooncake.trace): the consumer stamps an item
when it puts the item's view into vLLM's encoder cache, in the line format
build/gpu_vllm_e2e.py reads; with the trace off nothing is logged."""

from __future__ import annotations

import importlib.util
import logging
import sys

import pytest

from conftest import REPO
from vllm_engine import make_config, require_vllm, tiny_model

require_vllm()

import torch  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402

from ecmooncake import plugin  # noqa: E402
from ecmooncake import trace  # noqa: E402
from ecmooncake.connector import LoadSpec, _StepMetadata  # noqa: E402
from ecmooncake.tools.harness import free_port_range  # noqa: E402

pytestmark = pytest.mark.usefixtures("library")

EXTRA = {"push_wait_timeout_s": 10, "control_timeout_s": 5, "log_level": "warn"}
H = "ab" * 32

_spec = importlib.util.spec_from_file_location("gpu_vllm_e2e_for_trace", REPO / "build" / "gpu_vllm_e2e.py")
e2e = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = e2e  # its dataclasses look their module up
_spec.loader.exec_module(e2e)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


def _connector(model_dir, role):
    plugin.register()
    config = make_config(role, model_dir=model_dir, port=free_port_range(1), buffer_size=16 << 20, extra=EXTRA)
    c = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
    c.start_worker_services()
    return c


class WantsAll:
    """A producer worker that wants every item and records what it took."""

    def __init__(self):
        self.taken = []

    def wants(self, mm_hash):
        return True

    def capture(self, mm_hash, tensor):
        self.taken.append(mm_hash)


class OneItemShard:
    """A consumer shard that holds every item asked for, at offset 0."""

    def acquire(self, hashes):
        return [{"mm_hash": h, "offset": 0, "nbytes": 16 * 128 * 4, "meta": '{"dtype": "float32", "shape": [16, 128]}'} for h in hashes]

    def release(self, hashes):
        return [{"mm_hash": h} for h in hashes]

    def close(self):
        pass


@pytest.mark.parametrize("on", [True, False])
def test_the_put_into_encoder_cache_is_stamped(model_dir, monkeypatch, caplog, on):
    monkeypatch.setattr(trace, "_ring", trace._LoggedRing(1024) if on else None)
    producer = _connector(model_dir, "ec_producer")
    consumer = _connector(model_dir, "ec_consumer")
    try:
        fake = WantsAll()
        producer._producer_worker = fake
        worker = consumer._consumer_worker
        real, worker._native = worker._native, OneItemShard()
        cache: dict = {}
        with caplog.at_level(logging.INFO, logger="vllm.ecmooncake"):
            producer.save_caches({H: torch.zeros(16, 128)}, H)
            worker.load(_StepMetadata(loads=[LoadSpec(H, "t1", 16, "image")]), cache)
        worker._native = real
        assert fake.taken == [H] and H in cache
        lines = [line for line in caplog.text.splitlines() if "item-trace" in line]
        if on:
            assert len(lines) == 1 and f"ecmooncake item-trace encoder_cache mm_hash={H} t_ns=" in lines[0]
            # The save_caches line is the producer worker's (its capture,
            # which the fake above stands in for): the reader pairs both.
            save = lines[0].replace("encoder_cache", "save_caches").replace("t_ns=", "t_ns=0")
            rows = e2e.item_times(save, caplog.text)
            assert [r["mm_hash"] for r in rows] == [H]
        else:
            assert lines == []
    finally:
        producer.shutdown()
        consumer.shutdown()
