"""What vLLM knows the connector by: the names it is registered under and
the hooks that only some vLLM releases call."""

from __future__ import annotations

CONNECTOR_NAME = "ECMooncakeConnector"
# The same class under a name vLLM's factory does not register, for
# ec_connector_module_path: the factory ignores the module path for names
# it knows, and recent vLLM knows ECMooncakeConnector as its own.
MODULE_PATH_NAME = "EcmooncakeConnector"

# Hooks that only some vLLM releases call (read from its source: .calls),
# with what their absence costs and what the connector does instead; it
# says so at startup. docs/vllm.md has the table per release.
OPTIONAL_HOOKS = {
    "ensure_cache_available": "requests are scheduled before their items arrive",
    "start_save_caches": "pushes are announced when the step's metadata is bound",
    "start_worker_services": (
        "consumer shards start listening when the worker's connector is created, "
        "before the model loads (vLLM's memory profiling counts the slab)"
    ),
    "take_unavailable_requests": (
        "a request whose items never arrive cannot be failed: at its deadline the engine "
        "encodes them itself from the request's media (ecm_local_encodes_total)"
    ),
    "update_connector_output": "load outcomes do not reach the scheduler: a load counts as done once its step is built",
    "build_connector_worker_meta": "load outcomes do not reach the scheduler: a load counts as done once its step is built",
    "has_pending_push_work": (
        "an idle engine does not step for pending work: frees, cancels and held encoder "
        "outputs wait for its next request (the shards' leases bound them)"
    ),
    "get_ec_connector_stats": "transfer statistics stay off vLLM's /metrics (metrics_port still serves the library's)",
}
