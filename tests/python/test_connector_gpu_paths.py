"""The connector's GPU paths, decided on a host without a GPU: which memory
the encoder hands the library for a CUDA output, on which stream, how long
it stays referenced, where a consumer shard's slab lives, and when a slab
region goes back.

torch is the stand-in of fake_torch (with a CUDA namespace added here) and
the library's ABI is faked at native._call, so that the real
native.Producer's bookkeeping of held sources is what the tests see.
"""

from __future__ import annotations

import gc
import threading
import types
import weakref

import pytest

import fake_torch
from fake_torch import FakeDevice, FakeTensor

from ecmooncake import ec_config, native, packed
from ecmooncake.connector import consumer, hooks, producer
from ecmooncake.connector.metadata import PushSpec, _StepMetadata, _WorkerReport


class FakeDtype(str):
    itemsize = 2


BF16 = FakeDtype("bfloat16")


class FakeStream:
    def __init__(self, handle: int):
        self.cuda_stream = handle


class FakeEvent:
    """A CUDA event whose completion the test decides."""

    made: list["FakeEvent"] = []

    def __init__(self):
        self.done = False
        self.stream = None
        FakeEvent.made.append(self)

    def record(self, stream):
        self.stream = stream

    def query(self):
        return self.done


class Cuda:
    def __init__(self):
        self.stream = FakeStream(0x1000)
        self.Event = FakeEvent

    def is_available(self):
        return True

    def current_device(self):
        return 0

    def current_stream(self, device=None):
        return self.stream


class GpuTensor(FakeTensor):
    def __init__(self, shape=(4, 8), index=0, contiguous=True):
        super().__init__(device="cuda", index=index, contiguous=contiguous, numel=shape[0] * shape[1], shape=shape, dtype=BF16, ptr=0x7F0000)

    def contiguous(self):
        return GpuTensor(self.shape, self.device.index)


@pytest.fixture
def torch(monkeypatch):
    fake_torch.install(monkeypatch)
    import sys

    module = sys.modules["torch"]
    module.cuda = Cuda()
    module.bfloat16 = BF16
    module.device = lambda name: FakeDevice(*((name.split(":")[0], int(name.split(":")[1])) if ":" in name else (name, None)))
    made: list[dict] = []

    def empty(n, dtype=None, device=None, pin_memory=False):
        where = FakeDevice("cpu", None) if device is None else device
        t = FakeTensor(device=where.type, index=where.index, numel=n, element_size=1)
        t.zero_ = lambda: t
        made.append({"nbytes": n, "device": str(where), "pin_memory": pin_memory, "tensor": t})
        return t

    module.empty = empty
    module.made = made
    FakeEvent.made = []
    return module


def config(role: str, device: str = "cuda", **extra) -> ec_config.ECMooncakeConfig:
    ec = types.SimpleNamespace(
        is_ec_producer=role == "producer",
        is_ec_consumer=role == "consumer",
        ec_ip="127.0.0.1",
        ec_port=14579,
        ec_buffer_size=16 << 20,
        ec_buffer_device=device,
        ec_connector_extra_config=extra,
    )
    return ec_config.from_vllm_config(types.SimpleNamespace(ec_transfer_config=ec), ec_config.Topology())


# --- encoder side ------------------------------------------------------------


class FakeABI:
    """The producer's half of the library's ABI, as native._call sees it."""

    def __init__(self):
        self.sources: list[dict] = []
        self.released: list[int] = []
        self.next_id = 1

    def __call__(self, name, *args, out=False, optional=False):
        if name == "ecm_producer_open":
            args[-1]._obj.value = 1
            return None
        if name == "ecm_producer_submit_packed":
            return None  # every push accepted
        if name == "ecm_producer_sources_packed":
            n, body, ids = args[1], args[2], args[4]
            offset = 0
            for i in range(n):
                ptr, _, stream, device, hash_len = packed.SOURCE_HEAD.unpack_from(body, offset)
                offset += packed.SOURCE_HEAD.size
                mm_hash = body[offset : offset + hash_len].decode()
                offset += hash_len
                ids[i] = self.next_id
                self.sources.append({"mm_hash": mm_hash, "ptr": ptr, "device": device, "stream": stream, "id": self.next_id})
                self.next_id += 1
            assert offset == len(body) == args[3]
            return None
        if name == "ecm_producer_poll":
            released, self.released = self.released, []
            return {"done": [], "failed": [], "released": released}
        if name in ("ecm_close", "ecm_producer_cancel"):
            return None
        if name == "ecm_stats":
            return {}
        raise AssertionError(f"unexpected library call {name}")


