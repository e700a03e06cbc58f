"""The Mooncake Store tier inside the connector (``store`` in
``ec_connector_extra_config``), over the in-memory Store
(ecmooncake.store.MemoryStore), through the connector's hooks as vLLM calls
them: the setting, the encoder's puts and their counters, and the series
on vLLM's /metrics. The tier's own bounds and deadlines are in
test_store.py; a real mooncake_master in test_store_real.py."""

from __future__ import annotations

import pickle

import pytest

from conftest import wait_until
from vllm_engine import HIDDEN, Item, make_config, make_request, require_vllm, tiny_model

require_vllm()

import torch  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402

from ecmooncake import connector as ecm_connector  # noqa: E402
from ecmooncake import ec_config, plugin, store  # noqa: E402
from ecmooncake.connector import tier as ctier  # noqa: E402
from ecmooncake.ec_config import ConfigError  # noqa: E402
from ecmooncake.tools.harness import free_port_range  # noqa: E402

pytestmark = pytest.mark.usefixtures("library")

MiB = 1 << 20
WIDTH = 2 * HIDDEN
STORE = {
    "enabled": True,
    "master_address": "127.0.0.1:50051",
    "metadata_address": "http://127.0.0.1:8080/metadata",
    "local_hostname": "127.0.0.1",
    "put_inflight_bytes": 4 * MiB,
    "get_staging_bytes": 4 * MiB,
    "segment_bytes": 0,
}
EXTRA = {"push_wait_timeout_s": 10, "control_timeout_s": 5, "log_level": "warn"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def fake(monkeypatch):
    """The Store every tier of this test talks to."""
    backend = store.MemoryStore()
    monkeypatch.setattr(ctier, "backend_factory", lambda: backend)
    return backend


def create(config, role):
    plugin.register()
    return ECConnectorFactory.create_connector(config, role)


def tensor_for(item: Item) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int(item.identifier[:15], 16))
    return torch.randn(item.shape, generator=gen).to(torch.bfloat16)


class Deployment:
    """A PD instance's scheduler and worker and an encoder's, in one process."""

    def __init__(self, model_dir, store_settings):
        self.port = free_port_range(1)
        extra = dict(EXTRA, store=store_settings) if store_settings is not None else EXTRA
        self.consumer_config = make_config("ec_consumer", model_dir=model_dir, port=self.port, buffer_size=32 * MiB, extra=EXTRA)
        self.producer_config = make_config("ec_producer", model_dir=model_dir, port=self.port, extra=extra, widths={"image": WIDTH})
        self.made = []
        for config, role in ((self.consumer_config, ECConnectorRole.SCHEDULER), (self.consumer_config, ECConnectorRole.WORKER),
                             (self.producer_config, ECConnectorRole.SCHEDULER), (self.producer_config, ECConnectorRole.WORKER)):
            self.made.append(create(config, role))
        self.consumer_sched, self.consumer_worker, self.producer_sched, self.producer_worker = self.made
        self.consumer_worker.start_worker_services()
        self.producer_worker.start_worker_services()

    @property
    def tier(self):
        return self.producer_worker._producer_worker._tier

    def close(self):
        for c in self.made:
            c.shutdown()

    def push(self, items: list[Item], transfer_ids: list[str], tensors=None) -> None:
        """One encoder request through the producer's hooks, in vLLM's order."""
        req = make_request(f"enc-{transfer_ids[0]}", items, {"consumer": f"127.0.0.1:{self.port}",
                                                              "ec_items": [{"transfer_id": t} for t in transfer_ids]})
        s, w = self.producer_sched, self.producer_worker
        assert s.ensure_cache_available(req, 0)
        for i in range(len(items)):
            s.update_state_after_alloc(req, i)
        meta = pickle.loads(pickle.dumps(s.build_connector_meta(SchedulerOutput.make_empty())))
        cache: dict = {}
        w.bind_connector_metadata(meta)
        w.start_save_caches(encoder_cache=cache)
        for i, it in enumerate(items):
            cache[it.identifier] = tensors[i] if tensors else tensor_for(it)
            w.save_caches(encoder_cache=cache, mm_hash=it.identifier)
        w.get_finished(set())
        report = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        s.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))
        s.request_finished(req)


@pytest.fixture
def deployment(model_dir, fake):
    d = Deployment(model_dir, STORE)
    try:
        assert d.tier.tier.wait_ready(10), "the in-memory Store sets up at once"
        yield d
    finally:
        d.close()


def key_of(d: Deployment, item: Item) -> str:
    model, encoder = ctier.identity(d.consumer_config)
    return store.item_key(item.identifier, model=model, encoder_config=encoder, dtype="bfloat16", shape=item.shape)


# -- the setting ------------------------------------------------------------


