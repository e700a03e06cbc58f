"""Settings Python reads from the environment and passes to the library as
keys: Go reads no environment variables (it sees only the environment the
process started with, not what Python set later)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable


MOONCAKE_LIBRARY_ENV = "ECMOONCAKE_MOONCAKE_LIBRARY"


SHIM_NAME = "libecmooncake_mooncake.so"
MOONCAKE_WHEELS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "mooncake-transfer-engine-cuda13")


def mooncake_wheel() -> dict | None:
    """The installed Mooncake pip wheel, found through the import machinery
    without importing it: {"engine": path of mooncake/engine.so, "version":
    the wheel's version or "", "shim": path of this package's shim (exists
    or not)}; None when no ``mooncake`` package with an engine.so is
    installed."""
    import importlib.metadata
    import importlib.util

    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        engine = os.path.join(folder, "engine.so")
        if os.path.isfile(engine):
            break
    else:
        return None
    version = ""
    for dist in MOONCAKE_WHEELS:
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), SHIM_NAME)
    return {"engine": engine, "version": version, "shim": shim}


def with_mooncake_library(config: Any) -> Any:
    """Fills ``mooncake_library`` from $ECMOONCAKE_MOONCAKE_LIBRARY, else,
    when a Mooncake pip wheel is installed, ``mooncake_library`` with this
    package's shim and ``mooncake_engine`` with the wheel's engine.so.

    Only for an object whose ``transport`` is ``"mooncake"`` and whose
    settings leave both keys out: a library the user names (a source build's
    libtransfer_engine.so) always wins. Go reads no environment variables
    (it sees only the environment the process started with) and cannot ask
    Python's import machinery, so Python passes the paths down as settings.
    Anything else is returned unchanged.
    """
    config = _fill_from_env(
        config, MOONCAKE_LIBRARY_ENV, "mooncake_library", lambda c: c.get("transport") == "mooncake"
    )
    parsed = config_object(config)
    if (
        parsed is None
        or parsed.get("transport") != "mooncake"
        or "mooncake_library" in parsed
        or "mooncake_engine" in parsed
    ):
        return config
    wheel = mooncake_wheel()
    if wheel is None:
        return config
    return {**parsed, "mooncake_library": wheel["shim"], "mooncake_engine": wheel["engine"]}


def _fill_from_env(config: Any, env: str, key: str, applies: Callable[[dict], Any]) -> Any:
    """config with key set from $env, where applies(config) and the key is
    not given; a config that does not parse is left for the library to
    report."""
    value = os.environ.get(env)
    if not value:
        return config
    parsed = config_object(config)
    if parsed is None or not applies(parsed) or key in parsed:
        return config
    return {**parsed, key: value}


def config_object(config: Any) -> dict | None:
    """The settings object config holds (a dict, or its JSON text); None when
    it holds none, which the caller leaves for the library to report."""
    parsed = config
    if isinstance(config, (str, bytes)):
        try:
            parsed = json.loads(config)
        except ValueError:
            return None
    return parsed if isinstance(parsed, dict) else None


METADATA_TOKEN_ENV = "MC_METADATA_HTTP_TOKEN"


def with_metadata_token(config: Any) -> Any:
    """Fills ``mooncake_metadata_token`` from $MC_METADATA_HTTP_TOKEN.

    Only for a consumer that serves a metadata store
    (``mooncake_metadata_server``) and leaves the key out: Mooncake's
    engines read the same variable and send it with every metadata request,
    so the store it serves then refuses everyone else. Go reads no
    environment variables, so Python passes it down. Anything else is
    returned unchanged.
    """
    return _fill_from_env(
        config, METADATA_TOKEN_ENV, "mooncake_metadata_token", lambda c: c.get("mooncake_metadata_server")
    )