@pytest.fixture
def abi(monkeypatch):
    fake = FakeABI()
    monkeypatch.setattr(native, "_call", fake)
    monkeypatch.setattr(producer, "configure_process", lambda *a, **k: None)
    return fake


def push(h: str = "h1", shape=(4, 8)) -> PushSpec:
    return PushSpec(f"t-{h}", h, "tcp://127.0.0.1:14579", "r1", "image", "bfloat16", tuple(shape))


def pending(worker) -> bool:
    report = _WorkerReport()
    worker.report(report)
    return report.pending_pushes


def test_a_cuda_output_goes_to_the_library_as_device_memory_on_its_stream(torch, abi):
    worker = producer._ProducerWorker(config("producer"))
    worker.announce([push()], None)
    out = GpuTensor()
    worker.capture("h1", out)
    # Work queued on another stream after save_caches is no concern of the
    # library's: it is ordered after the stream the output was made on.
    torch.cuda.stream = FakeStream(0x2000)
    worker.finish(set())
    assert abi.sources == [{"mm_hash": "h1", "ptr": out.data_ptr(), "device": 0, "stream": 0x1000, "id": 1}]
    assert not any(t.name == "ecmooncake-d2h" for t in threading.enumerate()), "no host copy thread"
    assert not FakeEvent.made, "the engine thread records no event of its own"
    worker.close()


def test_the_output_stays_referenced_until_the_library_releases_it(torch, abi):
    worker = producer._ProducerWorker(config("producer"))
    worker.announce([push()], None)
    out = GpuTensor()
    ref = weakref.ref(out)
    worker.capture("h1", out)
    del out
    worker.finish(set())
    gc.collect()
    assert ref() is not None, "the caching allocator must not get it back under a copy"
    assert pending(worker), "a held source keeps the engine stepping"
    worker.finish(set())
    gc.collect()
    assert ref() is not None, "still held: nothing was released"
    abi.released = [1]
    worker.finish(set())
    gc.collect()
    assert ref() is None, "released by the library, dropped by the connector"
    worker.close()


def test_a_strided_output_is_made_contiguous_at_capture(torch, abi):
    worker = producer._ProducerWorker(config("producer"))
    worker.announce([push()], None)
    strided = GpuTensor(contiguous=False)
    worker.capture("h1", strided)
    worker.finish(set())
    assert len(abi.sources) == 1 and abi.sources[0]["stream"] == 0x1000
    worker.close()


@pytest.mark.parametrize("transport", ["mooncake", "shm", "tcp"])
def test_every_transport_gets_cuda_outputs_as_device_memory(torch, abi, transport):
    """No CUDA output is copied to host memory in Python: the library
    stages it where its transport needs host memory."""
    worker = producer._ProducerWorker(config("producer", **{"transport": transport}))
    assert not hasattr(producer, "_HostCopier")
    worker.announce([push()], None)
    out = GpuTensor()
    worker.capture("h1", out)
    worker.finish(set())
    assert [(s["mm_hash"], s["device"], s["stream"]) for s in abi.sources] == [("h1", 0, 0x1000)]
    worker.close()


def test_cpu_and_cuda_outputs_of_one_step_each_reach_the_library(torch, abi):
    worker = producer._ProducerWorker(config("producer"))
    worker.announce([push("h1"), push("h2")], None)
    worker.capture("h1", GpuTensor())
    host = FakeTensor(device="cpu", numel=32, shape=(4, 8), dtype=BF16, ptr=0x5000)
    host.contiguous = lambda: host
    worker.capture("h2", host)
    worker.finish(set())
    got = {s["mm_hash"]: (s["device"], s["stream"]) for s in abi.sources}
    assert got == {"h1": (0, 0x1000), "h2": (-1, 0)}
    worker.close()


# --- PD side -----------------------------------------------------------------


class FakeConsumer:
    def __init__(self, settings, slab):
        self.settings, self.slab = settings, slab
        self.released: list[list[str]] = []

    def info(self):
        return {"control": "tcp://127.0.0.1:14579"}

    def release(self, hashes):
        self.released.append(list(hashes))
        return [{"mm_hash": h} for h in hashes]

    def close(self):
        pass


@pytest.fixture
def shard(monkeypatch):
    monkeypatch.setattr(consumer, "Consumer", FakeConsumer)
    monkeypatch.setattr(consumer, "configure_process", lambda *a, **k: None)


