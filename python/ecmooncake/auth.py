"""Where the per-user secret lives, resolved here because the library reads
no environment variables (a Go runtime sees only the environment its process
started with).

Without ``auth_secret``, ``auth_secret_file`` or ``allow_unauthenticated``,
every object this package opens gets ``auth_secret_dir``: the library then
creates ``DIR/secret`` on first use (0600, in a 0700 directory, 32 random
bytes in base64) and derives the control plane's CURVE keys from it, as from
a configured secret. Every process of this uid finds the same file; the
kernel keeps every other uid (root aside) out, so they are refused at the
handshake. The directory is ``$XDG_RUNTIME_DIR/ecmooncake`` when that is set
and belongs to this uid, else ``~/.cache/ecmooncake``.

This module imports nothing of the library, numpy or torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .environment import config_object

DIR_KEY = "auth_secret_dir"
# Any of these set means the caller chose: a deployment secret, or none.
CHOSEN = ("auth_secret", "auth_secret_file", DIR_KEY, "allow_unauthenticated")


def secret_dir() -> str:
    """The per-user secret's directory for this process."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        try:
            st = os.stat(runtime)
        except OSError:
            st = None
        # Someone else's runtime dir (a su without a login) is not ours to use.
        if st is not None and st.st_uid == os.geteuid():
            return os.path.join(runtime, "ecmooncake")
    return str(Path.home() / ".cache" / "ecmooncake")


def with_auth_default(config: Any) -> Any:
    """config with ``auth_secret_dir`` added unless it sets any auth key;
    a config that does not parse is left for the library to report."""
    parsed = config_object(config)
    if parsed is None or any(key in parsed for key in CHOSEN):
        return config
    return {**parsed, DIR_KEY: secret_dir()}


def describe(settings: dict) -> str:
    """The mode an object opened with settings runs in, as its startup line
    says it: configured secret, per-user secret at PATH, or unauthenticated."""
    settings = with_auth_default(settings)
    if settings.get("auth_secret") or settings.get("auth_secret_file"):
        return "configured secret"
    if settings.get(DIR_KEY) and not settings.get("allow_unauthenticated"):
        return f"per-user secret at {os.path.join(settings[DIR_KEY], 'secret')}"
    return "unauthenticated"
