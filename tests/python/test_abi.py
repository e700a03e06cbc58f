"""The header, the library's exports and _ffi.py's prototypes must agree."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

import header
from ecmooncake import _ffi


def exported_symbols(path) -> set[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.fail("nm (binutils) is needed to read the library's dynamic symbols")
    out = subprocess.run(
        [nm, "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    names = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 3:
            names.add(f"{fields[2]} ({fields[1]})")
    return names


def test_header_parses():
    names = [f.name for f in header.functions()]
    assert "ecm_abi_version" in names and "ecm_free" in names
    assert len(names) == len(set(names))


def test_prototypes_mirror_header():
    declared = header.functions()
    assert [f.name for f in declared] == list(_ffi.PROTOTYPES), "same functions, same order"
    for fn in declared:
        restype, argtypes = _ffi.PROTOTYPES[fn.name]
        want_args = tuple(header.C_TO_CTYPES[p.ctype] for p in fn.params)
        assert restype is header.C_TO_CTYPES[fn.returns], fn.name
        assert argtypes == want_args, f"{fn.name}: _ffi has {argtypes}, header says {[p.ctype for p in fn.params]}"


def test_every_status_takes_an_error_out_param():
    for fn in header.functions():
        if fn.returns == "int":
            assert fn.params[-1].ctype == "char**" and fn.params[-1].name == "err", fn.name


def test_constants_match():
    consts = header.constants()
    assert consts.pop("ECM_ABI_VERSION") == _ffi.ABI_VERSION
    assert consts, "the header defines status codes"
    for name, value in consts.items():
        assert getattr(_ffi, name) == value, name


def test_library_exports_match_header(library):
    # Every symbol the library defines for the dynamic linker is one of the
    # header's functions: the Go halves behind the fork gate (ecmgo_*) and
    # the runtime stay local (export/ecmooncake.map), so that no caller can
    # enter the Go runtime without passing the gate.
    assert exported_symbols(library) == {f"{f.name} (T)" for f in header.functions()}


def test_library_speaks_this_abi(library):
    assert _ffi.lib() is _ffi.lib()
    version = ctypes.c_int32(-1)
    err = ctypes.c_void_p()
    lib = _ffi.lib()
    assert lib.ecm_abi_version(ctypes.byref(version), ctypes.byref(err)) == _ffi.ECM_OK
    assert err.value is None
    assert version.value == _ffi.ABI_VERSION
