"""The behaviours vLLM's own tests assert for its example connector
(tests/v1/ec_connector/unit/test_ec_example_connector.py), re-expressed for
ECMooncakeConnector, plus the contract of each hook: never raise, never
block, small picklable metadata.

Both roles run in this process here, as with vLLM's single-process executor.
"""

from __future__ import annotations

import json
import logging
import pickle
import subprocess
import sys
from dataclasses import dataclass

import pytest

from conftest import FRESH_PYTHON_S, subprocess_env, wait_until, without_hanging
from vllm_engine import HIDDEN, Item, make_config, make_request, require_vllm, tiny_model

require_vllm()

import torch  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ECConnectorOutput, ModelRunnerOutput  # noqa: E402

from ecmooncake import connector as ecm_connector  # noqa: E402
from ecmooncake import plugin  # noqa: E402
from ecmooncake.connector import LoadSpec  # noqa: E402
from ecmooncake.connector.calls import read_calls  # noqa: E402
from ecmooncake.tools.harness import free_port_range  # noqa: E402

pytestmark = pytest.mark.usefixtures("library")

# These tests run on every vLLM the connector supports (0.26 to 0.33); the
# ones about a feature an older vLLM lacks skip there, saying which.
CALLS = read_calls()
try:
    from vllm.distributed.ec_transfer.ec_connector.utils import ECOutputAggregator  # noqa: E402
except ImportError:
    ECOutputAggregator = None  # vLLM < 0.30: no worker metadata to merge
try:
    from vllm.distributed.ec_transfer.ec_connector import metrics as _ec_metrics  # noqa: F401, E402
except ImportError:
    _ec_metrics = None
needs_outcomes = pytest.mark.skipif(
    not (CALLS.outcomes and CALLS.hooks["take_unavailable_requests"]),
    reason="this vLLM neither reports worker outcomes nor fails requests (see test_without_take_unavailable_requests_the_engine_encodes_what_never_came)",
)
try:
    from vllm.distributed.ec_transfer.ec_connector import encoder_output_width as _widths  # noqa: F401, E402

    WIDTHS_KNOWN = True
except ImportError:
    WIDTHS_KNOWN = False  # vLLM 0.26: a push reserves once its output exists
needs_report = pytest.mark.skipif(
    not CALLS.outcomes, reason="this vLLM collects no worker report (vLLM < 0.30): failures are logged and counted, not reported"
)
needs_ec_metrics = pytest.mark.skipif(_ec_metrics is None, reason="this vLLM has no EC connector statistics (vLLM < 0.31)")

MiB = 1 << 20
WIDTH = 2 * HIDDEN
EXTRA = {"push_wait_timeout_s": 10, "control_timeout_s": 5, "log_level": "warn"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


def create(config, role):
    plugin.register()
    return ECConnectorFactory.create_connector(config, role)


@dataclass
class Instance:
    """Both instances of a deployment, in one process."""

    port: int
    consumer_sched: object
    consumer_worker: object
    producer_sched: object
    producer_worker: object

    def close(self):
        for c in (self.producer_worker, self.consumer_worker, self.producer_sched, self.consumer_sched):
            c.shutdown()

    def push(self, items: list[Item], consumer_ids: list[str]) -> dict:
        """Runs one encoder request through the producer's hooks."""
        req = make_request(f"enc-{consumer_ids[0]}", items, {"consumer": f"127.0.0.1:{self.port}", "ec_items": [{"transfer_id": t} for t in consumer_ids]})
        s, w = self.producer_sched, self.producer_worker
        assert s.ensure_cache_available(req, 0)
        for i in range(len(items)):
            assert not s.has_cache_item(items[i].identifier)
            s.update_state_after_alloc(req, i)
        meta = pickle.loads(pickle.dumps(s.build_connector_meta(SchedulerOutput.make_empty())))
        cache: dict = {}
        w.bind_connector_metadata(meta)
        if CALLS.hooks["start_save_caches"]:
            w.start_save_caches(encoder_cache=cache)
        for it in items:
            cache[it.identifier] = tensor_for(it)
            w.save_caches(encoder_cache=cache, mm_hash=it.identifier)
        w.get_finished(set())
        report_to(s, worker_report(w))
        w.clear_connector_metadata()
        delay_free, params = s.request_finished(req)
        assert delay_free is False
        return params

    def expect(self, request_id: str, items: list[Item], transfer_ids: list[str]):
        req = make_request(request_id, items, {"ec_items": [{"mm_hash": it.identifier, "transfer_id": t} for it, t in zip(items, transfer_ids)]})
        self.consumer_sched.ensure_cache_available(req, 0)
        return req

    def wait_available(self, req, timeout=20):
        wait_until(lambda: self.consumer_sched.ensure_cache_available(req, 0), timeout, interval=0.01, what="items available")


def worker_report(w):
    """The worker's end-of-step report, where this vLLM asks for one."""
    return w.build_connector_worker_meta() if CALLS.outcomes else None


def report_to(s, report) -> None:
    """Hands a report to the scheduler, where this vLLM does."""
    if CALLS.outcomes:
        s.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))


