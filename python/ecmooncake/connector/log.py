"""The connector's logger and the throttle that keeps a failure repeated
every step from flooding it."""

from __future__ import annotations

import logging
import time
from typing import Any

# A child of vLLM's logger, so that these lines carry vLLM's format and obey
# VLLM_LOGGING_LEVEL; a logger outside that tree has no handler in vLLM.
logger = logging.getLogger("vllm.ecmooncake")


class Throttle:
    """Logs a repeated failure of one kind at most once per interval."""

    def __init__(self, interval_s: float = 10.0):
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._muted: dict[str, int] = {}

    def warn(self, key: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self._interval) < self._interval:
            self._muted[key] = self._muted.get(key, 0) + 1
            return
        muted = self._muted.pop(key, 0)
        self._last[key] = now
        if muted:
            message += " (%d similar lines muted)"
            args = (*args, muted)
        logger.warning(message, *args)


# One for the process: a failure's key names its kind, whichever part hit it.
throttle = Throttle()
