"""Registration in vLLM: the general-plugin entry point, the factory entry
that replaces vLLM's built-in one of the same name, ec_connector_module_path,
and that none of it starts the Go runtime (vLLM forks after loading plugins)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import FRESH_PYTHON_S, subprocess_env
from vllm_engine import require_vllm

require_vllm()

from vllm.config import ECTransferConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402

from ecmooncake import plugin  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NAME = "ECMooncakeConnector"
BUILTIN = "vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector"

PROBE = textwrap.dedent(
    """
    import json, os, sys
    # vLLM and torch start threads of their own when imported: count after.
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    import vllm.plugins

    def threads():
        return sorted(os.listdir("/proc/self/task"))

    def mapped():
        with open("/proc/self/maps") as maps:
            return "libecmooncake" in maps.read()

    before = threads()
    if sys.argv[1] == "entry-point":
        vllm.plugins.load_general_plugins()
    else:
        from ecmooncake import plugin
        plugin.register()
        plugin.register()
    registered = threads()
    mapped_after_register = mapped()
    cls = ECConnectorFactory.get_connector_class(
        ECTransferConfig(ec_connector="ECMooncakeConnector", ec_role="ec_consumer"))
    import ecmooncake._ffi
    print(json.dumps({
        "new_threads": len(set(registered) - set(before)),
        "mapped_after_register": mapped_after_register,
        "new_threads_after_class": len(set(threads()) - set(before)),
        "mapped_after_class": mapped(),
        "loaded": ecmooncake._ffi.loaded(),
        "cls": f"{cls.__module__}.{cls.__qualname__}",
    }))
    """
)


def probe(how: str) -> dict:
    env = subprocess_env()
    # Set, it limits which plugins vLLM loads; unset, every one loads.
    env.pop("VLLM_PLUGINS", None)
    done = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, timeout=FRESH_PYTHON_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def builtin_entry():
    """Puts vLLM's own registration of the name back for the test, and the
    registry as it was afterwards."""
    registry = ECConnectorFactory._registry
    saved = dict(registry)
    registry.pop(NAME, None)
    ECConnectorFactory.register_connector(NAME, BUILTIN, NAME)
    yield
    registry.clear()
    registry.update(saved)


def test_register_starts_no_thread_and_maps_no_library():
    out = probe("register")
    assert out["cls"] == "ecmooncake.connector.ECMooncakeConnector"
    assert out["new_threads"] == 0 and out["new_threads_after_class"] == 0, "a Go runtime would start threads"
    assert out["mapped_after_register"] is False and out["mapped_after_class"] is False
    assert out["loaded"] is False


def test_vllm_loads_the_plugin_from_its_entry_point():
    try:
        importlib.metadata.distribution("ecmooncake")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ecmooncake is not installed (pip install -e .), so vLLM cannot find its entry point")
    found = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "ecmooncake"]
    assert [ep.value for ep in found] == ["ecmooncake.plugin:register"]
    out = probe("entry-point")
    assert out["cls"] == "ecmooncake.connector.ECMooncakeConnector"
    assert out["new_threads"] == 0 and out["mapped_after_register"] is False


def test_entry_point_is_declared():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"ecmooncake": "ecmooncake.plugin:register"}


def test_register_replaces_the_builtin_once_and_logs_once(builtin_entry, caplog):
    config = ECTransferConfig(ec_connector=NAME, ec_role="ec_consumer")
    assert ECConnectorFactory.get_connector_class(config).__module__ == BUILTIN
    assert not plugin.is_registered()
    with caplog.at_level(logging.INFO, logger="vllm.ecmooncake"):
        for _ in range(3):
            plugin.register()
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.ecmooncake"]
    assert len(lines) == 1 and "replacing vLLM's built-in" in lines[0]
    assert plugin.is_registered()
    assert ECConnectorFactory.get_connector_class(config).__module__ == "ecmooncake.connector"


def test_module_path_selects_the_connector(builtin_entry):
    from ecmooncake import connector

    by_own_name = ECTransferConfig(ec_connector="EcmooncakeConnector", ec_role="ec_consumer", ec_connector_module_path="ecmooncake.connector")
    assert ECConnectorFactory.get_connector_class(by_own_name) is connector.ECMooncakeConnector
    # Under the shared name the factory prefers its registry over the module
    # path; where no entry of that name exists the module path is used.
    ECConnectorFactory._registry.pop(NAME)
    by_shared_name = ECTransferConfig(ec_connector=NAME, ec_role="ec_consumer", ec_connector_module_path="ecmooncake.connector")
    assert ECConnectorFactory.get_connector_class(by_shared_name) is connector.ECMooncakeConnector
