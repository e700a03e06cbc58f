"""Memory handed to the library: the pointer and size of numpy arrays and
torch tensors, and the shared slab of the shm transport."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import sys
import weakref
from typing import Any

import numpy as np

from .errors import EcmInvalid, EcmIOError


_EMPTY = ctypes.c_char * 0


def buffer_of(obj: Any, writable: bool = False) -> tuple[int, int]:
    """(data pointer, nbytes) of a C-contiguous numpy array or CPU torch tensor.

    The caller keeps ``obj`` alive for as long as the library may touch it.
    """
    if isinstance(obj, np.ndarray):
        # Each read of obj.flags builds a new flags object: read it once.
        flags = obj.flags
        if not flags.c_contiguous:
            raise EcmInvalid(
                f"array of shape {obj.shape} is not C-contiguous; "
                "pass np.ascontiguousarray(a)"
            )
        if not flags.writeable:
            if writable:
                raise EcmInvalid("array is read-only; the library must write into it")
            return int(obj.ctypes.data), int(obj.nbytes)
        # The address through the buffer protocol: several times cheaper
        # than obj.ctypes or __array_interface__, which build objects that
        # cost microseconds an item on the encoder's per-batch call.
        return ctypes.addressof(_EMPTY.from_buffer(obj)), int(obj.nbytes)
    if _is_tensor(obj):
        if obj.device.type != "cpu":
            raise EcmInvalid(
                f"tensor is on {obj.device}; only CPU memory can be passed here"
            )
        if not obj.is_contiguous():
            raise EcmInvalid(
                f"tensor of shape {tuple(obj.shape)} is not contiguous; "
                "pass t.contiguous()"
            )
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
    raise EcmInvalid(
        f"expected a numpy array or a CPU torch tensor, got {type(obj).__name__}"
    )


def memory_of(obj: Any, writable: bool = False) -> tuple[int, int, int]:
    """(data pointer, nbytes, device) of a C-contiguous numpy array or a
    contiguous torch tensor in host or CUDA memory.

    device is -1 for host memory, else the CUDA device ordinal; the calls
    that take memory with a device (a Consumer's slab, Producer.sources)
    accept both. The caller keeps ``obj`` alive for as long as the library
    may touch it.
    """
    if isinstance(obj, np.ndarray):
        # The encoder's host outputs, checked first: the tensor checks
        # below cost a device object and a module lookup an item.
        ptr, nbytes = buffer_of(obj, writable)
        return ptr, nbytes, -1
    if _is_tensor(obj):
        # A tensor's device is a new object at each read: read it once.
        device = obj.device
        if device.type == "cuda":
            if not obj.is_contiguous():
                raise EcmInvalid(
                    f"tensor of shape {tuple(obj.shape)} is not contiguous; "
                    "pass t.contiguous()"
                )
            index = getattr(device, "index", None)
            return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), int(index or 0)
        if device.type != "cpu":
            raise EcmInvalid(f"tensor is on {device}; the library takes host or CUDA memory")
    ptr, nbytes = buffer_of(obj, writable)
    return ptr, nbytes, -1


def shared_slab(nbytes: int) -> tuple[np.ndarray, int]:
    """A receive slab in shared memory, for a Consumer on the ``shm`` transport.

    Returns ``(array, fd)``: a writable uint8 array of ``nbytes`` bytes,
    mapped shared from a new memfd, and that memfd's descriptor, to pass as
    ``"slab_fd"`` in the consumer's config. The shard hands the descriptor
    to producers on this host over a Unix socket (never a path), so there
    is no file in /dev/shm and nothing is left behind when the process is
    killed. Every page is allocated now, so that running out of memory
    fails here, and the memfd is sealed against shrinking, so that no
    producer's copy can meet a truncated slab. The descriptor is closed
    once the array (and every view of it) is gone; the memory is freed
    when the last mapping of it, in any process, goes.
    """
    nbytes = int(nbytes)
    if nbytes <= 0:
        raise EcmInvalid(f"shared_slab: nbytes = {nbytes}; want a positive size")
    try:
        fd = os.memfd_create("ecmooncake-slab", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise EcmIOError(f"shared_slab: cannot create a memfd: {exc}") from exc
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            raise EcmIOError(
                f"shared_slab: cannot allocate {nbytes} bytes of shared memory: {exc}; "
                "see `free -b` and the memory limit of this process's cgroup"
            ) from exc
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mapped, os.close, fd)
    return np.frombuffer(mapped, dtype=np.uint8), fd


def _is_tensor(obj: Any) -> bool:
    # torch is optional and heavy: a tensor can exist only if torch is
    # already imported, so look it up instead of importing it.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)