def test_store_is_off_unless_set_and_loads_nothing(model_dir, monkeypatch):
    def factory():
        raise AssertionError("a Store client was made with the tier off")

    monkeypatch.setattr(ctier, "backend_factory", factory)
    d = Deployment(model_dir, None)
    try:
        assert d.tier is None
        assert not ec_config.from_vllm_config(d.producer_config).store.enabled
        d.push([Item("a0c1" * 8, 40, WIDTH)], ["off-1"])
        assert "store" not in d.producer_worker.native_stats()["producer"]
    finally:
        d.close()


@pytest.mark.parametrize("raw,match", [
    ({"enabled": True}, "master_address"),
    ({"put_inflight_bytes": 1}, "put_inflight_bytes"),
    ({"master": "10.0.0.5:50051"}, "unknown"),
    ("on", "object"),
])
def test_a_bad_store_setting_stops_startup_naming_it(model_dir, raw, match):
    config = make_config("ec_producer", model_dir=model_dir, port=30000, extra={"store": raw})
    with pytest.raises(ConfigError, match=f"store.*{match}"):
        ec_config.from_vllm_config(config)


def test_an_encoder_and_a_pd_name_an_item_alike_and_other_settings_apart(model_dir):
    encoder = make_config("ec_producer", model_dir=model_dir, port=30000, extra={"store": STORE})
    pd = make_config("ec_consumer", model_dir=model_dir, port=30000, tp_size=2)
    assert ctier.identity(encoder) == ctier.identity(pd)
    pd.model_config.multimodal_config.mm_processor_kwargs = {"max_pixels": 200704}
    assert ctier.identity(encoder) != ctier.identity(pd), "other processor settings give other bytes"


# -- the encoder's puts -----------------------------------------------------


def test_each_output_handed_over_is_put_byte_exact_and_counted(deployment, fake):
    items = [Item("b1d2" * 8, 300, WIDTH), Item("b1d3" * 8, 77, WIDTH)]
    deployment.push(items, ["put-a", "put-b"])
    wait_until(lambda: all(key_of(deployment, it) in fake.objects for it in items), 10, interval=0.01, what="both puts")
    for it in items:
        assert fake.objects[key_of(deployment, it)] == tensor_for(it).view(torch.uint8).numpy().tobytes()
    w = deployment.producer_worker
    wait_until(lambda: w.native_stats()["producer"]["store"]["put_ok"] == 2, 10, interval=0.01, what="puts counted")
    counted = w.native_stats()["producer"]["store"]
    assert counted["put_bytes"] == sum(it.nbytes for it in items)
    assert counted["put_inflight_bytes"] == 0, "staging is given back after each put"
    step = w.get_ec_connector_stats().data["store"]
    assert step["put_ok"] == 2 and step["put_bytes"] == sum(it.nbytes for it in items)
    again = w.get_ec_connector_stats()
    assert again is None or not again.data["store"], "increments are handed over once"


def test_each_output_is_indexed_so_that_a_pd_finds_it_knowing_only_its_hash(deployment, fake, model_dir):
    items = [Item("b2d2" * 8, 300, WIDTH), Item("b2d3" * 8, 77, WIDTH)]
    deployment.push(items, ["idx-a", "idx-b"])
    stats = lambda: deployment.producer_worker.native_stats()["producer"]["store"]  # noqa: E731
    wait_until(lambda: stats()["index_put_ok"] == 2, 10, interval=0.01, what="both indexes put")
    assert stats()["put_ok"] == 2, "an index is no output of its own"
    # A PD of the same deployment (another TP size: the layout is
    # replicated) names the index from the hash alone.
    pd_cfg = ec_config.from_vllm_config(make_config("ec_consumer", model_dir=model_dir, port=30000, tp_size=2,
                                                    extra=dict(EXTRA, store=STORE)))
    pd = ctier.make(pd_cfg, make_config("ec_consumer", model_dir=model_dir, port=30000, tp_size=2))
    pd.open()
    try:
        assert pd.tier.wait_ready(10)
        for it in items:
            got = pd.fetch(it.identifier)
            assert got.ok, got
            assert (got.index.dtype, got.index.shape) == ("bfloat16", tuple(it.shape))
            assert bytes(got.data) == tensor_for(it).view(torch.uint8).numpy().tobytes()
        miss = pd.fetch("f00d" * 8)
        assert (miss.ok, miss.reason, miss.stage) == (False, "miss", "index")
    finally:
        pd.close()


def test_a_non_contiguous_output_is_put_as_its_contiguous_bytes(deployment, fake):
    item = Item("c0d1" * 8, 64, WIDTH)
    wide = torch.randn(WIDTH, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).t()
    assert not wide.is_contiguous()
    deployment.push([item], ["nc-1"], tensors=[wide])
    key = key_of(deployment, item)
    wait_until(lambda: key in fake.objects, 10, interval=0.01, what="the put")
    assert fake.objects[key] == wide.contiguous().view(torch.uint8).numpy().tobytes()


