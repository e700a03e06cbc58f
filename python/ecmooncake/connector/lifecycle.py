"""The native library's lifetime in a vLLM process: its process-wide
settings, applied once before the first native object, and a close that
vLLM's shutdown does not wait on for long."""

from __future__ import annotations

import threading
from typing import Any

from .. import ec_config
from ..native import configure
from .log import logger

# How long shutdown waits for a native object to close. The library's close
# waits for control round trips in flight, each up to control_timeout_s, and
# vLLM's shutdown should not; the object (and any memory the library may
# still read) stays referenced by the closing thread until it is done.
CLOSE_WAIT_S = 2.0


def close_bounded(native: Any) -> None:
    closer = threading.Thread(target=native.close, name="ecmooncake-close", daemon=True)
    closer.start()
    closer.join(CLOSE_WAIT_S)
    if closer.is_alive():
        logger.info("ecmooncake: %s still closing in the background (control calls in flight)", native.kind)


_configure_lock = threading.Lock()
_configured = False


def configure_process(cfg: ec_config.ECMooncakeConfig, worker: bool) -> None:
    """Process-wide library settings, once, before the first native object."""
    global _configured
    with _configure_lock:
        if not _configured:
            configure(**cfg.process_settings(worker))
            _configured = True