@pytest.mark.parametrize(
    "device, extra, memory, where, pinned",
    [
        ("cuda", {}, "device", "cuda:0", False),
        ("cuda:1", {}, "device", "cuda:1", False),
        ("cuda", {"buffer_memory": "device"}, "device", "cuda:0", False),
        ("cuda", {"buffer_memory": "pinned_host"}, "pinned_host", "cpu", True),
        ("cuda", {"transport": "mooncake", "buffer_memory": "device"}, "device", "cuda:0", False),
        ("cpu", {}, "host", "cpu", False),
    ],
)
def test_the_slab_lives_where_the_settings_say(torch, shard, device, extra, memory, where, pinned):
    cfg = config("consumer", device, **extra)
    assert cfg.slab_memory == memory
    worker = consumer._ConsumerWorker(cfg, None)
    worker.start()
    (made,) = torch.made
    assert (made["device"], made["pin_memory"], made["nbytes"]) == (where, pinned, 16 << 20)
    assert worker._native.slab is made["tensor"], "the library gets the slab itself"


@pytest.mark.parametrize("cuda_build, memory", [(False, "pinned_host"), (True, "device")])
def test_a_mooncake_slab_is_gpu_memory_when_the_engine_registers_it(monkeypatch, cuda_build, memory):
    asked = []

    def info(library=None, engine=None):
        asked.append((library, engine))
        return {"available": True, "cuda": cuda_build}

    import ecmooncake.native

    monkeypatch.setattr(ecmooncake.native, "mooncake_info", info)
    cfg = config("consumer", "cuda", transport="mooncake", mooncake_engine="/x/mooncake/engine.so", mooncake_library="/x/shim.so")
    assert cfg.slab_memory == memory
    assert asked == [("/x/shim.so", "/x/mooncake/engine.so")], "the engine the shard will load is the one asked"


def test_a_mooncake_engine_that_cannot_be_asked_keeps_the_slab_in_pinned_host_memory(monkeypatch):
    import ecmooncake.native

    def broken(*_a, **_k):
        raise OSError("libecmooncake.so: cannot open shared object file")

    monkeypatch.setattr(ecmooncake.native, "mooncake_info", broken)
    assert config("consumer", "cuda", transport="mooncake").slab_memory == "pinned_host"


def test_buffer_memory_takes_only_known_values():
    with pytest.raises(ec_config.ConfigError, match="buffer_memory"):
        config("consumer", buffer_memory="gpu")


def test_a_gpu_slab_region_goes_back_only_after_its_readers_completed(torch, shard):
    worker = consumer._ConsumerWorker(config("consumer"), None)
    worker.start()
    worker._held.add("h1")
    cache: dict = {}
    worker.load(_StepMetadata(), cache)
    assert worker._native.released == [], "the step that read the view may still run"
    (event,) = FakeEvent.made
    assert event.stream is torch.cuda.stream
    worker.load(_StepMetadata(), cache)
    assert worker._native.released == []
    event.done = True
    worker.load(_StepMetadata(), cache)
    assert worker._native.released == [["h1"]]
    worker.load(_StepMetadata(), cache)
    assert worker._native.released == [["h1"]], "released once"


def test_a_host_slab_region_goes_back_at_once(torch, shard):
    worker = consumer._ConsumerWorker(config("consumer", "cpu"), None)
    worker.start()
    worker._held.add("h1")
    worker.load(_StepMetadata(loads=[]), {})
    assert worker._native.released == [["h1"]]
    assert not FakeEvent.made


@pytest.mark.parametrize(
    "extra, words, absent",
    [
        ({}, ["on cuda", "GPU memory", "cuda_ipc", "staged tcp"], "pinned host memory"),
        ({"buffer_memory": "pinned_host"}, ["pinned host memory, copied to the GPU at load"], "cuda_ipc"),
        ({"transport": "mooncake", "buffer_memory": "device"}, ["GPU memory", "Mooncake"], "pinned"),
    ],
)
def test_the_startup_line_names_the_slab_path(extra, words, absent):
    line = hooks._slab_line(config("consumer", **extra))
    for word in words:
        assert word in line, line
    assert absent not in line, line


def test_the_encoder_startup_line_names_its_paths():
    assert "cuda_ipc" in hooks._transport_line(config("producer"))
    line = hooks._transport_line(config("producer", transport="mooncake"))
    assert "GPU staging registered with the engine" in line and "cuda_ipc" not in line
    assert "pinned host memory" not in line, "no transport copies CUDA outputs to host memory first"
    assert "staged by the library" in hooks._transport_line(config("producer", transport="shm"))