def test_the_same_output_again_is_not_put_again(deployment, fake):
    item = Item("d0e1" * 8, 50, WIDTH)
    deployment.push([item], ["dup-1"])
    wait_until(lambda: key_of(deployment, item) in fake.objects, 10, interval=0.01, what="the first put")
    deployment.push([item], ["dup-2"])
    stats = deployment.producer_worker.native_stats()["producer"]["store"]
    assert stats["put_ok"] == 1 and stats["put_duplicate"] == 1


def test_a_store_that_fails_costs_the_push_nothing_and_is_counted(deployment, fake):
    fake.fail = -1  # every call answers an error, as a master that is gone
    items = [Item("e0f1" * 8, 120, WIDTH)]
    w = deployment.producer_worker
    deployment.push(items, ["gone-1"])
    wait_until(lambda: w.native_stats()["producer"]["store"]["put_error"] == 1, 10, interval=0.01, what="the failed put")
    deployment.push([Item("e0f2" * 8, 30, WIDTH)], ["gone-2"])
    stats = w.native_stats()["producer"]["store"]
    assert stats["breaker_trips"] == 1 and stats["put_dropped_unavailable"] == 1
    # The pushes themselves went on: the PD has both items.
    req = make_request("pd-gone", items, {"ec_items": [{"mm_hash": items[0].identifier, "transfer_id": "gone-1"}]})
    wait_until(lambda: deployment.consumer_sched.ensure_cache_available(req, 0), 20, interval=0.01, what="the push arrived")
    assert fake.objects == {}


def test_a_full_staging_drops_the_put_not_the_push(deployment, fake):
    big = Item("f0a1" * 8, (4 * MiB) // (WIDTH * 2) + 1, WIDTH)  # one row more than staging holds
    w = deployment.producer_worker
    deployment.push([big], ["big-1"])
    stats = w.native_stats()["producer"]["store"]
    assert stats["put_dropped_full"] == 1 and fake.objects == {}


class _Cuda:
    """What the tier reads of a CUDA tensor, on a host without a GPU."""

    class device:
        type = "cuda"

    dtype = torch.bfloat16
    shape = (4, 8)


def test_a_cuda_output_is_not_put_and_is_counted(deployment, fake):
    deployment.tier.put("a1b2" * 8, _Cuda())
    stats = deployment.tier.stats()
    assert stats["put_skipped_device"] == 1 and stats["put_ok"] == 0 and fake.objects == {}


def test_close_closes_the_store_client(model_dir, fake):
    d = Deployment(model_dir, STORE)
    assert d.tier.tier.wait_ready(10)
    d.close()
    wait_until(lambda: fake.closed, 10, interval=0.01, what="the Store client closed")


# -- stats ------------------------------------------------------------------


def test_store_counters_merge_across_ranks_and_reach_the_log_line():
    a = ecm_connector.ECMooncakeConnectorStats({"store": {"put_ok": 2, "put_bytes": 3 * MiB, "put_dropped_full": 1}})
    b = ecm_connector.ECMooncakeConnectorStats({"store": {"put_ok": 1, "put_bytes": MiB, "put_skipped_device": 2}})
    merged = a.aggregate(b)
    assert merged.data["store"] == {"put_ok": 3, "put_bytes": 4 * MiB, "put_dropped_full": 1, "put_skipped_device": 2}
    line = merged.reduce()
    assert line["Store puts"] == 3 and line["Store put MiB"] == 4.0 and line["Store puts not made"] == 3


def test_store_counters_on_vllms_prometheus_logger(model_dir):
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    config = make_config("ec_producer", model_dir=model_dir, port=free_port_range(1), extra=EXTRA)
    plugin.register()
    logger = PrometheusStatLogger(config, engine_indexes=[0])
    labels = {"model_name": config.model_config.served_model_name, "engine": "0"}

    def value(name: str, event: str) -> float | None:
        return REGISTRY.get_sample_value(name, {**labels, "event": event})

    data = {"store": {"put_ok": 2, "put_bytes": 3 * MiB, "put_skipped_device": 1, "fallbacks": 5}}
    logger.record(scheduler_stats=SchedulerStats(ec_connector_stats=data), iteration_stats=None, engine_idx=0)
    assert value("vllm:ec_mooncake_store_events_total", "put_ok") == 2
    assert value("vllm:ec_mooncake_store_events_total", "put_skipped_device") == 1
    assert value("vllm:ec_mooncake_store_bytes_total", "put") == 3 * MiB
    assert value("vllm:ec_mooncake_store_events_total", "fallbacks") is None, "a sum of other series is no series"


class _Broken(_Cuda):
    """An output whose bytes cannot be reached (as a CUDA error would)."""

    class device:
        type = "cpu"

    def is_contiguous(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_put_that_fails_to_queue_is_counted_and_raises_nothing(deployment, fake):
    deployment.tier.put("a1b3" * 8, _Broken())
    assert deployment.tier.stats()["put_skipped_error"] == 1 and fake.objects == {}
