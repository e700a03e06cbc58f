"""The records that cross between the scheduler and the workers: what the
scheduler tells the workers each step (loads and pushes) and what the
workers report back. vLLM pickles them across processes, so they hold
plain values only.

``_StepMetadata`` and ``_WorkerReport`` are the implementations of
vLLM-facing classes the package assembles on first use (see the package
docstring), as ``hooks._Connector`` and ``stats._Stats`` are."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any

from .dtypes import itemsize


@dataclass
class LoadSpec:
    """One item a consumer worker puts into its encoder cache this step."""

    mm_hash: str
    transfer_id: str
    num_embeds: int
    modality: str
    # Set when the scheduler could not hand out a transfer: the worker must
    # still fill the entry (vLLM gathers it) and the request is failed.
    error: str = ""


@dataclass
class PushSpec:
    """One push a producer worker announces before its encoder runs."""

    transfer_id: str
    mm_hash: str
    consumer: str
    request_id: str
    modality: str
    # Known ahead only when the engine measured the encoder's output width;
    # otherwise the push is sized from the tensor when it exists.
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int | None:
        if self.dtype is None or self.shape is None:
            return None
        return math.prod(self.shape) * itemsize(self.dtype)

    def describe(self) -> str:
        return _description(self.dtype, tuple(self.shape or ()))


@functools.lru_cache(maxsize=4096)
def _description(dtype: str | None, shape: tuple[int, ...]) -> str:
    # Every push of a step is described on the encoder's per-batch path,
    # and a model's outputs come in few shapes: JSON once a shape, not once
    # an item.
    return json.dumps({"dtype": dtype, "shape": list(shape)}, separators=(",", ":"))


@dataclass
class _StepMetadata:
    """Scheduler → workers, once per step."""

    # No list of freed items: vLLM's runner drops freed entries from its
    # encoder cache before the connector's hooks run, and a worker releases
    # whatever it loaded that is no longer there, even in steps whose
    # metadata never reached it.
    loads: list[LoadSpec] = field(default_factory=list)
    pushes: list[PushSpec] = field(default_factory=list)


@dataclass
class _WorkerReport:
    """Workers → scheduler, once per step; merged across TP ranks."""

    loaded: set[str] = field(default_factory=set)  # transfer ids
    failed_loads: dict[str, str] = field(default_factory=dict)  # transfer id -> cause
    pushes_done: set[str] = field(default_factory=set)
    pushes_failed: dict[str, str] = field(default_factory=dict)
    pending_pushes: bool = False

    def aggregate(self, other: Any) -> Any:
        # Every TP rank gathers from its own encoder cache, so an item is
        # loaded only where every rank has it; one rank's failure fails it.
        return type(self)(
            loaded=self.loaded & other.loaded,
            failed_loads={**self.failed_loads, **other.failed_loads},
            pushes_done=self.pushes_done | other.pushes_done,
            pushes_failed={**self.pushes_failed, **other.pushes_failed},
            pending_pushes=self.pending_pushes or other.pending_pushes,
        )
