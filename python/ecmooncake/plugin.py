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
    """Entry point of the ``vllm.general_plugins`` group; idempotent.

    vLLM calls plugins bare, in every process: nothing may raise out of
    here, or a change in vLLM's private factory would break every vLLM
    process on a machine where ecmooncake is installed.
    """
    try:
        _register()
    except Exception as exc:
        global _warned
        with _lock:
            warned, _warned = _warned, True
        if not warned:
            logger.warning(
                "ecmooncake: cannot register %s in this vLLM's connector factory (%s: %s); vLLM's own "
                "connector of that name stays in place. Name ecmooncake's explicitly instead: "
                '"ec_connector": "EcmooncakeConnector", "ec_connector_module_path": "%s"',
                CONNECTOR_NAME,
                type(exc).__name__,
                exc,
                MODULE,
            )


_warned = False


def _register() -> None:
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    with _lock:
        registry = getattr(ECConnectorFactory, "_registry", None)
        if not isinstance(registry, dict):
            raise TypeError(f"ECConnectorFactory._registry is {type(registry).__name__}, not the dict this plugin knows")
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

    registry = getattr(ECConnectorFactory, "_registry", None)
    return isinstance(registry, dict) and bool(getattr(registry.get(CONNECTOR_NAME), _MARK, False))
