"""The GPU side of the Python API on any machine: memory with a device, and
GPU features that report "unavailable" clearly where there is no driver."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from ecmooncake import native
from ecmooncake.native import Consumer, EcmInvalid, EcmUnavailable, Producer


class FakeDevice:
    def __init__(self, kind: str, index: int | None = 0):
        self.type, self.index = kind, index

    def __str__(self) -> str:
        return self.type if self.type == "cpu" else f"{self.type}:{self.index}"


class FakeTensor:
    """Quacks like the parts of torch.Tensor that the package reads."""

    def __init__(self, device="cuda", index=0, contiguous=True, numel=1024, element_size=2, ptr=0x7F0000000000):
        self.device = FakeDevice(device, index)
        self.shape = (numel,)
        self._contiguous, self._numel, self._size, self._ptr = contiguous, numel, element_size, ptr

    def is_contiguous(self):
        return self._contiguous

    def numel(self):
        return self._numel

    def element_size(self):
        return self._size

    def data_ptr(self):
        return self._ptr

    def reshape(self, *shape):
        return self

    def view(self, dtype):
        return self


@pytest.fixture
def fake_torch(monkeypatch):
    module = types.ModuleType("torch")
    module.Tensor = FakeTensor
    module.uint8 = "uint8"
    monkeypatch.setitem(sys.modules, "torch", module)


def test_memory_of_names_the_device(fake_torch):
    a = np.zeros(10, dtype=np.float32)
    assert native.memory_of(a) == (a.ctypes.data, 40, -1)
    assert native.memory_of(FakeTensor(index=3, numel=8, element_size=2, ptr=4096)) == (4096, 16, 3)
    assert native.memory_of(FakeTensor(device="cpu", numel=8, element_size=4, ptr=8192)) == (8192, 32, -1)


def test_memory_of_refuses_what_the_library_cannot_take(fake_torch):
    with pytest.raises(EcmInvalid, match="not contiguous"):
        native.memory_of(FakeTensor(contiguous=False))
    with pytest.raises(EcmInvalid, match="host or CUDA memory"):
        native.memory_of(FakeTensor(device="mps"))
    with pytest.raises(EcmInvalid, match="cuda:0"):
        native.buffer_of(FakeTensor())


def _no_gpu() -> dict:
    info = native.gpu_info()
    if info["available"]:
        pytest.skip(f"a GPU is usable here ({info['devices']} devices); tests/python/test_gpu_transfer.py covers it")
    return info


def test_gpu_info_says_why_not(library):
    info = _no_gpu()
    assert info["devices"] == 0
    assert "libcuda.so.1" in info["reason"]


def test_gpu_slab_without_a_driver_is_unavailable(library, fake_torch):
    _no_gpu()
    with pytest.raises(EcmUnavailable, match=r"consumer: receive slab on cuda:0: .*libcuda\.so\.1"):
        Consumer({"ec_port": 1}, FakeTensor())


def test_gpu_sources_without_a_driver_are_unavailable(library, fake_torch):
    _no_gpu()
    with Producer({}) as producer:
        host = np.ones(16, dtype=np.uint8)
        with pytest.raises(EcmUnavailable, match=r"1 of 2 sources refused: item 1 \(h-gpu\).*libcuda\.so\.1"):
            producer.sources([("h-host", host), ("h-gpu", FakeTensor())], stream=0)
        assert producer.held_sources == 1, "the host source was taken, the GPU one was not"


def test_producer_open_without_a_driver_works(library):
    _no_gpu()
    with Producer({}) as producer:
        assert producer.stats()["push"] is not None
