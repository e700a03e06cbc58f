"""The Python package's settings against the library's schema
(settings.json, generated from core/config/schema.go): every key the
connector sends exists there with the same default and the same bounds, and
docs/settings.md's table documents every key with its default."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ecmooncake import ec_config, schema
from ecmooncake.ec_config import EXTRA_KEYS, TARGET_OBJECTS, ConfigError

ROOT = Path(__file__).resolve().parents[2]


def native_keys():
    return [(k, s) for k, s in EXTRA_KEYS.items() if s.targets]


def test_schema_file_is_readable_without_the_library():
    doc = schema.document()
    assert doc["version"] == schema.SCHEMA_VERSION
    assert {s["object"] for s in doc["settings"]} == set(schema.OBJECTS)
    assert schema.setting("producer", "tcp_conns")["min"] == 1


@pytest.mark.parametrize("key,spec", native_keys(), ids=[k for k, _ in native_keys()])
def test_every_extra_key_is_in_the_schema_of_every_object_it_goes_to(key, spec):
    for target in spec.targets:
        entry = schema.setting(TARGET_OBJECTS[target], key)
        if spec.default is not None:
            assert spec.default == entry["default"], f"{key} on {target}"
            assert type(spec.default) is type(entry["default"]) or isinstance(entry["default"], (int, float))


def _check(key, value):
    return EXTRA_KEYS[key].check(f"ec_connector_extra_config.{key}", value)


@pytest.mark.parametrize("key,spec", native_keys(), ids=[k for k, _ in native_keys()])
def test_every_extra_key_accepts_and_refuses_what_the_library_does(key, spec):
    entry = schema.setting(TARGET_OBJECTS[spec.targets[0]], key)
    kind = entry["kind"]
    if kind == "int":
        lo, hi = int(entry["min"]), int(entry["max"])
        assert _check(key, lo) == lo and _check(key, hi) == hi
        for bad in (lo - 1, hi + 1, lo + 0.5, True, "x"):
            with pytest.raises(ConfigError, match=key):
                _check(key, bad)
    elif kind == "seconds":
        assert _check(key, entry["max"]) == entry["max"]
        for bad in (0, -1, entry["max"] * 1.001, float("inf"), "soon"):
            with pytest.raises(ConfigError, match=key):
                _check(key, bad)
    elif kind == "enum":
        for choice in entry["choices"]:
            assert _check(key, choice) == choice
        with pytest.raises(ConfigError, match=key):
            _check(key, "no-such-" + key)
    elif kind == "host":
        assert _check(key, "::1") == "::1"
        with pytest.raises(ConfigError, match=key):
            _check(key, "a b")
        if entry["default"] == "":
            assert _check(key, "") == ""
        else:
            with pytest.raises(ConfigError, match=key):
                _check(key, "")
    elif kind == "bool":
        assert _check(key, True) is True
        with pytest.raises(ConfigError, match=key):
            _check(key, "yes")
    elif kind in ("text", "path", "secret"):
        with pytest.raises(ConfigError, match=key):
            _check(key, 3)
    else:
        pytest.fail(f"{key}: kind {kind!r} has no check here")


def test_secret_rules_are_the_librarys():
    rules = schema.secret_rules()
    assert (ec_config.MIN_SECRET_LEN, ec_config.MIN_SECRET_DISTINCT) == (rules["min_len"], rules["min_distinct"])
    with pytest.raises(ConfigError, match="at least"):
        ec_config.secret("auth_secret", "abcdefghij"[: rules["min_len"] - 1])


def shown(value) -> str:
    """A default as docs/settings.md's table writes it in code."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def library_table() -> dict[tuple[str, str], str]:
    """(object, key) -> the default cell, from docs/settings.md's table."""
    text = (ROOT / "docs" / "settings.md").read_text()
    section = text
    objects = {"all three": ("consumer", "producer", "scheduler"), "process": ("runtime",)}
    rows: dict[tuple[str, str], str] = {}
    for obj_cell, key_cell, default_cell in re.findall(r"^\| ([a-z ,]+) \| (`[^|]+) \| ((?:[^|\\]|\\.)*) \|", section, flags=re.M):
        keys = re.findall(r"`([a-z_]+)`", key_cell)
        defaults = re.findall(r"`([^`]*)`", default_cell)
        names = objects.get(obj_cell, tuple(o.strip() for o in obj_cell.split(",")))
        for i, key in enumerate(keys):
            cell = f"`{defaults[i]}`" if len(defaults) == len(keys) and len(keys) > 1 else default_cell.strip()
            for obj in names:
                assert (obj, key) not in rows, f"{obj} {key} is documented twice"
                rows[(obj, key)] = cell
    return rows


def test_readme_documents_every_library_setting_with_its_default():
    rows = library_table()
    settings = [s for s in schema.document()["settings"] if s["kind"] != "removed"]
    missing = sorted(f"{s['object']} {s['key']}" for s in settings if (s["object"], s["key"]) not in rows)
    assert not missing, f"docs/settings.md lacks {missing}"
    known = {(s["object"], s["key"]) for s in schema.document()["settings"]}
    assert not set(rows) - known, f"docs/settings.md documents settings the library does not have: {sorted(set(rows) - known)}"
    for s in settings:
        cell = rows[(s["object"], s["key"])]
        if cell == "as consumer":
            want = schema.setting("consumer", s["key"])["default"]
            assert s["default"] == want, f"{s['object']} {s['key']}: 'as consumer', but {s['default']!r} != {want!r}"
            continue
        code = re.match(r"`([^`]*)`", cell)
        if code:
            assert code.group(1) == shown(s["default"]), f"{s['object']} {s['key']}: docs/settings.md says {cell!r}, the library {s['default']!r}"
        else:
            # Words (hostname, derived, (empty)) stand for a default the library derives.
            assert s["default"] in ("", [], {}), f"{s['object']} {s['key']}: docs/settings.md says {cell!r}, the library {s['default']!r}"
