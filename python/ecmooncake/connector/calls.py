"""Which of the connector's optional hooks the running vLLM calls.

vLLM's base class is no guide: 0.26's ``ECConnectorBase`` defines
``update_connector_output`` but its scheduler never calls it, and a hook
one model runner calls another may not. So the answer is read from the
source of the modules that call the connector (its scheduler, its model
runners' connector glue, its GPU worker), found on disk next to the
installed ``vllm`` package without importing anything of it.

A hook counts as called when every call site vLLM has for it calls it:
a worker hook only when both model runners (the V1 mixin and, where it
exists, the V2 runner's ``gpu/ec_connector.py``) call it, since the
connector cannot tell in advance which one the engine will use. Where a
module's source cannot be read (an install without sources), the base
class decides, as it did before: that is said at startup.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

# The modules that call an EC connector, relative to the vllm package.
SCHEDULER = "v1/core/sched/scheduler.py"
MIXIN = "v1/worker/ec_connector_model_runner_mixin.py"
RUNNER_V2 = "v1/worker/gpu/ec_connector.py"
WORKER = "v1/worker/gpu_worker.py"

# hook -> the modules whose every call site must call it. Scheduler hooks
# are called by the scheduler only; worker hooks by the model runners.
WHERE = {
    "ensure_cache_available": (SCHEDULER,),
    "take_unavailable_requests": (SCHEDULER,),
    "update_connector_output": (SCHEDULER,),
    "has_pending_push_work": (SCHEDULER,),
    "get_ec_connector_stats": (SCHEDULER,),
    "start_save_caches": (MIXIN, RUNNER_V2),
    "build_connector_worker_meta": (MIXIN, RUNNER_V2),
    "start_worker_services": (WORKER,),
}


@dataclass
class Calls:
    """What one vLLM calls: ``hooks`` maps each hook of WHERE to whether it
    is called; ``ensure_paths`` counts the scheduler's call sites of
    ensure_cache_available (1: the waiting path only; 2: running too);
    ``unread`` names the modules whose source could not be read."""

    hooks: dict[str, bool]
    ensure_paths: int = 0
    unread: list[str] = field(default_factory=list)

    @property
    def outcomes(self) -> bool:
        """Whether load and push outcomes reach the scheduler: the workers
        build their report and the scheduler hands it to the connector."""
        return self.hooks.get("build_connector_worker_meta", True) and self.hooks.get("update_connector_output", True)


def vllm_root() -> Path | None:
    """The installed vllm package's directory, found without importing it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


# Modules that call only the EC connector: a call through any name counts
# (0.26's mixin calls "connector.save_caches("). The scheduler and the
# worker call a KV connector's hooks of the same names too
# ("self.connector.update_connector_output(" is the KV one), so there only
# a call on the EC connector counts.
EC_ONLY = (MIXIN, RUNNER_V2)
_EC_RECEIVER = r"(?:ec_connector|get_ec_transfer\(\))"


def _sites(text: str, hook: str, module: str) -> int:
    receiver = r"[\w)\]]" if module in EC_ONLY else _EC_RECEIVER
    # A definition ("def x(") has no dot before the name: not a call.
    return len(re.findall(receiver + r"\s*\.\s*" + re.escape(hook) + r"\s*\(", text))


def read_calls(root: Path | None = None, base: type | None = None) -> Calls:
    """The hooks the vLLM at ``root`` (the installed one by default) calls.
    ``base``: its ECConnectorBase, asked for the hooks of modules whose
    source cannot be read (None: such hooks count as called)."""
    root = vllm_root() if root is None else root
    texts: dict[str, str | None] = {}
    for rel in {m for mods in WHERE.values() for m in mods}:
        path = root / rel if root is not None else None
        try:
            texts[rel] = path.read_text(encoding="utf-8") if path is not None else None
        except FileNotFoundError:
            # The V2 runner's glue does not exist before it did: no call
            # site there. Every other module is expected.
            texts[rel] = "" if rel == RUNNER_V2 else None
        except (OSError, UnicodeDecodeError):
            texts[rel] = None
    unread = sorted(rel for rel, text in texts.items() if text is None)
    hooks = {}
    for hook, modules in WHERE.items():
        if any(texts[m] is None for m in modules):
            hooks[hook] = base is None or hasattr(base, hook)
            continue
        present = [m for m in modules if texts[m]]
        hooks[hook] = bool(present) and all(_sites(texts[m], hook, m) > 0 for m in present)
    sched = texts.get(SCHEDULER)
    ensure_paths = _sites(sched, "ensure_cache_available", SCHEDULER) if sched else 0
    return Calls(hooks, ensure_paths, unread)
