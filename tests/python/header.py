"""Reads include/ecmooncake.h: its functions with their parameter types, and
its ECM_* constants."""

from __future__ import annotations

import re
from ctypes import POINTER, c_char_p, c_int, c_int32, c_uint64, c_void_p
from dataclasses import dataclass
from pathlib import Path

HEADER = Path(__file__).resolve().parents[2] / "include" / "ecmooncake.h"

# How each C type of the header is declared in _ffi.py. String out-params
# (char **) are void ** there so that the pointer can be handed to ecm_free,
# and ecm_free itself takes the pointer as void *.
C_TO_CTYPES = {
    "int": c_int,
    "void": None,
    "int32_t": c_int32,
    "uint64_t": c_uint64,
    "ecm_handle_t": c_uint64,
    "const char*": c_char_p,
    "const char**": POINTER(c_char_p),
    "void**": POINTER(c_void_p),
    "const uint64_t*": POINTER(c_uint64),
    "const int32_t*": POINTER(c_int32),
    "char*": c_void_p,
    "void*": c_void_p,
    "const void*": c_void_p,
    "char**": POINTER(c_void_p),
    "int32_t*": POINTER(c_int32),
    "uint64_t*": POINTER(c_uint64),
    "ecm_handle_t*": POINTER(c_uint64),
}


@dataclass
class Param:
    ctype: str
    name: str
    decl: str


@dataclass
class Function:
    name: str
    returns: str
    params: list[Param]


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def _param(decl: str) -> Param:
    """Splits "const char *const *names" into ("const char**", "names").

    A const after a star qualifies the pointer itself, which does not change
    how the argument is passed, so it is dropped."""
    tokens = decl.replace("*", " * ").split()
    name = tokens.pop()
    stars = tokens.count("*")
    first_star = tokens.index("*") if stars else len(tokens)
    return Param(" ".join(tokens[:first_star]) + "*" * stars, name, " ".join(decl.split()))


def functions(text: str | None = None) -> list[Function]:
    """Every ecm_* function declared in the header, in order."""
    body = _strip_comments(HEADER.read_text() if text is None else text)
    found = []
    for m in re.finditer(r"\b(int|void)\s+(ecm_\w+)\s*\(([^)]*)\)\s*;", body):
        params = [p.strip() for p in m.group(3).split(",")]
        params = [] if params == ["void"] else [_param(p) for p in params]
        found.append(Function(m.group(2), m.group(1), params))
    return found


def constants(text: str | None = None) -> dict[str, int]:
    body = _strip_comments(HEADER.read_text() if text is None else text)
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"#define\s+(ECM_\w+)\s+(-?\d+)\b", body)}
