"""The packed batches of the encoder's per-batch calls
(``ecm_producer_submit_packed``, ``ecm_producer_sources_packed``; the
layouts are in include/ecmooncake.h and the Go decoder is capi/packed.go):
records back to back, each a fixed head packed with one ``struct.pack``,
then the head's strings. A wrong type is refused here by name; a missing
field packs empty, for the library to refuse with its reason."""

from __future__ import annotations

import ctypes
import struct
import sys
from typing import Any

import numpy as np

from .buffers import _EMPTY, memory_of
from .errors import EcmInvalid

PUSH_HEAD = struct.Struct("<QIIII")  # nbytes, len transfer_id, mm_hash, consumer, meta
SOURCE_HEAD = struct.Struct("<QQQiI")  # ptr, nbytes, stream, device, len mm_hash

# One struct.Struct per shape of a sources batch (its mm_hashes' lengths),
# so that a batch packs in one call. mm_hashes are digests of one length,
# so a handful of shapes (one per batch size) recur; the cache is bounded
# all the same.
_SOURCE_LAYOUTS: dict[tuple[int, ...], struct.Struct] = {}
_MAX_SOURCE_LAYOUTS = 64


def _sources_layout(lengths: tuple[int, ...]) -> struct.Struct:
    layout = _SOURCE_LAYOUTS.get(lengths)
    if layout is None:
        if len(_SOURCE_LAYOUTS) >= _MAX_SOURCE_LAYOUTS:
            _SOURCE_LAYOUTS.clear()
        layout = _SOURCE_LAYOUTS[lengths] = struct.Struct("<" + "".join(f"QQQiI{n}s" for n in lengths))
    return layout


def _text(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise EcmInvalid(f"{what} is {type(value).__name__}, not a string")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EcmInvalid(f"{what} {value!r:.100} is not encodable as UTF-8: {exc}") from exc


def pack_pushes(pushes: list[dict]) -> bytes:
    """The submit batch: a missing field packs as empty (the library refuses
    that push with its reason, as it refuses any other), a wrong type is
    refused here."""
    parts: list[bytes] = []
    pack = PUSH_HEAD.pack
    for i, push in enumerate(pushes):
        try:
            get = push.get
            tid = get("transfer_id", "").encode("utf-8")
            mm_hash = get("mm_hash", "").encode("utf-8")
            consumer = get("consumer", "").encode("utf-8")
            meta = (get("meta") or "").encode("utf-8")
            head = pack(get("nbytes", 0), len(tid), len(mm_hash), len(consumer), len(meta))
        except UnicodeEncodeError as exc:
            raise EcmInvalid(f"submit: push {i} ({push!r:.200}): a string is not encodable as UTF-8: {exc}") from exc
        except (AttributeError, TypeError, struct.error) as exc:
            raise EcmInvalid(f"submit: push {i} ({push!r:.200}): {_why(push)}") from exc
        parts += (head, tid, mm_hash, consumer, meta)
    return b"".join(parts)


def _why(push: Any) -> str:
    if not isinstance(push, dict):
        return f"a push is a dict, not {type(push).__name__}"
    for key in ("transfer_id", "mm_hash", "consumer", "meta"):
        if key in push and push[key] is not None and not isinstance(push[key], str):
            return f"{key} is {type(push[key]).__name__}, not a string"
    nbytes = push.get("nbytes", 0)
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        return f"nbytes is {type(nbytes).__name__}, not an int"
    return f"nbytes = {nbytes} is not in [0, 2**64)"


def pack_sources(items: list[tuple[str, Any]], stream: Any = None) -> bytes:
    """The sources batch: one record an (mm_hash, output); every output on
    one device is read after the same stream's queued work."""
    values: list[Any] = []
    lengths: list[int] = []
    streams: dict[int, int] = {}
    # Names bound once: this loop runs for every item of every batch.
    ndarray, address, view = np.ndarray, ctypes.addressof, _EMPTY.from_buffer
    for mm_hash, array in items:
        flags = array.flags if type(array) is ndarray else None
        if flags is not None and flags.c_contiguous and flags.writeable:
            # memory_of's answer for the common host output, without
            # its calls and checks for every other kind of memory.
            ptr, nbytes, device = address(view(array)), array.nbytes, -1
        else:
            ptr, nbytes, device = memory_of(array)
        stream_handle = 0
        if device >= 0:
            stream_handle = streams.get(device, -1)
            if stream_handle < 0:
                stream_handle = streams[device] = _stream_handle(stream, array)
        if type(mm_hash) is str and mm_hash.isascii():
            encoded = mm_hash.encode("ascii")
        else:
            encoded = _text(mm_hash, "sources: mm_hash")
        lengths.append(len(encoded))
        values += (ptr, nbytes, stream_handle, device, len(encoded), encoded)
    return _sources_layout(tuple(lengths)).pack(*values)


def _stream_handle(stream: Any, tensor: Any) -> int:
    """The cudaStream_t whose queued work produces ``tensor``: ``stream``
    (a torch.cuda.Stream or a raw handle), else the tensor device's current
    stream."""
    if stream is None:
        torch = sys.modules["torch"]
        return int(torch.cuda.current_stream(tensor.device).cuda_stream)
    if isinstance(stream, int):
        return stream
    return int(stream.cuda_stream)
