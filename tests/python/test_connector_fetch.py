"""A PD instance that gets items from Mooncake Store (``store`` on a
consumer; ecmooncake.connector.fetch), over the in-memory Store
(ecmooncake.store.MemoryStore) shared by this process's tiers: whole
requests through the PD's scheduler-role connector (in this process, where
its fetches run) and two TP worker processes, each hook called in vLLM's
order (vllm_engine.Engine). No encoder runs: what an encoder would have put
is put by a tier of this process.

A PD told that an item comes from the Store (``"source": "store"`` in its
ec_items entry) gets it into its shards as a push would bring it; a miss, a
garbage index or a get past its deadline end the wait at once, and the
engine encodes the item itself (the request carries its media), counted.
"""

from __future__ import annotations

import itertools

import pytest

from conftest import FRESH_PYTHON_S, wait_until
from vllm_engine import CALLS, HIDDEN, Engine, Item, WorkerProc, encoder_output, make_config, make_request, require_vllm, run_until, tiny_model

require_vllm()

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402

from ecmooncake import ec_config, plugin, store  # noqa: E402
from ecmooncake.connector import fetch as cfetch  # noqa: E402
from ecmooncake.connector import tier as ctier  # noqa: E402
from ecmooncake.tools.harness import free_port_range  # noqa: E402

pytestmark = pytest.mark.usefixtures("library")

MiB = 1 << 20
WIDTH = 2 * HIDDEN
# Far beyond every wait of these tests: an item from the Store that will
# not come must not be waited for this long.
PUSH_WAIT_S = 600
STORE = {
    "enabled": True,
    "master_address": "127.0.0.1:50051",
    "metadata_address": "http://127.0.0.1:8080/metadata",
    "local_hostname": "127.0.0.1",
    "put_inflight_bytes": 4 * MiB,
    "get_staging_bytes": 4 * MiB,
    "segment_bytes": 0,
    "get_timeout_s": 1,
    "retry_after_s": 0.1,
}
EXTRA = {"push_wait_timeout_s": PUSH_WAIT_S, "load_timeout_s": 20, "control_timeout_s": 5, "lease_s": 60,
         "log_level": "warn", "store": STORE}
_ids = itertools.count()


class PD:
    def __init__(self, engine: Engine, config, fake: store.MemoryStore):
        self.engine, self.config, self.fake = engine, config, fake

    @property
    def store_stats(self) -> dict:
        return self.engine.connector.native_stats()["scheduler"]["store"]


@pytest.fixture(scope="module")
def pd(library, tmp_path_factory):
    fake = store.MemoryStore()
    saved = ctier.backend_factory
    ctier.backend_factory = lambda: fake
    model = tiny_model(tmp_path_factory.mktemp("model"))
    port = free_port_range(1)
    config = make_config("ec_consumer", model_dir=model, port=port, tp_size=2, buffer_size=32 * MiB, extra=EXTRA)
    workers = [WorkerProc("pd-tp0", config, rank=0), WorkerProc("pd-tp1", config, rank=1)]
    sched = None
    try:
        for w in workers:
            w.result(FRESH_PYTHON_S)
        plugin.register()
        sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
        fetcher = sched._consumer_sched._fetcher
        assert fetcher is not None and fetcher._tier.tier.wait_ready(10)
        yield PD(Engine("pd", sched, workers, encode_only=False, cache_embeds=4000), config, fake)
    finally:
        if sched is not None:
            sched.shutdown()
        for w in workers:
            w.stop()
        ctier.backend_factory = saved


@pytest.fixture
def encoder_tier(pd):
    """A tier of the PD's deployment that puts as an encoder does."""
    t = ctier.make(ec_config.from_vllm_config(pd.config), pd.config)
    t.open()
    assert t.tier.wait_ready(10)
    yield t
    t.close()


def local_encodes() -> float:
    """ecm_local_encodes_total of this process's library (the PD's scheduler)."""
    from ecmooncake.proxy import metrics_text

    for line in metrics_text().splitlines():
        if line.startswith("ecm_local_encodes_total "):
            return float(line.split()[1])
    raise AssertionError("no ecm_local_encodes_total in the library's metrics")


def put_as_encoder(t: ctier._Tier, pd: PD, item: Item) -> None:
    t.put(item.identifier, encoder_output(item.identifier, item.shape))
    wait_until(lambda: t.stats()["index_put_ok"] + t.stats()["put_duplicate"] >= 1 and t.index_key(item.identifier) in pd.fake.objects,
               10, interval=0.01, what="the encoder's put and index")


def from_store(pd: PD, item: Item) -> str:
    """A PD request whose item the proxy says comes from the Store."""
    rid = f"pd-{next(_ids)}"
    params = {"ec_items": [{"mm_hash": item.identifier, "transfer_id": f"st-{rid}", "source": "store"}]}
    pd.engine.add(make_request(rid, [item], params), {item.identifier: item.width})
    return rid


def served(pd: PD, rid: str) -> None:
    run_until([pd.engine], lambda: rid in pd.engine.outcomes, 60, f"request {rid}")
    outcome = pd.engine.outcomes[rid]
    assert outcome.status == "done", outcome
    assert set(outcome.gathered.values()) == {"ok,ok"}, "every TP rank gathers the encoder's bytes"
    run_until([pd.engine], lambda: not pd.engine.has_requests(), 60, "engine idle")