def tensor_for(item: Item) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int(item.identifier[:15], 16))
    return torch.randn(item.shape, generator=gen).to(torch.bfloat16)


@pytest.fixture
def instance(model_dir):
    port = free_port_range(1)
    consumer = make_config("ec_consumer", model_dir=model_dir, port=port, buffer_size=64 * MiB, extra=EXTRA)
    producer = make_config("ec_producer", model_dir=model_dir, port=port, extra=EXTRA, widths={"image": WIDTH})
    made = []
    try:
        for config, role in ((consumer, ECConnectorRole.SCHEDULER), (consumer, ECConnectorRole.WORKER), (producer, ECConnectorRole.SCHEDULER), (producer, ECConnectorRole.WORKER)):
            made.append(create(config, role))
        if CALLS.hooks["start_worker_services"]:
            made[1].start_worker_services()
            made[3].start_worker_services()
        inst = Instance(port, *made)
        yield inst
    finally:
        for c in made:
            c.shutdown()


def step_load(inst: Instance, scheduler_output=None):
    meta = pickle.loads(pickle.dumps(inst.consumer_sched.build_connector_meta(scheduler_output or SchedulerOutput.make_empty())))
    cache: dict = {}
    w = inst.consumer_worker
    w.bind_connector_metadata(meta)
    w.start_load_caches(cache)
    w.get_finished(set())
    report = worker_report(w)
    w.clear_connector_metadata()
    report_to(inst.consumer_sched, report)
    return meta, cache, report


def test_roles_after_init(model_dir):
    port = free_port_range(1)
    producer = make_config("ec_producer", model_dir=model_dir, port=port, extra=EXTRA, widths={"image": WIDTH})
    both = make_config("ec_both", model_dir=model_dir, port=port, extra=EXTRA, widths={"image": WIDTH})
    plugin.register()
    cls = ECConnectorFactory.get_connector_class(producer.ec_transfer_config)
    assert cls is ecm_connector.ECMooncakeConnector
    assert issubclass(cls, ECConnectorBase) and not cls.__abstractmethods__
    for config, role, is_producer, is_consumer in (
        (producer, ECConnectorRole.SCHEDULER, True, False),
        (producer, ECConnectorRole.WORKER, True, False),
        (both, ECConnectorRole.WORKER, True, True),
    ):
        c = create(config, role)
        try:
            assert (c.role, c.is_producer, c.is_consumer) == (role, is_producer, is_consumer)
        finally:
            c.shutdown()
            c.shutdown()  # idempotent


def test_every_hook_of_the_base_class_is_implemented():
    inherited = {"update_state_after_free", "register_caches", "clear_connector_metadata", "_get_connector_metadata"}
    hooks = {name for name in dir(ECConnectorBase) if callable(getattr(ECConnectorBase, name)) and not name.startswith("__")}
    cls = ecm_connector.ECMooncakeConnector
    missing = sorted(name for name in hooks - inherited if getattr(cls, name) is getattr(ECConnectorBase, name))
    assert missing == []
    # Each optional hook as this vLLM's source calls it (0.33: all of them).
    assert cls._hooks == {name: CALLS.hooks[name] for name in cls._hooks}


def test_has_cache_item_for_pushed_items_only(instance):
    items = [Item(f"has/{i}", 100 + 50 * i, WIDTH) for i in range(3)]
    assert not any(instance.consumer_sched.has_cache_item(it.identifier) for it in items), "nothing pushed yet"
    req = instance.expect("pd-has", items, ["h0", "h1", "h2"])
    instance.push(items[:1], ["h0"])
    wait_until(lambda: instance.consumer_sched.has_cache_item(items[0].identifier), 20, interval=0.01, what="first item")
    assert [instance.consumer_sched.has_cache_item(it.identifier) for it in items] == [True, False, False]
    assert instance.consumer_sched.ensure_cache_available(req, 0) is False, "1 of 3 is not enough"
    # Items that lie before the computed tokens are not waited for.
    after_first = req.mm_features[1].mm_position.offset
    assert instance.consumer_sched.ensure_cache_available(req, after_first) is False
    assert instance.consumer_sched.ensure_cache_available(req, req.num_tokens) is True


class _CountingSteps:
    """Counts the native scheduler's steps, passing each through."""

    def __init__(self, native):
        self.native, self.steps, self.lookups, self.polls = native, 0, 0, 0

    def poll(self):
        self.polls += 1
        return self.native.poll()

    def step(self, body):
        self.steps += 1
        return self.native.step(body)

    def has(self, mm_hash):
        self.lookups += 1
        return self.native.has(mm_hash)

    def __getattr__(self, name):
        return getattr(self.native, name)


def counting(instance) -> _CountingSteps:
    inner = instance.consumer_sched._consumer_sched
    inner._native = _CountingSteps(inner._native)
    return inner._native


