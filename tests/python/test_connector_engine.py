"""Whole requests through an encoder instance and a two-shard consumer
instance, each hook called in vLLM 0.33's order (see vllm_engine.py).

One deployment serves every test of this module: an encoder (producer,
TP=1) worker process, two consumer TP worker processes, and the two
instances' scheduler-role connectors in this process. Each test uses images
of its own, so the tests do not depend on each other's order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from conftest import FRESH_PYTHON_S, wait_until
from vllm_engine import CALLS, HIDDEN, Engine, Item, WorkerProc, make_config, make_request, require_vllm, run_until, tiny_model

require_vllm()

try:
    from vllm.distributed.ec_transfer.ec_connector import encoder_output_width as _widths  # noqa: F401, E402

    WIDTHS_KNOWN = True
except ImportError:
    WIDTHS_KNOWN = False  # vLLM 0.26: pushes are sized once the output exists

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402

from ecmooncake import plugin  # noqa: E402
from ecmooncake.tools.harness import free_port_range  # noqa: E402

pytestmark = pytest.mark.usefixtures("library")

MiB = 1 << 20
# Wider than the language model's hidden size, as DeepStack encoders are.
WIDTH = 4 * HIDDEN
PUSH_WAIT_S = 6
CACHE_EMBEDS = 4000
EXTRA = {
    "push_wait_timeout_s": PUSH_WAIT_S,
    "load_timeout_s": 20,
    "control_timeout_s": 5,
    "lease_s": 60,
    "log_level": "warn",
}


@dataclass
class Deployment:
    encoder: Engine
    pd: Engine
    port: int
    shards: list[WorkerProc]
    encoder_config: object = None
    pd_config: object = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def shard_stats(self) -> list[dict]:
        return [s.call("stats")["consumer"] for s in self.shards]


@pytest.fixture(scope="module")
def deployment(library, tmp_path_factory):
    model = tiny_model(tmp_path_factory.mktemp("model"))
    port = free_port_range(2)
    pd_config = make_config("ec_consumer", model_dir=model, port=port, tp_size=2, buffer_size=96 * MiB, extra=EXTRA)
    encoder_config = make_config("ec_producer", model_dir=model, port=port, extra=EXTRA, widths={"image": WIDTH})
    workers = [
        WorkerProc("pd-tp0", pd_config, rank=0),
        WorkerProc("pd-tp1", pd_config, rank=1),
        WorkerProc("encoder", encoder_config, rank=0),
    ]
    connectors = []
    try:
        for worker in workers:
            # Each worker is a fresh interpreter importing vLLM: a hang bound
            # (240 s was not enough for three at once at a load average of 12).
            worker.result(FRESH_PYTHON_S)
        plugin.register()
        pd_sched = ECConnectorFactory.create_connector(pd_config, ECConnectorRole.SCHEDULER)
        connectors.append(pd_sched)
        encoder_sched = ECConnectorFactory.create_connector(encoder_config, ECConnectorRole.SCHEDULER)
        connectors.append(encoder_sched)
        yield Deployment(
            encoder=Engine("encoder", encoder_sched, workers[2:], encode_only=True, cache_embeds=1 << 20),
            pd=Engine("pd", pd_sched, workers[:2], encode_only=False, cache_embeds=CACHE_EMBEDS),
            port=port,
            shards=workers[:2],
            encoder_config=encoder_config,
            pd_config=pd_config,
        )
    finally:
        for connector in connectors:
            connector.shutdown()
        for worker in workers:
            worker.stop()


_ids = itertools.count()


def widths(items: list[Item]) -> dict[str, int]:
    return {it.identifier: it.width for it in items}


def encode(d: Deployment, items: list[Item], transfer_ids: list[str] | None = None) -> str:
    """Sends one request to the encoder as a proxy does; returns its id."""
    rid = f"enc-{next(_ids)}"
    params = {"consumer": d.address}
    if transfer_ids is not None:
        params["ec_items"] = [{"transfer_id": t} for t in transfer_ids]
    d.encoder.add(make_request(rid, items, params), widths(items))
    return rid


def prefill(d: Deployment, items: list[Item], ec_items: list[dict] | None) -> str:
    rid = f"pd-{next(_ids)}"
    params = {"ec_items": ec_items} if ec_items is not None else None
    d.pd.add(make_request(rid, items, params), widths(items))
    return rid


def rewrite(encoder_params: dict, items: list[Item]) -> list[dict]:
    """The proxy's rewrite: the encoder's answer becomes the PD request's ec_items."""
    return [{"mm_hash": it.identifier, "transfer_id": encoder_params[it.identifier]["transfer_id"]} for it in items]


