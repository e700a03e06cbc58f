"""The encoder's per-batch calls (Producer.submit and Producer.sources) go
through the packed exports: one call a batch, binary records, no JSON unless
an item is refused. Bytes arrive bit-exact with their meta, a refused item
is reported on its own, and bad input is a clear error, never a crash."""

from __future__ import annotations

import ctypes
from ctypes import byref, c_uint64, c_void_p

import numpy as np
import pytest

from conftest import wait_until
from ecmooncake import _ffi, native, packed
from ecmooncake.native import Consumer, EcmInvalid, Producer
from ecmooncake.tools.harness import free_port_range, payload

pytestmark = pytest.mark.usefixtures("library")

IP = "127.0.0.1"
MiB = 1 << 20


@pytest.fixture
def pair():
    port = free_port_range(1, IP)
    slab = np.zeros(32 * MiB, dtype=np.uint8)
    config = {"ec_ip": IP, "ec_port": port, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "transport": "tcp"}
    with Consumer(config, slab) as consumer, Producer({"transport": "tcp", "control_timeout_s": 10}) as producer:
        yield consumer, producer, f"tcp://{IP}:{port}"


def _finish(producer: Producer, tids: list[str]) -> dict:
    seen: dict = {"done": set(), "failed": {}}

    def finished():
        out = producer.poll(200)
        seen["done"].update(out.get("done") or ())
        seen["failed"].update({f["transfer_id"]: f["reason"] for f in out.get("failed") or ()})
        return len(seen["done"]) + len(seen["failed"]) >= len(tids) and producer.held_sources == 0

    wait_until(finished, 30, interval=0, what="every push done and its source released")
    return seen


def test_a_batch_arrives_bit_exact_with_its_meta(pair):
    consumer, producer, address = pair
    sizes = [1, 7, 4096, 65537, 3 * MiB + 5, 255, 8, 2 * MiB]
    data = {f"{i:02d}é" + "h" * 60: payload(100 + i, n) for i, n in enumerate(sizes)}
    pushes = [
        {"transfer_id": f"t-{i}", "mm_hash": h, "nbytes": d.nbytes, "consumer": address, "meta": f'{{"dtype":"uint8","shape":[1,{d.nbytes}]}}'}
        for i, (h, d) in enumerate(data.items())
    ]
    answers = producer.submit(pushes)
    assert answers == [{"transfer_id": p["transfer_id"]} for p in pushes]
    ids = producer.sources(list(data.items()))
    assert len(set(ids)) == len(ids) and 0 not in ids
    seen = _finish(producer, [p["transfer_id"] for p in pushes])
    assert seen["failed"] == {} and len(seen["done"]) == len(pushes)
    got = consumer.acquire(list(data))
    for push, item in zip(pushes, got):
        assert not item.get("error"), item
        assert item["meta"] == push["meta"]
        assert np.array_equal(consumer.view(item["offset"], item["nbytes"]), data[item["mm_hash"]]), item["mm_hash"]
    consumer.release(list(data))


def test_a_refused_push_is_reported_alone(pair):
    consumer, producer, address = pair
    good = payload(1, 4096)
    answers = producer.submit(
        [
            {"transfer_id": "ok", "mm_hash": "g" * 64, "nbytes": good.nbytes, "consumer": address},
            {"transfer_id": "empty", "mm_hash": "e" * 64, "nbytes": 0, "consumer": address},
            {"transfer_id": "nowhere", "mm_hash": "n" * 64, "nbytes": 16},
            {"mm_hash": "x" * 64, "nbytes": 16, "consumer": address},
        ]
    )
    assert answers[0] == {"transfer_id": "ok"}
    assert "nbytes is 0" in answers[1]["error"]
    assert "no consumer endpoint" in answers[2]["error"]
    assert answers[3]["transfer_id"] is None and "needs transfer_id" in answers[3]["error"]
    producer.sources([("g" * 64, good)])
    assert _finish(producer, ["ok"])["done"] == {"ok"}
    (item,) = consumer.acquire(["g" * 64])
    assert np.array_equal(consumer.view(item["offset"], item["nbytes"]), good)