def test_hooks_ask_the_library_only_when_something_changed(instance):
    items = [Item(f"gen/{i}", 64 + i, WIDTH) for i in range(3)]
    reqs = [instance.expect(f"pd-gen{i}", [it], [f"gen{i}"]) for i, it in enumerate(items)]
    native = counting(instance)
    s = instance.consumer_sched
    for _ in range(50):
        assert [s.ensure_cache_available(r, 0) for r in reqs] == [False] * 3
        assert [s.has_cache_item(it.identifier) for it in items] == [False] * 3
    assert native.steps <= 1, "at most one batched call, for what changed before the first pass"
    assert native.lookups == 0, "ensure's answer covered has_cache_item"
    instance.push(items[:1], ["gen0"])
    wait_until(lambda: s.ensure_cache_available(reqs[0], 0), 20, interval=0.01, what="first item")
    native.steps = native.lookups = 0
    for _ in range(50):
        assert [s.ensure_cache_available(r, 0) for r in reqs] == [True, False, False]
        assert [s.has_cache_item(it.identifier) for it in items] == [True, False, False]
    assert (native.steps, native.lookups) == (0, 0), "nothing changed: every answer from memory"


def test_each_scheduling_pass_reads_arrived_events_once(instance):
    # The engine's loop steps without pause while a request waits: the
    # first hook of each pass takes the events already in the shards'
    # sockets itself (no reader thread's wake between an event and the
    # answer), and the rest of the pass answers from memory.
    items = [Item(f"poll/{i}", 48 + i, WIDTH) for i in range(3)]
    reqs = [instance.expect(f"pd-poll{i}", [it], [f"poll{i}"]) for i, it in enumerate(items)]
    native = counting(instance)
    s = instance.consumer_sched
    s.build_connector_meta(SchedulerOutput.make_empty())  # a pass of its own
    for _ in range(20):
        assert [s.ensure_cache_available(r, 0) for r in reqs] == [False] * 3
        assert [s.has_cache_item(it.identifier) for it in items] == [False] * 3
    assert native.polls == 1, "one read of the sockets in a pass"
    s.build_connector_meta(SchedulerOutput.make_empty())
    assert s.has_cache_item(items[0].identifier) is False
    assert s.ensure_cache_available(reqs[0], 0) is False
    assert native.polls == 2, "and one in the next pass"


def test_one_call_refreshes_every_waiting_request(instance):
    items = [Item(f"batch/{i}", 32 + i, WIDTH) for i in range(20)]
    reqs = [instance.expect(f"pd-batch{i}", [it], [f"batch{i}"]) for i, it in enumerate(items)]
    s = instance.consumer_sched
    assert not any(s.ensure_cache_available(r, 0) for r in reqs)
    native = counting(instance)
    # Registering one more request keeps every other answer current.
    instance.expect("pd-batch-new", [Item("batch/new", 16, WIDTH)], ["batch-new"])
    assert native.steps == 1
    assert not any(s.ensure_cache_available(r, 0) for r in reqs)
    assert native.steps == 1
    # Arrivals move the generation: the first stale answer refreshes all.
    instance.push(items[:2], ["batch0", "batch1"])
    wait_until(lambda: s.has_cache_item(items[0].identifier) and s.has_cache_item(items[1].identifier), 20, interval=0.01, what="two items")
    native.steps = 0
    assert [s.ensure_cache_available(r, 0) for r in reqs] == [True, True] + [False] * 18
    assert native.steps == 1


def test_update_state_after_alloc_records_loads_and_build_clears(instance):
    items = [Item(f"alloc/{n}", n, WIDTH) for n in (100, 150, 200)]
    local = Item("alloc/local", 64, WIDTH)
    tids = ["a100", "a150", "a200"]
    req = instance.expect("pd-alloc", items + [local], tids + ["never"])
    instance.push(items, tids)
    s = instance.consumer_sched
    wait_until(lambda: all(s.has_cache_item(it.identifier) for it in items), 20, interval=0.01, what="items available")
    for i, it in enumerate(items + [local]):
        if s.has_cache_item(it.identifier):
            s.update_state_after_alloc(req, i)
    # The local item goes to the encoder (has_cache_item said no) and
    # update_state_after_alloc must not turn it into a load.
    s.update_state_after_alloc(req, 3)
    so = SchedulerOutput.make_empty()
    so.free_encoder_mm_hashes = ["some-other-hash"]
    before = pickle.dumps(so)
    meta = s.build_connector_meta(so)
    assert pickle.dumps(so) == before, "build_connector_meta must not modify the scheduler output"
    assert [(spec.mm_hash, spec.num_embeds, spec.transfer_id) for spec in meta.loads] == [
        (it.identifier, it.num_embeds, t) for it, t in zip(items, tids)
    ]
    assert all(not spec.error for spec in meta.loads)
    again = s.build_connector_meta(SchedulerOutput.make_empty())
    assert again.loads == [] and again.pushes == []


