"""The packed batches of the encoder's per-batch calls
(``ecm_producer_submit_packed``, ``ecm_producer_sources_packed``; the
layouts are in include/ecmooncake.h and the Go decoder is capi/packed.go):
records back to back, each a fixed head then the head's strings (a sources
batch packs with one ``struct.pack`` of a layout cached by its strings'
lengths). A wrong type is refused here by name; a missing
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
    refused here.

    A batch of well-formed pushes packs in one pass that reads each field
    once and encodes a consumer or meta only when it differs from the push
    before's (a batch's pushes mostly share both); anything else (a missing
    field, a wrong type) packs again through :func:`_pack_pushes_checked`,
    which names what is wrong."""
    parts: list[bytes] = []
    pack = PUSH_HEAD.pack
    consumer = meta = _UNSET
    consumer_b = meta_b = b""
    try:
        for push in pushes:
            tid = push["transfer_id"].encode("utf-8")
            mm_hash = push["mm_hash"].encode("utf-8")
            c = push["consumer"]
            if c != consumer:
                consumer_b, consumer = c.encode("utf-8"), c
            m = push.get("meta")
            if m != meta:
                meta_b, meta = (m or "").encode("utf-8"), m
            parts += (pack(push["nbytes"], len(tid), len(mm_hash), len(consumer_b), len(meta_b)), tid, mm_hash, consumer_b, meta_b)
    except (KeyError, AttributeError, TypeError, UnicodeEncodeError, struct.error):
        return _pack_pushes_checked(pushes)
    return b"".join(parts)


_UNSET: Any = object()


def _pack_pushes_checked(pushes: list[dict]) -> bytes:
    """pack_pushes, push by push with every field's default: a missing
    field packs empty, a wrong type raises EcmInvalid naming the push."""
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
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    for mm_hash, array in items:
        kind = type(array)
        if kind is ndarray:
            flags = array.flags
            if flags.c_contiguous and flags.writeable:
                # memory_of's answer for the common host output, without
                # its calls and checks for every other kind of memory.
                ptr, nbytes, device = address(view(array)), array.nbytes, -1
            else:
                ptr, nbytes, device = memory_of(array)
        elif kind is tensor and (device := array.get_device()) >= 0 and array.is_contiguous():
            # memory_of's answer for a contiguous CUDA tensor (get_device
            # is its ordinal), without a device object an item.
            ptr, nbytes = array.data_ptr(), array.nbytes
        else:
            ptr, nbytes, device = memory_of(array)
        stream_handle = 0
        if device >= 0:
            stream_handle = streams.get(device, -1)
            if stream_handle < 0:
                stream_handle = streams[device] = _stream_handle(stream, device)
        if type(mm_hash) is str and mm_hash.isascii():
            encoded = mm_hash.encode("ascii")
        else:
            encoded = _text(mm_hash, "sources: mm_hash")
        lengths.append(len(encoded))
        values += (ptr, nbytes, stream_handle, device, len(encoded), encoded)
    return _sources_layout(tuple(lengths)).pack(*values)


def _stream_handle(stream: Any, device: int) -> int:
    """The cudaStream_t whose queued work produces the outputs on CUDA
    device ``device``: ``stream`` (a torch.cuda.Stream or a raw handle),
    else that device's current stream, read as the raw handle where torch
    offers it (no Stream object a batch)."""
    if stream is None:
        torch = sys.modules["torch"]
        raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return int(raw(device))
        return int(torch.cuda.current_stream(device).cuda_stream)
    if isinstance(stream, int):
        return stream
    return int(stream.cuda_stream)
