"""An encoder's CUDA outputs on their way into Mooncake Store (the
connector's Store tier, ecmooncake.connector.tier, over the in-memory
Store): copied into the tier's pinned pool on a stream of its own, after
the output's stream, with the engine thread waiting for neither; bytes
exact; the pool bounded. Needs a GPU (skipped without one)."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from conftest import wait_until  # noqa: E402

from ecmooncake import store  # noqa: E402
from ecmooncake.connector import tier as ctier  # noqa: E402

MiB = 1 << 20
SETTINGS = {
    "enabled": True,
    "master_address": "127.0.0.1:50051",
    "metadata_address": "http://127.0.0.1:8080/metadata",
    "local_hostname": "127.0.0.1",
    "put_inflight_bytes": 8 * MiB,
    "get_staging_bytes": 4 * MiB,
    "segment_bytes": 0,
}


@pytest.fixture
def fake(monkeypatch):
    backend = store.MemoryStore()
    monkeypatch.setattr(ctier, "backend_factory", lambda: backend)
    return backend


@pytest.fixture
def tier(fake):
    cfg = types.SimpleNamespace(store=store.StoreSettings.from_mapping(SETTINGS))
    t = ctier._Tier(cfg, None)
    t.open()
    assert t.tier.wait_ready(10)
    assert t._device is not None, "a process that sees a GPU has a pinned pool"
    try:
        yield t
    finally:
        t.close()


def output_on(stream, rows: int, seed: int) -> torch.Tensor:
    """An encoder output written on stream behind a kernel that keeps the
    stream busy for a while, as an encoder's would be."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles
        gen = torch.Generator(device="cuda").manual_seed(seed)
        return torch.randn(rows, 1024, device="cuda", generator=gen).to(torch.bfloat16)


def test_a_cuda_output_is_put_byte_exact_without_the_caller_waiting(tier, fake):
    # The first use of each kernel loads it, which synchronizes the device.
    warm = torch.cuda.Stream()
    output_on(warm, 1, 0)
    warm.synchronize()
    stream = torch.cuda.Stream()
    out = output_on(stream, 700, 1)
    assert not stream.query(), "the output's stream is still busy (a precondition of this test)"
    tier.put("a" * 64, out, stream)
    # The copy is queued behind the output's kernels, not waited for.
    assert not stream.query(), "put waited for the output's stream"
    key = tier.key("a" * 64, "bfloat16", (700, 1024))
    wait_until(lambda: key in fake.objects, 20, interval=0.01, what="the put")
    stream.synchronize()
    assert fake.objects[key] == out.cpu().view(torch.uint8).numpy().tobytes()
    wait_until(lambda: tier._device._extents.used == 0, 20, interval=0.01, what="the pool given back")
    assert tier.stats()["put_ok"] == 1


def test_a_non_contiguous_cuda_output_is_put_as_its_contiguous_bytes(tier, fake):
    stream = torch.cuda.Stream()
    out = output_on(stream, 1024, 2)[:, :300]
    assert not out.is_contiguous()
    tier.put("b" * 64, out, stream)
    key = tier.key("b" * 64, "bfloat16", (1024, 300))
    wait_until(lambda: key in fake.objects, 20, interval=0.01, what="the put")
    stream.synchronize()
    assert fake.objects[key] == out.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def test_the_pinned_pool_is_bounded_and_a_put_beyond_it_is_counted(tier, fake):
    stream = torch.cuda.Stream()
    big = output_on(stream, 3 * 1024, 3)  # 6 MiB of an 8 MiB pool
    other = output_on(stream, 2 * 1024, 4)  # 4 MiB: no room while big is in the pool
    tier.put("c" * 64, big, stream)
    tier.put("d" * 64, other, stream)
    assert tier.stats()["put_dropped_pinned_full"] == 1
    wait_until(lambda: tier.stats()["put_ok"] == 1, 20, interval=0.01, what="the first put")
    wait_until(lambda: tier._device._extents.used == 0, 20, interval=0.01, what="the pool given back")
    assert len(fake.objects) == 1


def test_an_output_already_put_is_not_copied_again(tier, fake):
    stream = torch.cuda.Stream()
    out = output_on(stream, 100, 5)
    tier.put("e" * 64, out, stream)
    wait_until(lambda: tier.stats()["put_ok"] == 1, 20, interval=0.01, what="the put")
    tier.put("e" * 64, out, stream)
    assert tier.stats()["put_duplicate"] == 1
    assert tier._device._extents.used == 0, "no copy for a put the tier would drop"
