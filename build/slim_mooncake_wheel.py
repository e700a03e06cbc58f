#!/usr/bin/env python3
"""Writes a copy of a Mooncake wheel that keeps only what its transfer engine
loads, for carrying to a GPU host whose uploads are bounded (64 MiB per
command; the CUDA 13 wheel alone is 49.7 MB).

Kept, byte for byte: mooncake/engine.so, every library it needs from the
wheel (followed through their own dependencies), every file that is not an
ELF binary (the Python modules, the dist-info). Left out: the binaries of
Mooncake Store, EP and PG and the tools (mooncake_master, mooncake_client,
transfer_engine_bench), which the transfer engine never loads. RECORD loses
the lines of the files left out, so the result installs with pip like the
original: ``pip install --no-index --no-deps --target DIR WHEEL``.

Usage: slim_mooncake_wheel.py IN.whl OUT_DIR (the same file name in OUT_DIR).
Needs readelf (binutils) on the build machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile

ROOT = "mooncake/engine.so"


def needed(path: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]").strip() for line in out.splitlines() if "(NEEDED)" in line]


def is_elf(data: bytes) -> bool:
    return data[:4] == b"\x7fELF"


def slim(src: str, out_dir: str) -> str:
    zin = zipfile.ZipFile(src)
    names = zin.namelist()
    elves = {n for n in names if not n.endswith("/") and is_elf(zin.open(n).read(4))}
    if ROOT not in elves:
        raise SystemExit(f"slim_mooncake_wheel: {src} has no {ROOT}")
    by_base: dict[str, str] = {}
    for n in elves:
        by_base.setdefault(os.path.basename(n), n)
    keep, todo = set(), [ROOT]
    with tempfile.TemporaryDirectory() as tmp:
        while todo:
            n = todo.pop()
            if n in keep:
                continue
            keep.add(n)
            path = zin.extract(n, tmp)
            todo.extend(by_base[lib] for lib in needed(path) if lib in by_base)
    drop = elves - keep
    os.makedirs(out_dir, exist_ok=True)
    dst = os.path.join(out_dir, os.path.basename(src))
    if os.path.abspath(dst) == os.path.abspath(src):
        raise SystemExit("slim_mooncake_wheel: OUT_DIR must not hold IN.whl")
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename in drop:
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if line.split(",", 1)[0] not in drop).encode()
            zout.writestr(info, data)
    print(f"slim_mooncake_wheel: kept {len(keep)} of {len(elves)} binaries ({', '.join(sorted(keep))});")
    print(f"  left out: {', '.join(sorted(drop))}")
    print(f"  {os.path.getsize(src) / 1e6:.1f} MB -> {os.path.getsize(dst) / 1e6:.1f} MB: {dst}")
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    slim(sys.argv[1], sys.argv[2])
