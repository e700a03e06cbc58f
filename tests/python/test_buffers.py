"""buffer_of and the memory checks that run before the library is involved."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ecmooncake import native
from fake_torch import FakeTensor
from fake_torch import install as install_fake_torch
from ecmooncake.native import Consumer, EcmInvalid


def test_numpy_pointer_and_size():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert native.buffer_of(a) == (a.ctypes.data, 96)
    b = np.ones(3, dtype=np.int64)
    assert native.buffer_of(b) == (b.ctypes.data, 24)


def test_strided_and_foreign_buffers_are_refused():
    with pytest.raises(EcmInvalid, match="C-contiguous"):
        native.buffer_of(np.zeros((64, 64), dtype=np.uint8)[:, ::2])
    with pytest.raises(EcmInvalid, match="C-contiguous"):
        native.buffer_of(np.asfortranarray(np.zeros((4, 4), dtype=np.float32)))
    with pytest.raises(EcmInvalid, match="numpy array or a CPU torch tensor, got bytearray"):
        native.buffer_of(bytearray(16))


def test_consumer_refuses_unusable_slabs_before_loading_anything():
    config = {"ec_port": 1}
    with pytest.raises(EcmInvalid, match="C-contiguous"):
        Consumer(config, np.zeros((64, 64), dtype=np.uint8)[:, ::2])
    frozen = np.zeros(4096, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(EcmInvalid, match="read-only"):
        Consumer(config, frozen)


def test_invalid_is_also_a_value_error():
    with pytest.raises(ValueError):
        native.buffer_of(object())


@pytest.fixture
def fake_torch(monkeypatch):
    install_fake_torch(monkeypatch)


def test_cpu_tensor(fake_torch):
    assert native.buffer_of(FakeTensor(numel=10, element_size=2, ptr=8192)) == (8192, 20)


def test_gpu_and_strided_tensors_are_refused(fake_torch):
    with pytest.raises(EcmInvalid, match="cuda:0"):
        native.buffer_of(FakeTensor(device="cuda"))
    with pytest.raises(EcmInvalid, match="not contiguous"):
        native.buffer_of(FakeTensor(contiguous=False))


def test_tensor_without_torch_imported_is_not_a_tensor(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    with pytest.raises(EcmInvalid, match="got FakeTensor"):
        native.buffer_of(FakeTensor())


def test_real_torch_tensor():
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert native.buffer_of(t) == (t.data_ptr(), 64)
    with pytest.raises(EcmInvalid, match="not contiguous"):
        native.buffer_of(t.t())