def test_loads_are_zero_copy_views_that_equal_the_source(instance):
    items = [Item("view/a", 300, WIDTH), Item("view/b", 77, WIDTH)]
    req = instance.expect("pd-view", items, ["va", "vb"])
    params = instance.push(items, ["va", "vb"])
    if WIDTHS_KNOWN:
        assert params[items[0].identifier]["shape"] == [300, WIDTH]
    instance.wait_available(req)
    for i, it in enumerate(items):
        assert instance.consumer_sched.has_cache_item(it.identifier)
        instance.consumer_sched.update_state_after_alloc(req, i)
    meta, cache, report = step_load(instance)
    if CALLS.outcomes:
        assert report.loaded == {"va", "vb"} and report.failed_loads == {}
    slab = instance.consumer_worker._consumer_worker._slab
    for it in items:
        got = cache[it.identifier]
        assert got.dtype == torch.bfloat16 and tuple(got.shape) == it.shape
        assert torch.equal(got.view(torch.int16), tensor_for(it).view(torch.int16))
        assert got.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr(), "a view of the slab, not a copy"


def test_start_load_caches_skips_items_already_present(instance):
    item = Item("present/a", 128, WIDTH)
    req = instance.expect("pd-present", [item], ["pa"])
    instance.push([item], ["pa"])
    instance.wait_available(req)
    assert instance.consumer_sched.has_cache_item(item.identifier)
    instance.consumer_sched.update_state_after_alloc(req, 0)
    meta = instance.consumer_sched.build_connector_meta(SchedulerOutput.make_empty())
    mine = torch.ones(4, 4)
    cache = {item.identifier: mine}
    w = instance.consumer_worker
    w.bind_connector_metadata(meta)
    w.start_load_caches(cache)
    report = worker_report(w)
    w.clear_connector_metadata()
    assert cache[item.identifier] is mine
    if CALLS.outcomes:
        assert report.loaded == {"pa"}
    assert instance.consumer_worker.native_stats()["consumer"]["table"]["Pinned"] == 0, "nothing was acquired"
    # Empty metadata is a no-op.
    w.bind_connector_metadata(ecm_connector.ECMooncakeConnectorMetadata())
    w.start_load_caches(cache)
    w.clear_connector_metadata()
    assert list(cache) == [item.identifier]


def test_freed_items_are_released_and_stay_resident(instance):
    item = Item("freed/a", 256, WIDTH)
    req = instance.expect("pd-freed", [item], ["fa"])
    instance.push([item], ["fa"])
    instance.wait_available(req)
    instance.consumer_sched.has_cache_item(item.identifier)
    instance.consumer_sched.update_state_after_alloc(req, 0)
    _, cache, _ = step_load(instance)
    assert instance.consumer_worker.native_stats()["consumer"]["table"]["Pinned"] == 1
    instance.consumer_sched.request_finished(req)
    so = SchedulerOutput.make_empty()
    so.free_encoder_mm_hashes = [item.identifier]
    meta = instance.consumer_sched.build_connector_meta(so)
    cache.pop(item.identifier)  # vLLM's runner drops freed entries first
    w = instance.consumer_worker
    w.bind_connector_metadata(meta)
    w.start_load_caches(cache)
    w.clear_connector_metadata()
    table = instance.consumer_worker.native_stats()["consumer"]["table"]
    assert (table["Pinned"], table["Residents"]) == (0, 1)
    assert instance.consumer_sched.has_cache_item(item.identifier), "a resident copy can be loaded again"


def test_consumer_save_caches_does_nothing(instance):
    item = Item("save/consumer", 10, WIDTH)
    w = instance.consumer_worker
    w.bind_connector_metadata(ecm_connector.ECMooncakeConnectorMetadata())
    w.save_caches(encoder_cache={item.identifier: tensor_for(item)}, mm_hash=item.identifier)
    w.clear_connector_metadata()
    assert "producer" not in w.native_stats()


def test_bind_and_clear_connector_metadata(instance):
    w = instance.producer_worker
    with pytest.raises(AssertionError):
        w._get_connector_metadata()
    meta = ecm_connector.ECMooncakeConnectorMetadata()
    w.bind_connector_metadata(meta)
    assert w._get_connector_metadata() is meta
    w.clear_connector_metadata()
    with pytest.raises(AssertionError):
        w._get_connector_metadata()


@needs_report
def test_saving_an_empty_tensor_does_not_raise(instance):
    item = Item("empty/a", 8, WIDTH)
    req = make_request("enc-empty", [item], {"consumer": f"127.0.0.1:{instance.port}", "ec_items": [{"transfer_id": "e0"}]})
    s, w = instance.producer_sched, instance.producer_worker
    s.update_state_after_alloc(req, 0)
    w.bind_connector_metadata(s.build_connector_meta(SchedulerOutput.make_empty()))
    w.start_save_caches(encoder_cache={})
    w.save_caches(encoder_cache={item.identifier: torch.empty(0, WIDTH, dtype=torch.bfloat16)}, mm_hash=item.identifier)
    w.get_finished(set())
    report = w.build_connector_worker_meta()
    w.clear_connector_metadata()
    assert "e0" in report.pushes_failed, "a size that does not match the announcement fails the push"


