"""The Mooncake Store tier (ecmooncake.store) against its in-memory fake:
keys, settings, bounds, deadlines and fallbacks. The same calls against a
real mooncake_master are in test_store_real.py."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest

from ecmooncake import store
from ecmooncake.ec_config import ConfigError
from ecmooncake.store import Extents, GetResult, MemoryStore, StoreSettings, StoreTier, item_key

MiB = 1 << 20
BASE = dict(model="Qwen/Qwen2.5-VL-7B-Instruct@a1b2", encoder_config={"max_pixels": 1003520, "min_pixels": 3136},
            dtype="bfloat16", shape=(1369, 3584), tp_size=2, tp_layout="replicated")


# -- keys -----------------------------------------------------------------


def test_a_key_names_the_content_and_is_stable():
    k = item_key("4f2a9c", **BASE)
    assert k == item_key("4f2a9c", **BASE)
    assert k.startswith("ecm1/4f2a9c/")
    reordered = dict(BASE, encoder_config={"min_pixels": 3136, "max_pixels": 1003520})
    assert item_key("4f2a9c", **reordered) == k


@pytest.mark.parametrize("change", [
    {"model": "Qwen/Qwen2.5-VL-7B-Instruct@c3d4"},
    {"encoder_config": {"max_pixels": 12845056, "min_pixels": 3136}},
    {"dtype": "float16"},
    {"shape": (1369, 3585)},
    {"shape": (1368, 3584)},
    {"tp_layout": "split-hidden"},
])
def test_whatever_changes_the_bytes_a_pd_needs_changes_the_key(change):
    assert item_key("4f2a9c", **dict(BASE, **change)) != item_key("4f2a9c", **BASE)


def test_the_tp_size_matters_only_where_the_item_is_split_over_shards():
    # Every shard holds the whole item: PDs of any TP size read the same bytes.
    assert item_key("4f2a9c", **dict(BASE, tp_size=4)) == item_key("4f2a9c", **BASE)
    split = dict(BASE, tp_layout="split-hidden")
    assert item_key("4f2a9c", **dict(split, tp_size=4)) != item_key("4f2a9c", **dict(split, tp_size=2))


def test_another_image_has_another_key():
    assert item_key("4f2a9d", **BASE) != item_key("4f2a9c", **BASE)


def test_a_client_chosen_hash_cannot_break_out_of_its_part_of_the_key():
    k = item_key("../x/../../ecm1 y", **BASE)
    assert k.count("/") == 2
    assert " " not in k
    long = item_key("u" * 500, **BASE)
    assert len(long) < 128 and long.count("/") == 2
    assert long != item_key("u" * 499, **BASE)


@pytest.mark.parametrize("bad", [
    {"mm_hash": ""}, {"model": ""}, {"dtype": ""}, {"shape": ()}, {"shape": (0, 3)}, {"shape": (2.5, 3)},
    {"shape": (True, 3)}, {"tp_size": 0}, {"tp_layout": ""}, {"encoder_config": {"x": float("nan")}},
    {"encoder_config": {"x": object()}}, {"encoder_config": 3},
])
def test_a_key_refuses_what_cannot_name_an_output(bad):
    args = dict(BASE, mm_hash="4f2a9c")
    args.update(bad)
    mm_hash = args.pop("mm_hash")
    with pytest.raises(ValueError, match="item_key"):
        item_key(mm_hash, **args)


# -- settings -------------------------------------------------------------


def test_the_tier_is_off_by_default_and_loads_nothing():
    s = StoreSettings.from_mapping(None)
    assert not s.enabled

    def factory():
        raise AssertionError("a disabled tier made a Store client")

    tier = StoreTier(s, factory)
    tier.open()
    buf = ctypes.create_string_buffer(16)
    assert tier.get_into("k", ctypes.addressof(buf), 16) == GetResult(False, "disabled")
    assert tier.put_async("k", ctypes.addressof(buf), 16) is False
    assert tier.stats()["fallbacks"] == 0
    assert tier.close()


@pytest.mark.parametrize("raw,match", [
    ({"enabled": True}, "master_address"),
    ({"enabled": True, "master_address": "10.0.0.5:50051", "metadata_address": "P2PHANDSHAKE"}, "local_hostname"),
    ({"master_address": "10.0.0.5"}, "master_address"),
    ({"metadata_address": "redis://10.0.0.5:6379"}, "metadata_address"),
    ({"mooncake_protocol": "carrier-pigeon"}, "mooncake_protocol"),
    ({"put_inflight_bytes": 1}, "put_inflight_bytes"),
    ({"get_timeout_s": 0}, "get_timeout_s"),
    ({"max_gets": 65}, "max_gets"),
    ({"master": "10.0.0.5:50051"}, "unknown"),
    ([1], "object"),
])
def test_settings_refuse_what_the_schema_refuses(raw, match):
    with pytest.raises(ConfigError, match=match):
        StoreSettings.from_mapping(raw)


def test_settings_defaults_are_the_schemas():
    from ecmooncake import schema
    s = StoreSettings.from_mapping({})
    for key, spec in schema.settings("store").items():
        assert getattr(s, key) == spec["default"], key


# -- staging extents ------------------------------------------------------


def test_extents_are_first_fit_aligned_and_coalesce():
    e = Extents(4096)
    a = e.alloc(100)
    b = e.alloc(1000)
    c = e.alloc(256)
    assert (a, b, c) == (0, 256, 1280)
    assert e.alloc(4096) is None
    e.free(b, 1000)
    assert e.alloc(2000) == 1536  # the hole of b is too small
    e.free(a, 100)
    e.free(c, 256)
    e.free(1536, 2000)
    assert e.used == 0
    assert e.alloc(4096) == 0


# -- the tier over the fake -----------------------------------------------


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def open_tier(**settings) -> tuple[StoreTier, MemoryStore, Clock]:
    raw = {"enabled": True, "master_address": "127.0.0.1:50051", "metadata_address": "http://127.0.0.1:8080/metadata",
           "local_hostname": "127.0.0.1",
           "put_inflight_bytes": 8 * MiB, "get_staging_bytes": 8 * MiB, "get_timeout_s": 5, "put_timeout_s": 10,
           "retry_after_s": 30}
    raw.update(settings)
    fake, clock = MemoryStore(), Clock()
    tier = StoreTier(StoreSettings.from_mapping(raw), lambda: fake, clock)
    assert tier.get_into("k", 0, 0) == GetResult(False, "not_ready")
    tier.open()
    assert tier.wait_ready(10)
    return tier, fake, clock


def buffer(data: bytes):
    buf = ctypes.create_string_buffer(data, len(data))
    return buf, ctypes.addressof(buf)


def drain_puts(tier: StoreTier) -> None:
    """Waits until the put worker has run every put taken so far."""
    done = threading.Event()
    tier._put_q.put(done.set)
    assert done.wait(10)


def test_a_put_then_a_get_is_byte_exact_and_counted():
    tier, fake, _ = open_tier()
    data = os.urandom(3 * MiB + 17)
    src, addr = buffer(data)
    released = threading.Event()
    assert tier.put_async("ecm1/a/1", addr, len(data), released.set)
    assert released.wait(10)
    drain_puts(tier)
    assert fake.objects["ecm1/a/1"] == data
    dest, daddr = buffer(b"\0" * len(data))
    assert tier.get_into("ecm1/a/1", daddr, len(data)) == GetResult(True, "hit", len(data))
    assert dest.raw == data
    st = tier.stats()
    assert (st["put_ok"], st["put_bytes"], st["get_hit"], st["get_hit_bytes"]) == (1, len(data), 1, len(data))
    assert st["fallbacks"] == st["get_not_ready"] == 1  # open_tier's get before open
    assert st["put_inflight_bytes"] == st["get_inflight_bytes"] == 0
    assert fake.setup_args[-1] == "127.0.0.1:50051"
    assert tier.close()
    assert fake.closed


def test_a_miss_falls_back_counted_and_leaves_the_buffer_alone():
    tier, _, _ = open_tier()
    dest, daddr = buffer(b"\x55" * 4096)
    assert tier.get_into("ecm1/none/1", daddr, 4096) == GetResult(False, "miss")
    assert dest.raw == b"\x55" * 4096
    assert tier.stats()["get_miss"] == 1
    assert tier.stats()["fallbacks"] == 2  # and open_tier's get before open
    # A miss says nothing of the Store's health: the next get goes to it.
    assert tier.stats()["breaker_trips"] == 0


def test_an_object_of_another_size_is_no_hit():
    tier, fake, _ = open_tier()
    fake.objects["k"] = b"x" * 5000
    dest, daddr = buffer(b"\0" * 4096)
    assert tier.get_into("k", daddr, 4096) == GetResult(False, "size_mismatch")
    fake.objects["k"] = b"x" * 4000
    assert tier.get_into("k", daddr, 4096) == GetResult(False, "size_mismatch")
    assert dest.raw == b"\0" * 4096
    assert tier.stats()["get_size_mismatch"] == 2


def test_a_get_past_its_deadline_falls_back_and_writes_nothing_late():
    tier, fake, clock = open_tier(get_timeout_s=0.05)
    fake.objects["k"] = b"\x77" * 4096
    fake.gate = threading.Event()
    dest, daddr = buffer(b"\0" * 4096)
    assert tier.get_into("k", daddr, 4096) == GetResult(False, "timeout")
    # The Store answers after the caller gave up: the caller's buffer,
    # possibly reused by now, is not written.
    fake.gate.set()
    for _ in range(1000):
        if tier.stats()["get_late"]:
            break
        threading.Event().wait(0.01)
    st = tier.stats()
    assert (st["get_timeout"], st["get_late"], st["breaker_trips"]) == (1, 1, 1)
    assert dest.raw == b"\0" * 4096
    assert st["get_inflight_bytes"] == 0
    # Until retry_after_s passes, gets fall back at once without asking.
    assert tier.get_into("k", daddr, 4096) == GetResult(False, "unavailable")
    clock.t += 31
    assert tier.get_into("k", daddr, 4096) == GetResult(True, "hit", 4096)
    assert dest.raw == b"\x77" * 4096


def test_a_callers_shorter_deadline_wins():
    tier, fake, _ = open_tier(get_timeout_s=600)
    fake.gate = threading.Event()
    b1, daddr = buffer(b"\0" * 64)
    assert tier.get_into("k", daddr, 64, timeout=0.05) == GetResult(False, "timeout")
    fake.gate.set()


def test_gets_beyond_max_gets_fall_back_at_once():
    tier, fake, _ = open_tier(max_gets=1)
    fake.objects["k"] = b"z" * 64
    fake.gate = threading.Event()
    b2, a1 = buffer(b"\0" * 64)
    b3, a2 = buffer(b"\0" * 64)
    first = []
    t = threading.Thread(target=lambda: first.append(tier.get_into("k", a1, 64)))
    t.start()
    for _ in range(1000):
        if tier._gets_in_flight:
            break
        threading.Event().wait(0.01)
    assert tier.get_into("k", a2, 64) == GetResult(False, "busy")
    fake.gate.set()
    t.join(10)
    assert first == [GetResult(True, "hit", 64)]
    assert tier.stats()["get_busy"] == 1


def test_a_get_larger_than_staging_falls_back():
    tier, _, _ = open_tier(get_staging_bytes=MiB)
    b, a = buffer(b"\0" * (2 * MiB))
    assert tier.get_into("k", a, 2 * MiB) == GetResult(False, "too_large")
    assert tier.stats()["get_too_large"] == 1


def test_an_error_answer_trips_the_breaker():
    tier, fake, clock = open_tier()
    fake.fail = -900  # Mooncake's RPC_FAIL: the master is gone
    b4, daddr = buffer(b"\0" * 64)
    assert tier.get_into("k", daddr, 64) == GetResult(False, "error")
    assert tier.get_into("k", daddr, 64) == GetResult(False, "unavailable")
    b5, saddr = buffer(b"\1" * 64)
    assert tier.put_async("k2", saddr, 64) is False
    st = tier.stats()
    assert (st["get_error"], st["get_unavailable"], st["put_dropped_unavailable"], st["breaker_trips"]) == (1, 1, 1, 1)


def test_puts_are_bounded_in_bytes_in_flight():
    tier, fake, _ = open_tier(put_inflight_bytes=MiB)
    fake.gate = threading.Event()
    b6, a = buffer(b"a" * (MiB // 2))
    assert tier.put_async("k1", a, MiB // 2)
    assert tier.put_async("k2", a, MiB // 2 - 4096)
    assert tier.put_async("k3", a, MiB // 2) is False
    assert tier.put_async("k4", a, 2 * MiB) is False
    assert tier.stats()["put_dropped_full"] == 2
    assert tier.stats()["put_inflight_bytes"] >= MiB - 4096
    fake.gate.set()
    drain_puts(tier)
    assert tier.stats()["put_inflight_bytes"] == 0
    assert sorted(fake.objects) == ["k1", "k2"]


def test_puts_are_bounded_in_rate():
    tier, fake, clock = open_tier(put_rate_bytes_s=MiB)
    b7, a = buffer(b"r" * MiB)
    assert tier.put_async("k1", a, MiB // 2)
    assert tier.put_async("k2", a, MiB // 2)
    assert tier.put_async("k3", a, MiB // 2) is False
    clock.t += 0.5
    assert tier.put_async("k3", a, MiB // 2)
    assert tier.stats()["put_dropped_rate"] == 1
    drain_puts(tier)
    assert sorted(fake.objects) == ["k1", "k2", "k3"]


def test_a_key_put_once_is_not_put_again():
    tier, fake, _ = open_tier()
    b8, a = buffer(b"d" * 4096)
    assert tier.put_async("k", a, 4096)
    assert tier.put_async("k", a, 4096) is False
    drain_puts(tier)
    assert tier.stats()["put_duplicate"] == 1 and tier.stats()["put_ok"] == 1


def test_a_put_past_its_deadline_is_counted_and_trips_the_breaker():
    tier, fake, clock = open_tier(put_timeout_s=10)
    fake.gate = threading.Event()
    b9, a = buffer(b"p" * 4096)
    assert tier.put_async("k", a, 4096)
    clock.t += 11
    b10, d = buffer(b"\0" * 4096)
    assert tier.get_into("k", d, 4096) == GetResult(False, "unavailable")
    st = tier.stats()
    assert (st["put_timeout"], st["breaker_trips"]) == (1, 1)
    fake.gate.set()
    drain_puts(tier)
    assert tier.stats()["put_error"] == 0  # counted once, as a timeout


def test_a_failed_put_is_counted_and_may_be_put_again():
    tier, fake, clock = open_tier()
    fake.fail = -900
    b11, a = buffer(b"f" * 4096)
    assert tier.put_async("k", a, 4096)
    drain_puts(tier)
    assert tier.stats()["put_error"] == 1
    fake.fail = None
    clock.t += 31
    assert tier.put_async("k", a, 4096)
    drain_puts(tier)
    assert fake.objects["k"] == b"f" * 4096


def test_a_release_callback_that_raises_does_not_stop_the_put():
    tier, fake, _ = open_tier()
    b12, a = buffer(b"c" * 4096)

    def release():
        raise RuntimeError("boom")

    assert tier.put_async("k", a, 4096, release)
    drain_puts(tier)
    assert fake.objects["k"] == b"c" * 4096


def test_a_setup_that_fails_leaves_every_call_falling_back():
    def factory():
        raise ImportError("libcudart.so.12: cannot open shared object file")

    tier = StoreTier(StoreSettings.from_mapping({"enabled": True, "master_address": "127.0.0.1:50051",
                                                 "metadata_address": "P2PHANDSHAKE", "local_hostname": "127.0.0.1"}), factory)
    tier.open()
    assert not tier.wait_ready(10)
    assert tier.state == "failed"
    b13, a = buffer(b"\0" * 64)
    assert tier.get_into("k", a, 64) == GetResult(False, "unavailable")
    assert tier.put_async("k", a, 64) is False
    assert tier.stats()["setup_failed"] == 1


def test_close_is_bounded_when_the_client_hangs():
    tier, fake, _ = open_tier()
    gate = threading.Event()
    fake.close = gate.wait
    assert tier.close(timeout=0.05) is False
    b14, a = buffer(b"\0" * 64)
    assert tier.get_into("k", a, 64) == GetResult(False, "unavailable")
    gate.set()


def test_nothing_of_mooncake_loads_on_import():
    import subprocess
    import sys
    code = "import sys, ecmooncake.store; assert 'mooncake' not in sys.modules and 'mooncake.store' not in sys.modules"
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_cudart_is_found_beside_the_wheel(tmp_path, monkeypatch):
    lib = tmp_path / "nvidia" / "cuda_runtime" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudart.so.12").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert store.cudart_dir() is not None


def test_an_empty_or_null_buffer_is_refused_counted():
    tier, fake, _ = open_tier()
    b, a = buffer(b"\0" * 64)
    assert tier.get_into("k", a, 0) == GetResult(False, "invalid")
    assert tier.get_into("k", 0, 64) == GetResult(False, "invalid")
    assert tier.put_async("k", a, 0) is False
    assert tier.put_async("k", 0, 64) is False
    st = tier.stats()
    assert (st["get_invalid"], st["put_dropped_invalid"]) == (2, 2)
    assert not fake.objects


def test_close_never_closes_the_client_under_a_call():
    tier, fake, _ = open_tier(get_timeout_s=0.05)
    fake.objects["k"] = b"q" * 64
    fake.gate = threading.Event()
    b1, a = buffer(b"\0" * 64)
    assert tier.get_into("k", a, 64) == GetResult(False, "timeout")
    # The get is still inside the client: closing it would free what the
    # call uses, so close leaves it open.
    assert tier.close(timeout=0.05) is False
    assert not fake.closed
    fake.gate.set()
    for _ in range(1000):
        if tier.stats()["get_late"]:
            break
        threading.Event().wait(0.01)
    assert tier.stats()["get_late"] == 1
    assert b1.raw == b"\0" * 64


def test_a_scheduler_polls_a_ticket_without_waiting():
    tier, fake, _ = open_tier(get_timeout_s=60)
    fake.objects["k"] = b"t" * 4096
    fake.gate = threading.Event()
    b1, a = buffer(b"\0" * 4096)
    ticket = tier.start_get("k", a, 4096)
    assert ticket.result() is None  # running: no answer, no wait
    fake.gate.set()
    assert ticket.result(wait=10) == GetResult(True, "hit", 4096)
    assert ticket.result() == GetResult(True, "hit", 4096)
    assert b1.raw == b"t" * 4096


def test_a_polled_ticket_past_its_deadline_times_out():
    tier, fake, _ = open_tier(get_timeout_s=0.05)
    fake.gate = threading.Event()
    b1, a = buffer(b"\0" * 64)
    ticket = tier.start_get("k", a, 64)
    threading.Event().wait(0.1)
    assert ticket.result() == GetResult(False, "timeout")
    assert tier.stats()["get_timeout"] == 1
    fake.gate.set()


def test_a_cancelled_ticket_writes_nothing():
    tier, fake, _ = open_tier(get_timeout_s=60)
    fake.objects["k"] = b"c" * 64
    fake.gate = threading.Event()
    b1, a = buffer(b"\0" * 64)
    ticket = tier.start_get("k", a, 64)
    ticket.cancel()
    assert ticket.result() == GetResult(False, "cancelled")
    fake.gate.set()
    for _ in range(1000):
        if tier.stats()["get_late"]:
            break
        threading.Event().wait(0.01)
    st = tier.stats()
    assert (st["get_cancelled"], st["get_late"], st["breaker_trips"]) == (1, 1, 0)
    assert b1.raw == b"\0" * 64


def test_a_ticket_of_a_get_that_fell_back_at_once_answers_at_once():
    tier, _, _ = open_tier(get_staging_bytes=MiB)
    b1, a = buffer(b"\0" * (2 * MiB))
    ticket = tier.start_get("k", a, 2 * MiB)
    assert ticket.result() == GetResult(False, "too_large")
    ticket.cancel()
    assert tier.stats()["get_cancelled"] == 0


def test_admit_says_whether_a_put_would_be_taken_and_counts_a_drop():
    tier, fake, _ = open_tier()
    src, addr = buffer(b"x" * 64)
    assert tier.admit("k1")
    assert tier.stats()["put_duplicate"] == 0, "admitting counts nothing of its own"
    assert tier.put_async("k1", addr, 64)
    drain_puts(tier)
    assert not tier.admit("k1"), "put lately"
    assert tier.stats()["put_duplicate"] == 1
    fake.fail = -1
    assert tier.put_async("k2", addr, 64)
    drain_puts(tier)
    assert tier.stats()["put_error"] == 1
    assert not tier.admit("k3"), "the breaker is open"
    assert tier.stats()["put_dropped_unavailable"] == 1
    assert tier.close()


# -- the index: naming an output without its dtype and shape --------------

IDX = dict(model=BASE["model"], encoder_config=BASE["encoder_config"], tp_layout="replicated")


def item_key_of(mm_hash: str):
    return lambda idx: item_key(mm_hash, **IDX, dtype=idx.dtype, shape=idx.shape)


def put_output(tier: StoreTier, mm_hash: str, data: bytes, dtype: str, shape: tuple[int, ...]) -> None:
    """What an encoder puts: the output, then its index."""
    keep = []
    for key, raw, index in ((item_key(mm_hash, **IDX, dtype=dtype, shape=shape), data, False),
                            (store.index_key(mm_hash, **IDX), store.encode_index(dtype, shape, len(data)), True)):
        buf, addr = buffer(raw)
        keep.append(buf)
        assert tier.put_async(key, addr, len(raw), release=lambda: None, index=index)
    drain_puts(tier)


def test_an_index_key_names_the_image_and_deployment_but_no_dtype_or_shape():
    k = store.index_key("4f2a9c", **IDX)
    assert k.startswith("ecm1i/4f2a9c/") and k == store.index_key("4f2a9c", **IDX)
    assert k != store.index_key("4f2a9d", **IDX)
    assert k != store.index_key("4f2a9c", **dict(IDX, model="other@1"))
    assert k != store.index_key("4f2a9c", **dict(IDX, encoder_config={"max_pixels": 1}))
    assert not k.startswith("ecm1/")  # never an output's key
    with pytest.raises(ValueError, match="index_key"):
        store.index_key("", **IDX)


def test_an_index_round_trips():
    raw = store.encode_index("bfloat16", (1369, 3584), 1369 * 3584 * 2)
    assert len(raw) <= store.INDEX_MAX_BYTES
    assert store.decode_index(raw, max_nbytes=16 * MiB) == store.ItemIndex("bfloat16", (1369, 3584), 1369 * 3584 * 2)


def test_the_index_knows_every_dtype_the_connector_carries():
    torch = pytest.importorskip("torch")
    from ecmooncake.connector.dtypes import DTYPES

    assert set(store.ITEMSIZES) == set(DTYPES)
    assert all(getattr(torch, d).itemsize == n for d, n in store.ITEMSIZES.items())


GOOD = {"v": 1, "dtype": "float16", "shape": [4, 8], "nbytes": 64}


def encoded(**change) -> bytes:
    import json

    value = dict(GOOD, **change)
    return json.dumps({k: v for k, v in value.items() if v is not ...}).encode()


@pytest.mark.parametrize("raw, match", [
    (b"", "not JSON"), (b"\xff\xfe", "not JSON"), (b"{", "not JSON"), (b"[" * 250 + b"]" * 250, "not an object"),
    (b"x" * 513, "at most 512"), (b"null", "not an object"), (b"[1,2]", "not an object"),
    (encoded(extra=1), "not an object"), (encoded(nbytes=...), "not an object"),
    (encoded(v=2), "format"), (encoded(v=True), "format"), (encoded(v="1"), "format"),
    (encoded(dtype="complex128"), "dtype"), (encoded(dtype=None), "dtype"), (encoded(dtype=["float16"]), "dtype"),
    (encoded(shape=[]), "shape"), (encoded(shape=[4, 0]), "shape"), (encoded(shape=[4, -8]), "shape"),
    (encoded(shape=[4, 8.0]), "shape"), (encoded(shape=[True, 64]), "shape"), (encoded(shape="4,8"), "shape"),
    (encoded(shape=[1, 1, 1, 1, 64]), "shape"),
    (encoded(nbytes=63), "is not shape"), (encoded(nbytes=65), "is not shape"), (encoded(nbytes=0), "nbytes"),
    (encoded(nbytes=True), "nbytes"), (encoded(nbytes=64.0), "nbytes"), (encoded(nbytes="64"), "nbytes"),
    (b'{"v":1,"dtype":"float16","shape":[4,8],"nbytes":NaN}', "not JSON"),
    (encoded(shape=[1 << 40, 1 << 40], nbytes=1 << 81), "exceeds"),
    (encoded(shape=[10 ** 30, 10 ** 30], nbytes=64), "is not shape"),
])
def test_an_index_that_this_module_did_not_write_is_refused(raw, match):
    with pytest.raises(store.BadIndex, match=match):
        store.decode_index(raw, max_nbytes=1 << 40)


def test_an_index_larger_than_what_the_pd_stages_is_refused():
    raw = store.encode_index("float16", (4, 8), 64)
    assert store.decode_index(raw, max_nbytes=64).nbytes == 64
    with pytest.raises(store.BadIndex, match="exceeds the 63 bytes"):
        store.decode_index(raw, max_nbytes=63)


def test_the_index_decoder_answers_an_index_or_bad_index_for_any_bytes():
    """Fuzz-style: random bytes, and mutations of a good index, never
    raise anything but BadIndex, and what passes is self-consistent."""
    import random

    rng = random.Random(36)
    good = store.encode_index("bfloat16", (17, 64), 17 * 64 * 2)
    alphabet = b'{}[]",:0123456789-+.eE truefalsn\\u\xff\x00vdtypeshapenbytes'
    for i in range(20000):
        if i % 2:
            raw = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 80)))
        else:
            raw = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                op = rng.randrange(3)
                pos = rng.randrange(len(raw) + 1)
                if op == 0 and raw:
                    del raw[min(pos, len(raw) - 1)]
                elif op == 1:
                    raw.insert(pos, rng.choice(alphabet))
                elif raw:
                    raw[min(pos, len(raw) - 1)] = rng.choice(alphabet)
            raw = bytes(raw)
        try:
            idx = store.decode_index(raw, max_nbytes=1 << 20)
        except store.BadIndex:
            continue
        n = store.ITEMSIZES[idx.dtype]
        for d in idx.shape:
            n *= d
        assert n == idx.nbytes <= 1 << 20 and len(idx.shape) <= store.INDEX_MAX_DIMS


def test_a_fetch_finds_an_output_by_its_index_byte_exact():
    tier, fake, _ = open_tier()
    data = os.urandom(2 * 3 * 640)
    put_output(tier, "img1", data, "bfloat16", (3, 640))
    st = tier.stats()
    assert (st["put_ok"], st["index_put_ok"]) == (1, 1)  # the index is no output of its own
    got = tier.fetch(store.index_key("img1", **IDX), item_key_of("img1"))
    assert got.ok and got.index == store.ItemIndex("bfloat16", (3, 640), len(data))
    assert bytes(got.data) == data
    assert tier.stats()["get_hit"] == 2


def test_a_fetch_of_an_image_never_put_is_a_miss_at_the_index():
    tier, _, _ = open_tier()
    got = tier.fetch(store.index_key("nope", **IDX), item_key_of("nope"))
    assert (got.ok, got.reason, got.stage, got.data) == (False, "miss", "index", None)
    assert tier.stats()["get_miss"] == 1


def test_a_fetch_whose_output_is_gone_is_a_miss_at_the_item():
    tier, fake, _ = open_tier()
    put_output(tier, "img1", b"\1" * 64, "float16", (4, 8))
    del fake.objects[item_key("img1", **IDX, dtype="float16", shape=(4, 8))]
    got = tier.fetch(store.index_key("img1", **IDX), item_key_of("img1"))
    assert (got.ok, got.reason, got.stage) == (False, "miss", "item")


@pytest.mark.parametrize("garbage", [b"\x00" * 64, b'{"v":1}', b"x" * 4096,
                                     b'{"v":1,"dtype":"float16","shape":[4096,4096],"nbytes":33554432}'])
def test_a_fetch_refuses_a_garbage_index_counted(garbage):
    # A Store shared with others may hold anything under an index key:
    # bytes of no index, an oversized object, an output beyond staging.
    tier, fake, _ = open_tier()
    fake.objects[store.index_key("img1", **IDX)] = garbage
    got = tier.fetch(store.index_key("img1", **IDX), item_key_of("img1"))
    assert not got.ok and got.stage == "index" and got.reason in ("index_invalid", "size_mismatch")
    st = tier.stats()
    assert st["get_index_invalid"] + st["get_size_mismatch"] == 1
    assert st["fallbacks"] == 2  # and open_tier's get before open


def test_a_fetch_that_runs_past_its_deadline_falls_back():
    tier, fake, _ = open_tier(get_timeout_s=0.05)
    put_output(tier, "img1", b"\1" * 64, "float16", (4, 8))
    fake.gate = threading.Event()
    got = tier.fetch(store.index_key("img1", **IDX), item_key_of("img1"))
    assert (got.ok, got.reason) == (False, "timeout")
    fake.gate.set()
    assert tier.stats()["get_timeout"] == 1


def test_an_index_put_is_refused_when_it_is_too_large():
    tier, fake, _ = open_tier()
    buf, addr = buffer(b"x" * 600)
    assert not tier.put_async("ecm1i/x/1", addr, 600, index=True)
    assert tier.stats()["index_put_failed"] == 1 and not fake.objects