@pytest.mark.parametrize(
    "push, want",
    [
        ({"transfer_id": 7, "mm_hash": "h", "nbytes": 1, "consumer": "c"}, "transfer_id is int, not a string"),
        ({"transfer_id": "t", "mm_hash": "h", "nbytes": -1, "consumer": "c"}, "nbytes = -1 is not in [0, 2**64)"),
        ({"transfer_id": "t", "mm_hash": "h", "nbytes": 1 << 64, "consumer": "c"}, "is not in [0, 2**64)"),
        ({"transfer_id": "t", "mm_hash": "h", "nbytes": "8", "consumer": "c"}, "nbytes is str, not an int"),
        ({"transfer_id": "t", "mm_hash": "h", "nbytes": 1, "consumer": "c", "meta": {"dtype": "f16"}}, "meta is dict, not a string"),
        ({"transfer_id": "t", "mm_hash": "\ud800", "nbytes": 1, "consumer": "c"}, "not encodable as UTF-8"),
        ("t", "a push is a dict, not str"),
    ],
)
def test_bad_pushes_are_refused_clearly(pair, push, want):
    _, producer, address = pair
    with pytest.raises(EcmInvalid, match=r"submit: push 1 .*") as raised:
        producer.submit([{"transfer_id": "fine", "mm_hash": "f", "nbytes": 1, "consumer": address}, push])
    assert want in str(raised.value)


def test_bad_sources_are_refused_clearly(pair):
    _, producer, _ = pair
    with pytest.raises(EcmInvalid, match="sources: mm_hash is bytes, not a string"):
        producer.sources([(b"h", payload(1, 8))])
    with pytest.raises(EcmInvalid, match="not C-contiguous"):
        producer.sources([("h", payload(1, 16)[::2])])
    with pytest.raises(EcmInvalid, match="is empty"):
        producer.sources([("h", np.zeros(0, dtype=np.uint8))])
    assert producer.held_sources == 0


def test_malformed_records_are_refused_by_the_library(pair):
    _, producer, address = pair
    body = packed.pack_pushes([{"transfer_id": "t", "mm_hash": "h", "nbytes": 1, "consumer": address}])
    dll = _ffi.lib()
    for n, blob, want in [
        (1, body[:-1], "item 0 at byte"),
        (2, body, "2 items need at least 48 bytes"),
        (1, body + b"\0", "1 bytes after the last item"),
        (1, body[:8] + b"\xff\xff\xff\x7f" + body[12:], "transfer_id is 2147483647 bytes"),
    ]:
        err, out = c_void_p(), c_void_p()
        rc = dll.ecm_producer_submit_packed(producer.handle, n, blob, len(blob), byref(out), byref(err))
        message = _ffi.take_string(dll, err)
        assert rc == _ffi.ECM_ERR_INVALID and want in message, message
        assert message.startswith("ecm_producer_submit_packed: ")
        assert out.value is None
    # Nothing of a refused batch was taken: the same transfer id is still free.
    assert producer.submit([{"transfer_id": "t", "mm_hash": "h", "nbytes": 1, "consumer": address}]) == [{"transfer_id": "t"}]


def test_the_floor_does_nothing():
    out = c_uint64(7)
    err = c_void_p(1)
    assert _ffi.lib().ecm_noop(0, 0, None, 0, byref(out), byref(err)) == _ffi.ECM_OK
    assert err.value is None and out.value == 7


def test_a_host_address_is_the_array_data():
    base = np.arange(64, dtype=np.uint8)
    for array in (base, base[8:40], base.reshape(8, 8)[2:5], np.frombuffer(bytes(16), dtype=np.uint8)):
        assert native.buffer_of(array) == (array.ctypes.data, array.nbytes)


def test_a_sources_batch_packs_record_after_record(pair, monkeypatch):
    """The batch is packed in one call on a layout chosen by its hashes'
    lengths; each record still reads back as head then hash, with the
    array's own address, whichever path found it (the host fast path,
    or memory_of for a read-only array)."""
    _, producer, _ = pair
    base = np.arange(4096, dtype=np.uint8)
    read_only = np.frombuffer(bytes(range(200)), dtype=np.uint8)
    items = [("a" * 64, base), ("é-two", base[100:1100]), ("", base.reshape(64, 64)[8:16]), ("h" * 7, read_only)]
    bodies = []
    monkeypatch.setattr(native, "_call", lambda name, handle, n, body, size, ids: bodies.append((name, n, body, size)))
    for _ in range(2):  # the second batch meets its layout cached
        assert producer.sources(items) == [0] * len(items)
    assert bodies[0] == bodies[1]
    name, n, body, size = bodies[0]
    assert (name, n, size) == ("ecm_producer_sources_packed", len(items), len(body))
    offset = 0
    for mm_hash, array in items:
        ptr, nbytes, stream, device, hash_len = packed.SOURCE_HEAD.unpack_from(body, offset)
        offset += packed.SOURCE_HEAD.size
        assert (ptr, nbytes, stream, device) == (array.ctypes.data, array.nbytes, 0, -1)
        assert body[offset : offset + hash_len] == mm_hash.encode("utf-8")
        offset += hash_len
    assert offset == len(body)
    assert producer.held_sources == 0