@needs_report
def test_loading_a_missing_item_does_not_raise(instance):
    item = Item("missing/a", 32, WIDTH)
    meta = ecm_connector.ECMooncakeConnectorMetadata(loads=[LoadSpec(item.identifier, "m0", item.num_embeds, "image")])
    cache: dict = {}
    w = instance.consumer_worker
    w.bind_connector_metadata(meta)
    w.start_load_caches(cache)
    report = w.build_connector_worker_meta()
    w.clear_connector_metadata()
    assert "m0" in report.failed_loads and report.loaded == set()
    stand_in = cache[item.identifier]
    assert tuple(stand_in.shape) == (item.num_embeds, HIDDEN), "the gather finds an entry of the model's width"
    assert not stand_in.any()


@needs_outcomes
def test_a_failed_load_fails_its_request(instance):
    item = Item("failed-load/a", 32, WIDTH)
    req = instance.expect("pd-failed-load", [item], ["f0"])
    instance.push([item], ["f0"])
    instance.wait_available(req)
    s = instance.consumer_sched
    assert s.has_cache_item(item.identifier)
    s.update_state_after_alloc(req, 0)
    (spec,) = s.build_connector_meta(SchedulerOutput.make_empty()).loads
    assert spec.transfer_id == "f0"
    # What a TP rank whose shard lost the item reports.
    report = ecm_connector.ECMooncakeWorkerMetadata(failed_loads={"f0": "acquire: not ready"})
    s.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))
    assert s.take_unavailable_requests() == {req.request_id}
    assert s.take_unavailable_requests() == set()


def test_request_finished_keeps_repeated_positions(instance):
    a, b = Item("repeat/a", 16, WIDTH), Item("repeat/b", 24, WIDTH)
    req = make_request("enc-repeat", [a, b, a], {"consumer": f"127.0.0.1:{instance.port}", "ec_items": [{"transfer_id": t} for t in ("r0", "r1", "r2")]})
    s = instance.producer_sched
    s.ensure_cache_available(req, 0)
    delay_free, params = s.request_finished(req)
    assert delay_free is False
    assert params[a.identifier]["item_indices"] == [0, 2]
    assert params[b.identifier]["item_indices"] == [1]
    assert params[b.identifier]["transfer_id"] == "r1"
    if WIDTHS_KNOWN:
        assert params[b.identifier]["shape"] == [24, WIDTH]
    assert instance.consumer_sched.request_finished(make_request("pd-x", [a], None)) == (False, None)


@pytest.mark.skipif(ECOutputAggregator is None, reason="vLLM < 0.30 has no collect_ec_item_metadata to leave modality out")
def test_request_finished_names_the_modality_when_vllm_does_not(instance, monkeypatch):
    # vLLM 0.32's helper builds {"item_indices": [...], "metadata": {...}}
    # without "modality"; the proxy needs it to pick the embeds part.
    from vllm.distributed.ec_transfer.ec_connector import utils

    real = utils.collect_ec_item_metadata

    def like_0_32(features, resolver):
        items = real(features, resolver)
        for entry in items.values():
            entry.pop("modality", None)
        return items

    monkeypatch.setattr(utils, "collect_ec_item_metadata", like_0_32)
    a = Item("modality/a", 16, WIDTH)
    req = make_request("enc-modality", [a], {"consumer": f"127.0.0.1:{instance.port}", "ec_items": [{"transfer_id": "m0"}]})
    s = instance.producer_sched
    s.ensure_cache_available(req, 0)
    _, params = s.request_finished(req)
    assert params[a.identifier]["modality"] == "image"
    assert params[a.identifier]["item_indices"] == [0]


@pytest.mark.skipif(ECOutputAggregator is None, reason="vLLM < 0.30 has no worker metadata")
def test_worker_metadata_merges_across_tp_ranks():
    report = ecm_connector.ECMooncakeWorkerMetadata
    ranks = [
        report(loaded={"t1", "t2"}, failed_loads={}, pushes_done=set(), pushes_failed={}, pending_pushes=False),
        report(loaded={"t1"}, failed_loads={"t2": "shard 1 lost it"}, pushes_done=set(), pushes_failed={}, pending_pushes=True),
    ]
    outputs = [ModelRunnerOutput.with_ec_conn_output(EMPTY_MODEL_RUNNER_OUTPUT, ECConnectorOutput(ec_connector_worker_meta=r)) for r in ranks]
    merged = ECOutputAggregator().aggregate(outputs, output_rank=0).ec_connector_output.ec_connector_worker_meta
    assert merged.loaded == {"t1"}
    assert merged.failed_loads == {"t2": "shard 1 lost it"}
    assert merged.pending_pushes is True


