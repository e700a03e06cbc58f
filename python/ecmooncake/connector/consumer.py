"""The consumer worker role: one TP rank of a prefill/decode instance, its
slab, its native :class:`~ecmooncake.native.Consumer`, and the zero-copy
views it puts into the engine's encoder cache.

With ec_buffer_device ``cuda`` (vLLM's default) the slab is GPU memory of
the shard's device: encoders on this host write into it with ``cuda_ipc``,
others over TCP staged through page-locked buffers by the library, and the
engine gets views of the slab, no copy. ``buffer_memory: pinned_host``
keeps the slab in pinned host memory and copies each item to the GPU at
load instead."""

from __future__ import annotations

import json
import math
from typing import Any

from .. import ec_config, trace
from ..buffers import shared_slab
from ..errors import EcmError
from ..native import Consumer
from .dtypes import DTYPES, dtype_name, import_torch
from .lifecycle import configure_process
from .log import logger, throttle
from .metadata import LoadSpec, _StepMetadata, _WorkerReport
from .stats import _Recorder

# --- worker side: consumer ---------------------------------------------------


def _require_cuda(device: str) -> None:
    """Refuses a GPU receive buffer on a host where torch sees no GPU, at
    startup and naming the setting; vLLM's default ec_buffer_device is
    "cuda", so this is the first thing a CPU-only PD instance meets."""
    torch = import_torch()
    if torch.cuda.is_available():
        return
    raise ec_config.ConfigError(
        f"ECMooncakeConnector: ec_buffer_device = {device!r} (vLLM's default is 'cuda'), but this "
        f"process has no usable CUDA device (torch.cuda.is_available() is False); on a host "
        f'without a GPU add "ec_buffer_device": "cpu" to --ec-transfer-config'
    )


