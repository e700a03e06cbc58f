#!/usr/bin/env python3
"""Builds the test double of Mooncake TransferEngine's C API.

    python build/build_mooncake_double.py [--out DIR]

Compiles core/transport/mooncake/testdata/transfer_engine_double.c with the
system C compiler into DIR/libtransfer_engine.so (default: build/out/), a
stand-in for a real Mooncake build that the `mooncake` transport loads
through mooncake_library or ECMOONCAKE_MOONCAKE_LIBRARY. The Python tests
build it this way; the Go tests build it themselves. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "core" / "transport" / "mooncake" / "testdata" / "transfer_engine_double.c"
DEFAULT_OUT = ROOT / "build" / "out"
LIBRARY_NAME = "libtransfer_engine.so"


class BuildError(RuntimeError):
    pass


def build(out_dir: Path | str = DEFAULT_OUT, name: str = LIBRARY_NAME, omit_free_batch_id: bool = False) -> Path:
    """Compiles the double into out_dir/name and returns its path.

    With omit_free_batch_id the library lacks freeBatchID, as a library of
    the wrong kind would."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc.split()[0]) is None:
        raise BuildError(f"no C compiler ('{cc}') to build the Mooncake test double (Debian/Ubuntu: apt-get install gcc)")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / name
    cmd = [*cc.split(), "-shared", "-fPIC", "-O2", "-pthread", "-o", str(target), str(SOURCE)]
    if omit_free_batch_id:
        cmd.append("-DMCD_OMIT_FREEBATCHID")
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="directory for the library (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        print(build(args.out))
    except BuildError as exc:
        print(f"build_mooncake_double: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
