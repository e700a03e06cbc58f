"""What vLLM knows the connector by: the names it is registered under and
the hooks that only some vLLM releases call."""

from __future__ import annotations

CONNECTOR_NAME = "ECMooncakeConnector"
# The same class under a name vLLM's factory does not register, for
# ec_connector_module_path: the factory ignores the module path for names
# it knows, and recent vLLM knows ECMooncakeConnector as its own.
MODULE_PATH_NAME = "EcmooncakeConnector"

# Hooks that only some vLLM releases call, with what their absence costs;
# the connector adapts where it can (see hooks._Connector) and says so at startup.
OPTIONAL_HOOKS = {
    "ensure_cache_available": "requests are scheduled before their items arrive",
    "start_save_caches": "pushes are announced when the step's metadata is bound",
    "start_worker_services": "consumer shards start listening at the first step",
    "take_unavailable_requests": "a request whose items never arrive is not failed",
    "build_connector_worker_meta": "load and push outcomes do not reach the scheduler",
    "has_pending_push_work": "an idle engine may sit on pushes in flight",
    "get_ec_connector_stats": "transfer statistics stay off vLLM's /metrics (metrics_port still serves the library's)",
}