def serve(d: Deployment, items: list[Item]) -> tuple[str, str]:
    """Encoder first, then the rewritten request to the PD instance."""
    enc = encode(d, items)
    run_until([d.encoder, d.pd], lambda: enc in d.encoder.outcomes, 60, "encoder request")
    outcome = d.encoder.outcomes[enc]
    assert outcome.status == "done", outcome
    pd = prefill(d, items, rewrite(outcome.params, items))
    run_until([d.encoder, d.pd], lambda: pd in d.pd.outcomes, 60, "PD request")
    return enc, pd


def settle(d: Deployment) -> None:
    run_until([d.encoder, d.pd], lambda: not d.encoder.has_requests() and not d.pd.has_requests(), 60, "engines idle")


def assert_bit_exact(d: Deployment, rid: str, items: list[Item]) -> None:
    outcome = d.pd.outcomes[rid]
    assert outcome.status == "done", outcome
    assert outcome.gathered == {it.identifier: "ok,ok" for it in items}, "every TP rank gathers the producer's bytes"


def test_several_images_per_request(deployment):
    d = deployment
    images = [Item("several/a", 1296, WIDTH), Item("several/b", 576, WIDTH), Item("several/c", 1024, WIDTH)]
    # No width was measured for video: its push is sized from the encoder
    # output once it exists instead of before the encoder runs.
    video = Item("several/video", 700, HIDDEN, modality="video")
    items = images + [video]
    enc, pd = serve(d, items)
    params = d.encoder.outcomes[enc].params
    for index, it in enumerate(items):
        entry = params[it.identifier]
        assert entry["mm_hash"] == it.identifier and entry["item_indices"] == [index]
        assert entry["transfer_id"] == f"{enc}:{index}", "ids invented when the proxy sends none"
    for it in images if WIDTHS_KNOWN else ():
        assert params[it.identifier]["dtype"] == "bfloat16"
        assert params[it.identifier]["shape"] == [it.num_embeds, WIDTH]
        assert params[it.identifier]["nbytes"] == it.nbytes
    assert "shape" not in params[video.identifier]
    assert_bit_exact(d, pd, items)
    assert sorted(set(d.pd.loads_log) & {it.identifier for it in items}) == sorted(it.identifier for it in items)
    settle(d)


def test_same_image_in_two_concurrent_requests(deployment):
    d = deployment
    shared = Item("concurrent/shared", 1024, WIDTH)
    first = [shared, Item("concurrent/first", 512, WIDTH)]
    second = [Item("concurrent/second", 768, WIDTH), shared]
    # The proxy mints transfer ids and sends both halves of both requests at once.
    ids_first = [f"cc-{next(_ids)}" for _ in first]
    ids_second = [f"cc-{next(_ids)}" for _ in second]
    encode(d, first, ids_first)
    encode(d, second, ids_second)
    pd_first = prefill(d, first, [{"mm_hash": it.identifier, "transfer_id": t} for it, t in zip(first, ids_first)])
    pd_second = prefill(d, second, [{"transfer_id": t} for t in ids_second])  # matched by position
    run_until([d.encoder, d.pd], lambda: {pd_first, pd_second} <= d.pd.outcomes.keys(), 60, "both PD requests")
    assert_bit_exact(d, pd_first, first)
    assert_bit_exact(d, pd_second, second)
    assert d.encoder.encoded_log.count(shared.identifier) == 1, "the encoder computes the shared image once"
    assert d.pd.loads_log.count(shared.identifier) == 1, "the PD instance loads it once; the second request hits its cache"
    settle(d)


