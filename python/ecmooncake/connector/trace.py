"""Opt-in per-item stamps, for measuring the connector's own time on a real
engine: with ECMOONCAKE_ITEM_TRACE=1 in a vLLM process's environment, the
producer logs one line when vLLM hands it an encoder output (save_caches)
and the consumer one line when it puts the item's view into vLLM's
encoder_cache, each with the item's mm_hash and time.monotonic_ns().

CLOCK_MONOTONIC is one clock for every process of a host, so on one host
the difference of the two stamps of an mm_hash is the time from
save_caches on the encoder instance to the tensor in the PD instance's
encoder cache (the PD scheduler's wait for the item included). Off by
default: a line per item is too much for a production log.
"""

from __future__ import annotations

import os
import time

from .log import logger

ENV = "ECMOONCAKE_ITEM_TRACE"
PREFIX = "ecmooncake item-trace"
SAVE = "save_caches"
PUT = "encoder_cache"

_enabled = os.environ.get(ENV) == "1"


def enabled() -> bool:
    return _enabled


def stamp(event: str, mm_hash: str) -> None:
    """One line "ecmooncake item-trace EVENT mm_hash=H t_ns=N", when on."""
    if _enabled:
        logger.info("%s %s mm_hash=%s t_ns=%d", PREFIX, event, mm_hash, time.monotonic_ns())