def test_metadata_is_small_and_loads_in_a_fresh_process():
    meta = ecm_connector.ECMooncakeConnectorMetadata(
        loads=[LoadSpec(f"{i:064x}", f"transfer-{i:027d}", 1296, "image") for i in range(64)],
    )
    blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    assert len(blob) < 16 << 10
    probe = "import pickle, sys; m = pickle.loads(sys.stdin.buffer.read()); print(type(m).__mro__[1].__name__, len(m.loads))"
    done = subprocess.run([sys.executable, "-c", probe], input=blob, capture_output=True, timeout=FRESH_PYTHON_S, env=subprocess_env())
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    # The last line: importing vLLM may print its own lines first.
    assert done.stdout.decode().strip().splitlines()[-1].split() == ["_StepMetadata", "64"]


def test_scheduler_hooks_do_not_block_on_unreachable_peers(model_dir):
    # Nobody listens at this port: the scheduler's background loop keeps
    # retrying, and no hook may wait for it. The control timeout is an hour,
    # so a hook that waited on the network even once would run far past the
    # hang bound; the bound says nothing about how fast the hooks are.
    port = free_port_range(1)
    config = make_config("ec_consumer", model_dir=model_dir, port=port, extra={"control_timeout_s": 3600.0, "log_level": "error"})
    s = create(config, ECConnectorRole.SCHEDULER)
    try:
        items = [Item(f"unreachable/{i}", 64, WIDTH) for i in range(4)]
        requests = [make_request(f"pd-u{i}", items, {"ec_items": [{"transfer_id": f"u{i}-{j}"} for j in range(4)]}) for i in range(50)]

        def rounds():
            answers = set()
            for n in range(1000):
                answers.add(s.has_cache_item(items[n % 4].identifier))
                answers.add(s.ensure_cache_available(requests[n % 50], 0))
                if n % 10 == 0:
                    s.build_connector_meta(SchedulerOutput.make_empty())
            return answers

        assert without_hanging(rounds, what="1000 rounds of scheduler hooks") == {False}
    finally:
        s.shutdown()


def test_hooks_never_raise_into_the_engine(instance):
    item = Item("closed/a", 16, WIDTH)
    req = instance.expect("pd-closed", [item], ["c0"])
    instance.close()  # every native object is gone: each call below fails inside
    s, w = instance.consumer_sched, instance.consumer_worker
    assert s.has_cache_item(item.identifier) is False
    assert s.ensure_cache_available(make_request("pd-closed-2", [item], {"ec_items": [{"transfer_id": "c1"}]}), 0) is False
    s.update_state_after_alloc(req, 0)
    assert isinstance(s.build_connector_meta(SchedulerOutput.make_empty()), ecm_connector.ECMooncakeConnectorMetadata)
    assert s.request_finished(req) == (False, None)
    cache: dict = {}
    w.bind_connector_metadata(ecm_connector.ECMooncakeConnectorMetadata(loads=[LoadSpec(item.identifier, "c0", 16, "image")]))
    w.start_load_caches(cache)
    assert w.get_finished({"pd-closed"}) == (None, None)
    if CALLS.outcomes:
        assert w.build_connector_worker_meta().failed_loads.keys() == {"c0"}
    w.clear_connector_metadata()
    assert item.identifier in cache, "a stand-in keeps vLLM's gather from failing"


# --- the startup line ----------------------------------------------------------


def startup_lines(caplog, config, role) -> list[logging.LogRecord]:
    plugin.register()  # its own line, once per process
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.ecmooncake"):
        c = create(config, role)
    c.shutdown()
    # The connector's own line, not the lines of what it starts (a shard
    # that listens at once on a vLLM without start_worker_services).
    return [r for r in caplog.records if r.name == "vllm.ecmooncake" and "connector (" in r.getMessage()]


def test_startup_is_one_line_naming_role_transport_slab_version_and_hooks(model_dir, caplog):
    import vllm

    port = free_port_range(1)
    consumer = make_config("ec_consumer", model_dir=model_dir, port=port, tp_size=2, buffer_size=64 * MiB, extra=EXTRA)
    producer = make_config("ec_producer", model_dir=model_dir, port=port, extra={**EXTRA, "transport": "shm"}, widths={"image": WIDTH})
    (worker,) = startup_lines(caplog, consumer, ECConnectorRole.WORKER)
    # A warning where this vLLM lacks a hook (0.26 lacks most).
    all_called = all(CALLS.hooks[name] for name in ecm_connector.OPTIONAL_HOOKS)
    assert worker.levelno == (logging.INFO if all_called else logging.WARNING)
    line = worker.getMessage()
    for part in ("WORKER", "consumer", f"127.0.0.1:{port}", "tp_rank 0 of 2", "transport tcp", "slab 64 MiB on cpu", f"vLLM {vllm.__version__}"):
        assert part in line, (part, line)
    for hook in ecm_connector.OPTIONAL_HOOKS:
        assert hook in line, (hook, line)
    (sched,) = startup_lines(caplog, consumer, ECConnectorRole.SCHEDULER)
    assert "SCHEDULER" in sched.getMessage() and f"tcp://127.0.0.1:{port}" in sched.getMessage()
    (encoder,) = startup_lines(caplog, producer, ECConnectorRole.WORKER)
    line = encoder.getMessage()
    assert "producer" in line and "this host shm" in line and "other hosts refused" in line, line