@pytest.mark.skipif(not WIDTHS_KNOWN, reason="this vLLM measures no encoder output width (0.26): a push reserves only once the output exists")
def test_request_aborted_mid_transfer(deployment):
    d = deployment
    item = Item("aborted/x", 2048, WIDTH)
    baseline = [s["bytes_in_use"] for s in d.shard_stats()]
    tid = f"ab-{next(_ids)}"
    pd = prefill(d, [item], [{"mm_hash": item.identifier, "transfer_id": tid}])
    d.pd.step()
    assert pd not in d.pd.outcomes, "it waits for the push"
    enc = encode(d, [item], [tid])
    # The encoder's step up to its forward: the push is announced, and its
    # reservations land on both shards while the "encoder" runs.
    out, prefills = d.encoder.begin()
    wait_until(
        lambda: all(s["bytes_in_use"] >= b + item.nbytes for s, b in zip(d.shard_stats(), baseline)),
        20,
        what="reservations on both shards",
    )
    d.pd.abort(pd)
    run_until([d.pd], lambda: not d.pd.has_requests(), 30, "abort delivered")
    wait_until(
        lambda: [s["bytes_in_use"] for s in d.shard_stats()] == baseline,
        20,
        what="both shards freed the aborted request's reservation",
    )
    d.encoder.end(out, prefills)
    settle(d)
    assert d.pd.outcomes[pd].status == "aborted"
    assert item.identifier not in d.pd.loads_log
    assert d.encoder.outcomes[enc].status == "done", "the encoder's request does not wait for the push"
    assert [s["bytes_in_use"] for s in d.shard_stats()] == baseline
    # The same image afterwards, with fresh transfer ids, arrives intact.
    _, again = serve(d, [item])
    assert_bit_exact(d, again, [item])
    settle(d)


def test_push_that_never_comes_fails_the_request(deployment):
    d = deployment
    item = Item("never/x", 512, WIDTH)
    pd = prefill(d, [item], [{"mm_hash": item.identifier, "transfer_id": f"never-{next(_ids)}"}])
    run_until([d.pd], lambda: pd in d.pd.outcomes, PUSH_WAIT_S + 30, "the unavailable request")
    outcome = d.pd.outcomes[pd]
    if CALLS.hooks["take_unavailable_requests"]:
        assert outcome.status == "error", "failed through take_unavailable_requests, for the client to retry"
    else:
        # vLLM < 0.30 cannot fail it: at the deadline the engine encodes the
        # item itself (the request carries its media), and the answer is right.
        assert outcome.status == "done"
        assert item.identifier in d.pd.encoded_log
        assert set(outcome.gathered[item.identifier].split(",")) == {"ok"}, "every TP rank gathers it"
    assert outcome.steps_waited > 0
    assert item.identifier not in d.pd.loads_log
    settle(d)


def test_evicted_item_is_reloaded_from_the_resident_pool(deployment):
    d = deployment
    x = Item("resident/x", 1024, WIDTH)
    _, first = serve(d, [x])
    assert_bit_exact(d, first, [x])
    # Two large images need nearly the whole encoder cache: every freeable
    # entry goes, x with them, and the workers release x's slab regions.
    _, big = serve(d, [Item("resident/p", 2000, WIDTH), Item("resident/q", 1900, WIDTH)])
    assert d.pd.outcomes[big].status == "done"
    assert x.identifier in d.pd.freed_log
    for shard in d.shards:
        assert x.identifier not in shard.call("cache_keys")
    received = [s["data"]["Bytes"] for s in d.shard_stats()]
    # Through the encoder again (a new push of the same content): the shards
    # answer from their resident copy and nothing crosses the wire.
    _, again = serve(d, [x])
    assert_bit_exact(d, again, [x])
    assert [s["data"]["Bytes"] for s in d.shard_stats()] == received
    # The image once more, in a request the proxy did not route through the
    # encoder: has_cache_item sees the resident copy and the load serves it.
    _, big2 = serve(d, [Item("resident/r", 2000, WIDTH), Item("resident/s", 1900, WIDTH)])
    assert d.pd.outcomes[big2].status == "done"
    plain = prefill(d, [x], None)
    run_until([d.pd], lambda: plain in d.pd.outcomes, 30, "request without transfer params")
    assert_bit_exact(d, plain, [x])
    settle(d)


