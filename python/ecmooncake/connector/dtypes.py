"""The element types an item may carry, and torch, imported only when a
tensor is at hand (importing this package imports no torch)."""

from __future__ import annotations

from typing import Any

# dtypes an item's description may name; anything else from the wire is
# refused rather than looked up on the torch module.
DTYPES = (
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
)


def import_torch() -> Any:
    import torch

    return torch


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as in DTYPES."""
    return getattr(import_torch(), dtype).itemsize


def dtype_name(dtype: Any) -> str:
    """A torch dtype's name as DTYPES spells it ("bfloat16", not "torch.bfloat16")."""
    return str(dtype).removeprefix("torch.")
