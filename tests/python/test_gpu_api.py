"""The GPU side of the Python API on any machine: memory with a device, and
GPU features that report "unavailable" clearly where there is no driver."""

from __future__ import annotations


import numpy as np
import pytest

from ecmooncake import native
from fake_torch import FakeTensor
from fake_torch import install as install_fake_torch
from ecmooncake.native import Consumer, EcmInvalid, EcmUnavailable, Producer


def cuda_tensor(**kw):
    """A fake CUDA tensor unless told otherwise."""
    return FakeTensor(**{"device": "cuda", "numel": 1024, "ptr": 0x7F0000000000, **kw})


@pytest.fixture
def fake_torch(monkeypatch):
    install_fake_torch(monkeypatch)


def test_memory_of_names_the_device(fake_torch):
    a = np.zeros(10, dtype=np.float32)
    assert native.memory_of(a) == (a.ctypes.data, 40, -1)
    assert native.memory_of(cuda_tensor(index=3, numel=8, element_size=2, ptr=4096)) == (4096, 16, 3)
    assert native.memory_of(cuda_tensor(device="cpu", numel=8, element_size=4, ptr=8192)) == (8192, 32, -1)


def test_memory_of_refuses_what_the_library_cannot_take(fake_torch):
    with pytest.raises(EcmInvalid, match="not contiguous"):
        native.memory_of(cuda_tensor(contiguous=False))
    with pytest.raises(EcmInvalid, match="host or CUDA memory"):
        native.memory_of(cuda_tensor(device="mps"))
    with pytest.raises(EcmInvalid, match="cuda:0"):
        native.buffer_of(cuda_tensor())


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
        Consumer({"ec_port": 1}, cuda_tensor())


def test_gpu_sources_without_a_driver_are_unavailable(library, fake_torch):
    _no_gpu()
    with Producer({}) as producer:
        host = np.ones(16, dtype=np.uint8)
        with pytest.raises(EcmUnavailable, match=r"1 of 2 sources refused: item 1 \(h-gpu\).*libcuda\.so\.1"):
            producer.sources([("h-host", host), ("h-gpu", cuda_tensor())], stream=0)
        assert producer.held_sources == 1, "the host source was taken, the GPU one was not"


def test_producer_open_without_a_driver_works(library):
    _no_gpu()
    with Producer({}) as producer:
        assert producer.stats()["push"] is not None