def test_startup_line_names_each_missing_hook_and_its_cost(model_dir, caplog, monkeypatch):
    cls = ecm_connector.ECMooncakeConnector
    monkeypatch.setattr(cls, "_hooks", {**cls._hooks, "has_pending_push_work": False, "get_ec_connector_stats": False})
    config = make_config("ec_producer", model_dir=model_dir, port=free_port_range(1), extra=EXTRA, widths={"image": WIDTH})
    (line,) = startup_lines(caplog, config, ECConnectorRole.SCHEDULER)
    assert line.levelno == logging.WARNING
    text = line.getMessage()
    assert "lacks" in text
    for hook in ("has_pending_push_work", "get_ec_connector_stats"):
        assert f"{hook} ({ecm_connector.OPTIONAL_HOOKS[hook]})" in text, text


# --- statistics for vLLM's /metrics ---------------------------------------------


@needs_ec_metrics
def test_stats_merge_tp_ranks_and_reduce_to_a_log_line():
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats

    stats = ecm_connector.ECMooncakeConnectorStats
    assert issubclass(stats, ECConnectorStats)
    assert stats().is_empty() and stats(data={}).is_empty()
    # Both TP ranks load t1 and t2; rank 1 fails t2, so only t1 counts.
    rank0 = stats(data={"load_bytes": {"t1": 3 * MiB, "t2": MiB}})
    rank1 = stats(data={"load_bytes": {"t1": 3 * MiB}, "load_failures": ["t2"]})
    sched = stats(data={"wait_seconds": [0.010, 0.030], "failed_requests": 1})
    merged = pickle.loads(pickle.dumps(rank0.aggregate(rank1))).aggregate(sched)
    assert not merged.is_empty()
    out = merged.reduce()
    assert out["Num loads"] == 1 and out["Load MiB"] == 3 and out["Num failed loads"] == 1
    assert out["Avg wait (ms)"] == 20 and out["Num failed requests"] == 1
    assert "Num pushes" not in out, "groups without activity stay out of the log line"
    pushes = stats(data={"push_seconds": [0.002, 0.004], "push_bytes": [MiB, MiB], "push_failures": 1}).reduce()
    assert pushes["Num pushes"] == 2 and pushes["Push MiB"] == 2 and pushes["Num failed pushes"] == 1
    assert pushes["Avg push time (ms)"] == 3
    merged.reset()
    assert merged.is_empty()


def test_each_part_hands_its_step_to_get_ec_connector_stats(instance):
    items = [Item("stats/a", 300, WIDTH), Item("stats/b", 77, WIDTH)]
    req = instance.expect("pd-stats", items, ["sa", "sb"])
    instance.push(items, ["sa", "sb"])
    w = instance.producer_worker
    total = ecm_connector.ECMooncakeConnectorStats()

    def pushed():
        w.get_finished(set())
        got = w.get_ec_connector_stats()
        if got is not None:
            total.aggregate(got)
        return len(total.data["push_bytes"]) == 2

    wait_until(pushed, 20, interval=0.01, what="both pushes done")
    data = total.data
    assert sorted(data["push_bytes"]) == sorted(it.nbytes for it in items)
    assert len(data["push_seconds"]) == 2 and all(s >= 0 for s in data["push_seconds"])
    assert w.get_ec_connector_stats() is None, "a step's stats are handed over once"
    instance.wait_available(req)
    s = instance.consumer_sched
    for i, it in enumerate(items):
        assert s.has_cache_item(it.identifier)
        s.update_state_after_alloc(req, i)
    step_load(instance)
    loads = instance.consumer_worker.get_ec_connector_stats().data
    assert loads["load_bytes"] == {"sa": items[0].nbytes, "sb": items[1].nbytes} and loads["load_failures"] == []
    waits = s.get_ec_connector_stats().data
    assert len(waits["wait_seconds"]) == 2 and all(x >= 0 for x in waits["wait_seconds"])
    assert s.get_ec_connector_stats() is None


