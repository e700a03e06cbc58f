"""The library's settings schema: every key of every native object, with
its kind, default, range, choices and help.

The schema is written once, in Go (core/config/schema.go), and checked in
beside this module as ``settings.json`` by ``go generate ./core/config``; a
Go test fails when the file is stale. Reading the file, not asking the
library, keeps the library unloaded until a native object is opened (vLLM
imports this package in processes that fork).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).resolve().with_name("settings.json")
SCHEMA_VERSION = 1
# The objects of the schema; "runtime" is what configure() takes.
OBJECTS = ("consumer", "producer", "scheduler", "runtime", "store")


class SchemaError(RuntimeError):
    """settings.json is missing or not the shape this package reads."""


@functools.lru_cache(maxsize=1)
def document() -> dict[str, Any]:
    try:
        doc = json.loads(SCHEMA_FILE.read_text())
    except (OSError, ValueError) as exc:
        raise SchemaError(f"cannot read the settings schema {SCHEMA_FILE}: {exc}; reinstall the package") from exc
    if doc.get("version") != SCHEMA_VERSION:
        raise SchemaError(
            f"{SCHEMA_FILE} has schema version {doc.get('version')!r}, this package reads {SCHEMA_VERSION}"
        )
    return doc


@functools.lru_cache(maxsize=None)
def settings(obj: str) -> dict[str, dict[str, Any]]:
    """The settings of one object by key."""
    if obj not in OBJECTS:
        raise KeyError(f"no settings object {obj!r}; want one of {', '.join(OBJECTS)}")
    return {s["key"]: s for s in document()["settings"] if s["object"] == obj}


def setting(obj: str, key: str) -> dict[str, Any]:
    try:
        return settings(obj)[key]
    except KeyError:
        raise KeyError(f"the {obj} settings have no key {key!r} (see core/config/schema.go)") from None


def secret_rules() -> dict[str, Any]:
    """min_len, min_distinct and fix: what a secret must be."""
    return document()["secret"]