class _ConsumerWorker:
    """One consumer TP rank: a slab, a native Consumer, zero-copy loads."""

    def __init__(self, cfg: ec_config.ECMooncakeConfig, vllm_config: Any):
        self._cfg = cfg
        self.receiving = cfg.topology.first_pp_stage
        if self.receiving and cfg.buffer_device.startswith("cuda"):
            _require_cuda(cfg.buffer_device)
        self._native: Consumer | None = None
        self._slab: Any = None
        self._device: Any = None
        self._held: set[str] = set()
        # Items vLLM dropped from its encoder cache, each with an event
        # recorded on the device's stream when the drop was seen: the slab
        # region goes back only once the work queued before it (the steps
        # that read the view) has completed, so that no write can land under
        # a kernel still reading it. Checked without waiting at each load.
        self._releasing: list[tuple[Any, list[str]]] = []
        self.slab_memory = cfg.slab_memory
        self._loaded: set[str] = set()
        self._failed: dict[str, str] = {}
        model_config = getattr(vllm_config, "model_config", None)
        self._fallback_width = None
        self._fallback_dtype = None
        if model_config is not None:
            try:
                self._fallback_width = int(model_config.get_hidden_size())
                self._fallback_dtype = dtype_name(model_config.dtype)
            except Exception:
                pass
        # The (dtype, width) last seen per modality: sizes a stand-in entry
        # for an item that could not be loaded (see _stand_in).
        self._seen: dict[str, tuple[str, int]] = {}

    @property
    def endpoint(self) -> str:
        t = self._cfg.topology
        return f"{self._cfg.ec_ip}:{self._cfg.ec_port + t.dp_rank * t.tp_size + t.tp_rank}"

    def start(self) -> None:
        if not self.receiving or self._native is not None:
            return
        torch = import_torch()
        device = self._cfg.buffer_device
        settings = self._cfg.consumer_settings()
        if device.startswith("cuda"):
            self._device = torch.device(device if ":" in device else f"cuda:{torch.cuda.current_device()}")
        if self.slab_memory == "device":
            slab = torch.empty(self._cfg.buffer_size, dtype=torch.uint8, device=self._device)
            how = (
                "registered with the Mooncake engine as memory of its device"
                if self._cfg.value("transport") == "mooncake"
                else "cuda_ipc from encoders on this host, staged tcp from others"
            )
            logger.info(
                "ecmooncake: ec_buffer_device=%s: receiving into %d bytes of GPU memory on %s (%s); loads are views, no copy",
                device,
                self._cfg.buffer_size,
                self._device,
                how,
            )
        elif self.slab_memory == "pinned_host":
            slab = torch.empty(self._cfg.buffer_size, dtype=torch.uint8, pin_memory=True)
            logger.info(
                "ecmooncake: ec_buffer_device=%s, buffer_memory=pinned_host: receiving into %d bytes of pinned "
                "host memory, copied to %s at load",
                device,
                self._cfg.buffer_size,
                self._device,
            )
        elif self._cfg.value("transport") == "shm":
            # The shard hands the slab's memfd to producers on this host.
            shared, settings["slab_fd"] = shared_slab(self._cfg.buffer_size)
            slab = torch.from_numpy(shared)
        else:
            slab = torch.empty(self._cfg.buffer_size, dtype=torch.uint8)
        # Touch every page now, so that first writes do not pay page faults
        # inside a timed transfer.
        slab.zero_()
        configure_process(self._cfg, worker=True)
        self._native = Consumer(settings, slab)
        self._slab = slab
        logger.info("ecmooncake: consumer shard listening at %s", self._native.info().get("control"))

    def load(self, meta: _StepMetadata, encoder_cache: dict[str, Any]) -> None:
        if not self.receiving:
            return
        if self._native is None:
            try:
                self.start()
            except Exception as exc:
                for spec in meta.loads:
                    self._fail(spec, encoder_cache, f"consumer shard cannot start: {exc}")
                return
        gone = [h for h in self._held if h not in encoder_cache]
        if gone:
            self._held.difference_update(gone)
            if self._device is None:
                self._release(gone)
            else:
                torch = import_torch()
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self._device))
                self._releasing.append((event, gone))
        self._release_done()
        wanted: list[LoadSpec] = []
        for spec in meta.loads:
            if spec.mm_hash in encoder_cache:
                if spec.transfer_id:
                    self._loaded.add(spec.transfer_id)
            else:
                wanted.append(spec)
        if not wanted:
            return
        try:
            self._load(wanted, encoder_cache)
        except Exception as exc:
            # vLLM treats a missing entry as fatal: whatever went wrong, each
            # wanted item gets its tensor or a stand-in, and a failure.
            for spec in wanted:
                if spec.mm_hash not in encoder_cache:
                    self._fail(spec, encoder_cache, f"load failed: {type(exc).__name__}: {exc}")

    def _load(self, wanted: list[LoadSpec], encoder_cache: dict[str, Any]) -> None:
        try:
            acquired = self._native.acquire([s.mm_hash for s in wanted])
        except EcmError as exc:
            acquired = [{"error": str(exc)}] * len(wanted)
        if not isinstance(acquired, list):
            acquired = []
        by_hash = {item.get("mm_hash"): item for item in acquired if isinstance(item, dict) and item.get("mm_hash")}
        for index, spec in enumerate(wanted):
            # Answers come in the order asked; one that names its hash is
            # matched by it, and a missing answer is a failure, not a skip.
            item = by_hash.get(spec.mm_hash)
            if item is None:
                item = acquired[index] if index < len(acquired) and isinstance(acquired[index], dict) else None
            if item is None:
                self._fail(spec, encoder_cache, "the shard did not answer for this item")
                continue
            if item.get("error"):
                self._fail(spec, encoder_cache, item["error"] if not spec.error else f"{spec.error}; {item['error']}")
                continue
            try:
                tensor = self._view(spec, item)
            except (ValueError, TypeError, RuntimeError, KeyError) as exc:
                self._release_quietly(spec.mm_hash)
                self._fail(spec, encoder_cache, f"bad item description {item.get('meta')!r}: {type(exc).__name__}: {exc}")
                continue
            encoder_cache[spec.mm_hash] = tensor
            trace.stamp("encoder_cache", spec.mm_hash)
            self._held.add(spec.mm_hash)
            if spec.error:
                # The shard had it although the scheduler could not name a
                # transfer; the request is failed already, the entry is real.
                continue
            self._loaded.add(spec.transfer_id)

    def _release(self, hashes: list[str]) -> None:
        try:
            released = self._native.release(hashes)
        except EcmError as exc:
            released = [{"mm_hash": h, "error": str(exc)} for h in hashes]
        for item in released:
            if item.get("error"):
                throttle.warn("release", "ecmooncake: release of %s at shard %s: %s", item["mm_hash"], self.endpoint, item["error"])

    def _release_done(self) -> None:
        """Releases the dropped items whose readers have completed on the
        GPU; asks each event without waiting, in the order recorded."""
        while self._releasing and self._releasing[0][0].query():
            # Pins are counted: an item loaded again since its drop holds a
            # pin of its own, so this one goes back all the same.
            self._release(self._releasing.pop(0)[1])

    def _release_quietly(self, mm_hash: str) -> None:
        try:
            self._native.release([mm_hash])
        except Exception as exc:
            throttle.warn("release", "ecmooncake: release of %s at shard %s: %s", mm_hash, self.endpoint, exc)

    def _view(self, spec: LoadSpec, item: dict[str, Any]) -> Any:
        torch = import_torch()
        desc = json.loads(item.get("meta") or "{}")
        name = desc.get("dtype")
        shape = desc.get("shape")
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and d > 0 for d in shape)):
            raise ValueError(f"shape {shape!r} is not two positive integers")
        dtype = getattr(torch, name)
        nbytes = int(item["nbytes"])
        if math.prod(shape) * dtype.itemsize != nbytes:
            raise ValueError(f"{shape} x {name} is not {nbytes} bytes")
        if spec.num_embeds and shape[0] != spec.num_embeds:
            raise ValueError(f"{shape[0]} embeddings, the request places {spec.num_embeds}")
        offset = int(item["offset"])
        view = self._slab[offset : offset + nbytes].view(dtype).view(shape[0], shape[1])
        self._seen[spec.modality] = (name, shape[1])
        if self.slab_memory == "pinned_host":
            # The host region goes back only after the work queued behind
            # this copy has completed (see _releasing).
            return view.to(self._device, non_blocking=True)
        return view

    def _fail(self, spec: LoadSpec, encoder_cache: dict[str, Any], reason: str) -> None:
        logger.warning(
            "ecmooncake: load of %s (transfer %s) at shard %s failed: %s",
            spec.mm_hash,
            spec.transfer_id or "-",
            self.endpoint,
            reason,
        )
        if spec.transfer_id:
            self._failed[spec.transfer_id] = reason
        self._stand_in(spec, encoder_cache)

    def _stand_in(self, spec: LoadSpec, encoder_cache: dict[str, Any]) -> None:
        """Fills the entry of an item that could not be loaded with zeros.

        vLLM has already scheduled the step that gathers it, and a missing
        entry is a fatal error of the engine; the request itself is failed
        through take_unavailable_requests, so nothing reads the zeros.
        """
        dtype, width = self._seen.get(spec.modality, (self._fallback_dtype, self._fallback_width))
        if dtype is None or width is None or spec.num_embeds <= 0:
            logger.error(
                "ecmooncake: no stand-in for %s: its width is unknown; the engine will miss it",
                spec.mm_hash,
            )
            return
        torch = import_torch()
        device = self._device if self._device is not None else "cpu"
        encoder_cache[spec.mm_hash] = torch.zeros(spec.num_embeds, width, dtype=getattr(torch, dtype), device=device)

    def note_loads(self, meta: _StepMetadata, before: set[str], encoder_cache: dict[str, Any], recorder: _Recorder) -> None:
        """Counts this step's loads for vLLM's stats: the bytes of each entry
        a load put into the encoder cache from the slab, and each failure."""
        for spec in meta.loads:
            if not spec.transfer_id:
                continue  # failed by the scheduler, and counted there
            if spec.transfer_id in self._failed:
                recorder.load_failed(spec.transfer_id)
            elif spec.mm_hash not in before and spec.mm_hash in self._held:
                tensor = encoder_cache.get(spec.mm_hash)
                if tensor is not None:
                    recorder.loaded(spec.transfer_id, tensor.numel() * tensor.element_size())

    def report(self, report: _WorkerReport) -> None:
        report.loaded |= self._loaded
        report.failed_loads.update(self._failed)
        self._loaded, self._failed = set(), {}

    def stats(self) -> dict[str, Any]:
        return self._native.stats() if self._native is not None else {}

    def close(self) -> None:
        if self._native is not None:
            self._native.close()
        self._slab = None