def test_the_layout_cache_is_bounded():
    for k in range(3 * packed._MAX_SOURCE_LAYOUTS):
        packed._sources_layout((k,))
    assert 0 < len(packed._SOURCE_LAYOUTS) <= packed._MAX_SOURCE_LAYOUTS


def _unpack_pushes(body: bytes) -> list[tuple]:
    records, offset = [], 0
    while offset < len(body):
        nbytes, *lengths = packed.PUSH_HEAD.unpack_from(body, offset)
        offset += packed.PUSH_HEAD.size
        strings = []
        for n in lengths:
            strings.append(body[offset : offset + n].decode("utf-8"))
            offset += n
        records.append((nbytes, *strings))
    return records


@pytest.mark.parametrize("missing_in_the_middle", [False, True])
def test_each_push_packs_its_own_strings(missing_in_the_middle):
    """A push's consumer and meta are encoded again only when they differ
    from the push before's: each record still carries its own, through the
    one-pass packing and through the checked one a missing field falls back
    to (which packs that field empty)."""
    meta = '{"dtype":"uint8","shape":[1,8]}'
    pushes = [
        {"transfer_id": "t-0", "mm_hash": "a" * 64, "nbytes": 8, "consumer": "tcp://a:1", "meta": meta},
        {"transfer_id": "t-é", "mm_hash": "b" * 64, "nbytes": 9, "consumer": "tcp://a:1", "meta": None},
        {"transfer_id": "t-2", "mm_hash": "c" * 64, "nbytes": 10, "consumer": "tcp://b:2"},
        {"transfer_id": "t-3", "mm_hash": "d" * 64, "nbytes": 11, "consumer": "tcp://a:1", "meta": ""},
        {"transfer_id": "t-4", "mm_hash": "e" * 64, "nbytes": 12, "consumer": "tcp://a:1", "meta": meta + " "},
        {"transfer_id": "t-5", "mm_hash": "f" * 64, "nbytes": 13, "consumer": "".join(["tcp://a", ":1"]), "meta": meta},
    ]
    if missing_in_the_middle:
        del pushes[2]["consumer"]
    want = [(p["nbytes"], p["transfer_id"], p["mm_hash"], p.get("consumer", ""), p.get("meta") or "") for p in pushes]
    assert _unpack_pushes(packed.pack_pushes(pushes)) == want
    assert packed.pack_pushes(pushes) == packed._pack_pushes_checked(pushes)


def test_a_cuda_tensor_packs_its_pointer_device_and_current_stream(monkeypatch):
    """The tensor fast path gives memory_of's answer, and the device's
    current stream is torch's raw handle when torch offers one, else the
    Stream object's."""
    import sys
    import types

    import fake_torch

    fake_torch.install(monkeypatch)
    torch = sys.modules["torch"]
    asked = []
    torch.cuda = types.SimpleNamespace(current_stream=lambda device: asked.append(("stream", device)) or types.SimpleNamespace(cuda_stream=0x5000))
    tensors = [fake_torch.FakeTensor(device="cuda", index=1, numel=64, element_size=2, ptr=0x7000 + k * 128) for k in range(3)]
    items = [(f"h{k}", t) for k, t in enumerate(tensors)]

    def records(body):
        out, offset = [], 0
        for mm_hash, _ in items:
            out.append(packed.SOURCE_HEAD.unpack_from(body, offset))
            offset += packed.SOURCE_HEAD.size + len(mm_hash)
        return out

    for ptr, nbytes, stream, device, _ in records(packed.pack_sources(items)):
        assert (nbytes, stream, device) == (128, 0x5000, 1)
    assert asked == [("stream", 1)], "one lookup a device a batch"
    assert [r[0] for r in records(packed.pack_sources(items))] == [t.data_ptr() for t in tensors]
    assert [packed.memory_of(t) for t in tensors] == [(r[0], r[1], r[3]) for r in records(packed.pack_sources(items))]

    asked.clear()
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda device: asked.append(("raw", device)) or 0x6000)
    assert {r[2] for r in records(packed.pack_sources(items))} == {0x6000}
    assert asked == [("raw", 1)]
    assert {r[2] for r in records(packed.pack_sources(items, stream=0x77))} == {0x77}
