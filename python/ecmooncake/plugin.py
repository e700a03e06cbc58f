"""vLLM plugin: registers ECMooncakeConnector in vLLM's connector factory.

vLLM runs every ``vllm.general_plugins`` entry point in each process it
starts (API server, engine core, workers) before any connector is built.
Recent vLLM registers a Python connector of the same name; this one takes
its place, so ``--ec-transfer-config '{"ec_connector": "ECMooncakeConnector",
...}'`` selects ours.

Registering stores a module path and a class name only: it imports neither
the connector module nor the native library, because vLLM forks after
loading plugins and a Go runtime does not survive a fork.
"""

from __future__ import annotations

import logging
import threading

from .connector import CONNECTOR_NAME

logger = logging.getLogger("vllm.ecmooncake")

MODULE = "ecmooncake.connector"

_lock = threading.Lock()
# Marks the factory's loader as ours, so that registering twice (vLLM in a
# spawned process after the parent, a tool calling register()) is a no-op.
_MARK = "_ecmooncake"


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; idempotent."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    with _lock:
        registry = ECConnectorFactory._registry
        current = registry.get(CONNECTOR_NAME)
        if getattr(current, _MARK, False):
            return
        # register_connector refuses a name it knows, and the built-in entry
        # is registered when the factory module is imported.
        replaced = registry.pop(CONNECTOR_NAME, None) is not None
        ECConnectorFactory.register_connector(CONNECTOR_NAME, MODULE, CONNECTOR_NAME)
        setattr(registry[CONNECTOR_NAME], _MARK, True)
    if replaced:
        logger.info("ecmooncake: %s now loads %s (replacing vLLM's built-in connector of that name)", CONNECTOR_NAME, MODULE)
    else:
        logger.info("ecmooncake: registered %s from %s", CONNECTOR_NAME, MODULE)


def is_registered() -> bool:
    """Whether the factory's entry for the name is this package's."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    return bool(getattr(ECConnectorFactory._registry.get(CONNECTOR_NAME), _MARK, False))