@needs_ec_metrics
def test_stats_on_vllms_prometheus_logger(model_dir):
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    config = make_config("ec_consumer", model_dir=model_dir, port=free_port_range(1), extra=EXTRA)
    plugin.register()
    logger = PrometheusStatLogger(config, engine_indexes=[0])
    labels = {"model_name": config.model_config.served_model_name, "engine": "0"}

    def value(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    assert value("vllm:ec_mooncake_load_bytes_count") == 0, "series exist before the first transfer"
    steps = [
        {"load_bytes": {"t1": 4 * MiB, "t2": MiB}, "load_failures": ["t2"], "wait_seconds": [0.05]},
        {"push_seconds": [0.2], "push_bytes": [2 * MiB], "push_failures": 1, "failed_requests": 2},
    ]
    for data in steps:
        logger.record(scheduler_stats=SchedulerStats(ec_connector_stats=data), iteration_stats=None, engine_idx=0)
    assert value("vllm:ec_mooncake_load_bytes_count") == 1
    assert value("vllm:ec_mooncake_load_bytes_sum") == 4 * MiB
    assert value("vllm:ec_mooncake_num_failed_loads_total") == 1
    assert value("vllm:ec_mooncake_wait_time_seconds_count") == 1
    assert value("vllm:ec_mooncake_wait_time_seconds_sum") == pytest.approx(0.05)
    assert value("vllm:ec_mooncake_push_time_seconds_count") == 1
    assert value("vllm:ec_mooncake_push_bytes_sum") == 2 * MiB
    assert value("vllm:ec_mooncake_num_failed_pushes_total") == 1
    assert value("vllm:ec_mooncake_num_failed_requests_total") == 2


OLDER_VLLM = r"""
import json, pickle, sys
# vLLM 0.32: no ec_connector/metrics.py, no stats hooks on the base class.
sys.modules["vllm.distributed.ec_transfer.ec_connector.metrics"] = None
from vllm.distributed.ec_transfer.ec_connector import base
for name in ("get_ec_connector_stats", "build_ec_connector_stats", "build_prom_metrics"):
    delattr(base.ECConnectorBase, name)
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from ecmooncake import connector, plugin
plugin.register()
config = pickle.loads(sys.stdin.buffer.read())
c = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
meta = c.build_connector_meta(__import__("vllm.v1.core.sched.output", fromlist=["x"]).SchedulerOutput.make_empty())
c.shutdown()
print(json.dumps({"hook": connector.ECMooncakeConnector._hooks["get_ec_connector_stats"],
                  "stats_mro": [k.__name__ for k in connector.ECMooncakeConnectorStats.__mro__],
                  "meta": type(meta).__name__}))
"""


@needs_ec_metrics
def test_an_older_vllm_without_stats_hooks_still_works(model_dir):
    config = make_config("ec_consumer", model_dir=model_dir, port=free_port_range(1), extra=EXTRA)
    done = subprocess.run([sys.executable, "-c", OLDER_VLLM], input=pickle.dumps(config), capture_output=True, timeout=FRESH_PYTHON_S, env=subprocess_env())
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    out = json.loads(done.stdout.decode().strip().splitlines()[-1])
    # What vLLM calls decides, not what its base class defines: this
    # scheduler's source calls get_ec_connector_stats though the base
    # class was stripped of it.
    assert out["hook"] is True and out["meta"] == "ECMooncakeConnectorMetadata"
    assert "ECConnectorStats" not in out["stats_mro"], "no vLLM base to bind to, and no failure for it"


# --- a vLLM that cannot fail a request (no take_unavailable_requests) -----------


def _local_encodes() -> float:
    from ecmooncake.proxy import metrics_text

    for line in metrics_text().splitlines():
        if line.startswith("ecm_local_encodes_total "):
            return float(line.split()[1])
    raise AssertionError("no ecm_local_encodes_total in the library's metrics")


def test_without_take_unavailable_requests_the_engine_encodes_what_never_came(model_dir, monkeypatch):
    """vLLM < 0.30 never asks which requests to fail: a request whose push
    never comes is let through at its deadline with the item missing from
    the connector, so vLLM encodes it from the request's media (the proxy
    sends it to such an instance), and the library counts it."""
    cls = ecm_connector.ECMooncakeConnector
    monkeypatch.setattr(cls, "_hooks", {**cls._hooks, "take_unavailable_requests": False})
    config = make_config("ec_consumer", model_dir=model_dir, port=free_port_range(1), buffer_size=64 * MiB, extra={**EXTRA, "push_wait_timeout_s": 1})
    s = create(config, ECConnectorRole.SCHEDULER)
    w = create(config, ECConnectorRole.WORKER)
    try:
        if CALLS.hooks["start_worker_services"]:
            w.start_worker_services()
        item = Item("local/a", 32, WIDTH)
        req = make_request("pd-local", [item], {"ec_items": [{"mm_hash": item.identifier, "transfer_id": "never-local"}]})
        before = _local_encodes()
        assert s.ensure_cache_available(req, 0) is False, "waits for the push first"
        wait_until(lambda: s.ensure_cache_available(req, 0), 30, interval=0.05, what="the deadline lets the request through")
        assert s.has_cache_item(item.identifier) is False, "so the engine encodes the item itself"
        assert s.ensure_cache_available(req, 0) is True, "and the request stays schedulable"
        assert s.take_unavailable_requests() == set(), "nothing to fail"
        s.build_connector_meta(SchedulerOutput.make_empty())
        assert _local_encodes() == before + 1
        s.build_connector_meta(SchedulerOutput.make_empty())
        assert _local_encodes() == before + 1, "counted once"
        assert s.request_finished(req) == (False, None)
    finally:
        w.shutdown()
        s.shutdown()