def test_an_item_from_the_store_arrives_in_every_shard_as_a_push_would(pd, encoder_tier):
    item = Item("5a01" * 8, 96, WIDTH)
    put_as_encoder(encoder_tier, pd, item)
    before = dict(pd.store_stats)
    rid = from_store(pd, item)
    served(pd, rid)
    assert item.identifier in pd.engine.loads_log, "loaded from the slab"
    assert item.identifier not in pd.engine.encoded_log, "not encoded by the PD"
    after = pd.store_stats
    assert after["fetch_pushed"] - before["fetch_pushed"] == 1
    assert after["get_hit"] - before["get_hit"] == 2  # the index, then the item


def published(pd: PD, key: str) -> int:
    """The sum of a Store counter over the stats the engine's steps sent
    to vLLM's front end (what its /metrics shows)."""
    return sum(int(((d or {}).get("store") or {}).get(key, 0)) for d in pd.engine.stats_log)


def test_a_fetch_counted_after_its_request_ended_is_still_published(pd, encoder_tier, monkeypatch):
    # vLLM sends a connector's stats with each step, and steps only while
    # it has work. The fetch thread counts a push when it next polls the
    # producer; where that comes after the request's last step, the engine
    # must take one more step for the count, or /metrics misses it until
    # the next request comes (seen in a vllm serve run: fetch_pushed 1 of 2
    # right after the answers). A slow poll makes the late count certain.
    if not (CALLS.hooks["has_pending_push_work"] and CALLS.hooks["get_ec_connector_stats"]):
        pytest.skip("this vLLM neither keeps stepping for a connector's pending work nor takes its stats")
    monkeypatch.setattr(cfetch, "POLL_S", 1.0)
    item = Item("5a0f" * 8, 72, WIDTH)
    put_as_encoder(encoder_tier, pd, item)
    before = dict(pd.store_stats)
    pd.engine.stats_log.clear()
    rid = from_store(pd, item)
    served(pd, rid)  # steps until the engine has nothing left to do
    assert pd.store_stats["fetch_pushed"] - before["fetch_pushed"] == 1
    assert published(pd, "fetch_pushed") == 1, "the count reached vLLM's front end"
    assert not pd.engine.has_requests(), "and the engine goes idle after"


def test_an_image_twice_in_a_request_is_fetched_once(pd, encoder_tier):
    item = Item("5a06" * 8, 80, WIDTH)
    put_as_encoder(encoder_tier, pd, item)
    before = dict(pd.store_stats)
    rid = f"pd-{next(_ids)}"
    entry = {"mm_hash": item.identifier, "transfer_id": f"st-{rid}", "source": "store"}
    pd.engine.add(make_request(rid, [item, item], {"ec_items": [entry, entry]}), {item.identifier: item.width})
    served(pd, rid)
    assert item.identifier not in pd.engine.encoded_log
    after = pd.store_stats
    assert after["fetch_pushed"] - before["fetch_pushed"] == 1
    assert after["get_hit"] - before["get_hit"] == 2, "one index and one item got, not two of each"
    assert after["fetch_push_failed"] == before["fetch_push_failed"]


def test_a_miss_ends_the_wait_at_once_and_the_engine_encodes_the_item(pd):
    item = Item("5a02" * 8, 64, WIDTH)
    before, encodes = dict(pd.store_stats), local_encodes()
    rid = from_store(pd, item)
    served(pd, rid)  # within 60 s: never push_wait_timeout_s (600 s)
    assert local_encodes() == encodes + 1
    assert item.identifier in pd.engine.encoded_log, "encoded locally from the request's media"
    assert item.identifier not in pd.engine.loads_log
    after = pd.store_stats
    assert after["get_miss"] - before["get_miss"] == 1
    assert after["fetch_get_failed"] - before["fetch_get_failed"] == 1


@pytest.mark.parametrize("garbage", [b"\xff" * 40, b'{"v":1,"dtype":"bfloat16","shape":[64,128],"nbytes":1}',
                                     b'{"v":1,"dtype":"bfloat16","shape":[4096,4096],"nbytes":33554432}'])
def test_a_garbage_index_is_refused_counted_and_the_engine_encodes_the_item(pd, encoder_tier, garbage):
    item = Item(f"5a03{len(garbage):04x}" * 4, 64, WIDTH)
    pd.fake.objects[encoder_tier.index_key(item.identifier)] = garbage
    before = dict(pd.store_stats)
    rid = from_store(pd, item)
    served(pd, rid)
    assert item.identifier in pd.engine.encoded_log
    assert pd.store_stats["get_index_invalid"] - before["get_index_invalid"] == 1


def test_a_store_that_does_not_answer_ends_the_wait_at_its_deadline(pd, encoder_tier):
    item = Item("5a04" * 8, 64, WIDTH)
    put_as_encoder(encoder_tier, pd, item)
    before = dict(pd.store_stats)
    pd.fake.gate = __import__("threading").Event()  # a master that does not answer
    try:
        rid = from_store(pd, item)
        served(pd, rid)
    finally:
        pd.fake.gate.set()
        pd.fake.gate = None
    assert item.identifier in pd.engine.encoded_log
    assert pd.store_stats["get_timeout"] - before["get_timeout"] == 1


def test_the_fetcher_refuses_more_than_its_queue_holds(pd):
    f = cfetch._StoreFetcher(ec_config.from_vllm_config(pd.config), pd.config)
    f._thread = object()  # started, as far as fetch() can tell, with no thread taking jobs
    assert all(f.fetch(f"q-{i}", "5a05" * 8, 0.0) for i in range(cfetch.MAX_QUEUED))
    assert not f.fetch("q-over", "5a05" * 8, 0.0)
    assert f.stats()["fetch_queue_full"] == 1