def front_end(config, payloads: list[dict]) -> tuple[dict, str]:
    """vLLM's front end fed each step's stats: its Prometheus logger (the
    connector's series, read back from the registry) and its log line."""
    from prometheus_client import REGISTRY
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorLogging
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    prom = PrometheusStatLogger(config, engine_indexes=[0])
    logging_ = ECConnectorLogging(config.ec_transfer_config)
    for data in payloads:
        prom.record(scheduler_stats=SchedulerStats(ec_connector_stats=data), iteration_stats=None, engine_idx=0)
        logging_.observe(data)
    labels = {"model_name": config.model_config.served_model_name, "engine": "0"}
    series = {}
    for name in (
        "push_time_seconds_count", "push_bytes_count", "push_bytes_sum", "num_failed_pushes_total",
        "load_bytes_count", "load_bytes_sum", "num_failed_loads_total",
        "wait_time_seconds_count", "num_failed_requests_total",
    ):
        series[name] = REGISTRY.get_sample_value("vllm:ec_mooncake_" + name, labels)
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    return series, "\n".join(lines)


@pytest.mark.skipif(not CALLS.hooks["get_ec_connector_stats"], reason="this vLLM calls no stats hooks (vLLM < 0.31)")
def test_transfer_stats_reach_vllms_metrics(deployment):
    d = deployment
    settle(d)
    d.encoder.stats_log.clear()
    d.pd.stats_log.clear()
    items = [Item("stats/a", 1024, WIDTH), Item("stats/b", 333, WIDTH)]
    _, pd = serve(d, items)
    assert_bit_exact(d, pd, items)
    lost = Item("stats/lost", 64, WIDTH)
    never = prefill(d, [lost], [{"mm_hash": lost.identifier, "transfer_id": f"lost-{next(_ids)}"}])
    run_until([d.pd], lambda: never in d.pd.outcomes, PUSH_WAIT_S + 30, "the unavailable request")
    settle(d)
    total = sum(it.nbytes for it in items)

    encoder, encoder_log = front_end(d.encoder_config, d.encoder.stats_log)
    assert encoder["push_bytes_count"] == 2 and encoder["push_bytes_sum"] == total
    assert encoder["push_time_seconds_count"] == 2
    assert encoder["num_failed_pushes_total"] == 0 and encoder["load_bytes_count"] == 0
    assert "EC Transfer metrics: Num pushes=2" in encoder_log, encoder_log

    pd_series, pd_log = front_end(d.pd_config, d.pd.stats_log)
    # Two TP ranks load each item; an item counts once.
    assert pd_series["load_bytes_count"] == 2 and pd_series["load_bytes_sum"] == total
    assert pd_series["num_failed_loads_total"] == 0
    assert pd_series["wait_time_seconds_count"] == 2, "the lost item never loads, so it has no wait"
    assert pd_series["num_failed_requests_total"] == 1
    assert pd_series["push_bytes_count"] == 0
    assert "Num loads=2" in pd_log and "Num failed requests=1" in pd_log, pd_log


def test_an_item_from_the_store_at_a_pd_without_store_is_encoded_there_at_once(deployment):
    # A proxy with store_reuse in front of a PD whose store setting is off:
    # no push will come and nothing gets the item, so the engine encodes it
    # itself from the request's media at once, rather than failing the
    # request at push_wait_timeout_s.
    d = deployment
    item = Item("5b01" * 8, 256, WIDTH)
    pd = prefill(d, [item], [{"mm_hash": item.identifier, "transfer_id": f"st-{next(_ids)}", "source": "store"}])
    run_until([d.pd], lambda: pd in d.pd.outcomes, PUSH_WAIT_S + 30, "the request")
    outcome = d.pd.outcomes[pd]
    assert outcome.status == "done", outcome
    assert item.identifier in d.pd.encoded_log
    assert outcome.gathered == {item.identifier: "ok,ok"}
    assert outcome.steps_waited == 0, "given up when first asked"
    settle(d)
