"""A stand-in for the few parts of torch the package reads, for tests of the
tensor paths on machines without torch (or without a GPU)."""

from __future__ import annotations

import sys
import types


class FakeDevice:
    def __init__(self, kind: str, index: int | None = 0):
        self.type, self.index = kind, index

    def __str__(self) -> str:
        return self.type if self.type == "cpu" else f"{self.type}:{self.index}"


class FakeTensor:
    """Quacks like the parts of torch.Tensor that the package reads."""

    def __init__(self, device="cpu", index=0, contiguous=True, numel=10, element_size=2, ptr=4096, shape=None, dtype="uint8"):
        self.device = FakeDevice(device, index)
        self.shape = tuple(shape) if shape is not None else (numel,)
        self.dtype = dtype
        self._contiguous, self._numel, self._size, self._ptr = contiguous, numel, element_size, ptr

    def is_contiguous(self):
        return self._contiguous

    def numel(self):
        return self._numel

    def element_size(self):
        return self._size

    def data_ptr(self):
        return self._ptr

    def get_device(self):
        # torch's answer: the CUDA ordinal, -1 for host memory.
        return -1 if self.device.type == "cpu" else int(self.device.index or 0)

    @property
    def nbytes(self):
        return self._numel * self._size

    def reshape(self, *shape):
        return self

    def view(self, dtype):
        return self


def install(monkeypatch) -> None:
    """Makes `import torch` give the stand-in for the rest of the test."""
    module = types.ModuleType("torch")
    module.Tensor = FakeTensor
    module.uint8 = "uint8"
    monkeypatch.setitem(sys.modules, "torch", module)
