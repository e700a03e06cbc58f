"""Settings Python reads from the environment and passes to the library as
keys: Go reads no environment variables (it sees only the environment the
process started with, not what Python set later)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable


MOONCAKE_LIBRARY_ENV = "ECMOONCAKE_MOONCAKE_LIBRARY"


def with_mooncake_library(config: Any) -> Any:
    """Fills ``mooncake_library`` from $ECMOONCAKE_MOONCAKE_LIBRARY.

    Only for an object whose ``transport`` is ``"mooncake"`` and whose
    settings leave the key out. Go reads no environment variables (it sees
    only the environment the process started with), so Python passes the
    path down as a setting. Anything else is returned unchanged.
    """
    return _fill_from_env(
        config, MOONCAKE_LIBRARY_ENV, "mooncake_library", lambda c: c.get("transport") == "mooncake"
    )


def _fill_from_env(config: Any, env: str, key: str, applies: Callable[[dict], Any]) -> Any:
    """config with key set from $env, where applies(config) and the key is
    not given; a config that does not parse is left for the library to
    report."""
    value = os.environ.get(env)
    if not value:
        return config
    parsed = config
    if isinstance(config, (str, bytes)):
        try:
            parsed = json.loads(config)
        except ValueError:
            return config
    if not isinstance(parsed, dict) or not applies(parsed) or key in parsed:
        return config
    return {**parsed, key: value}


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
