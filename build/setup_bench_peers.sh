#!/usr/bin/env bash
# Opt-in: what `python -m ecmooncake bench-vllm --peers example,mooncake`
# needs beyond the default setup. The in-tree peer is vLLM's own
# ECMooncakeConnector on Mooncake's TransferEngine (PyPI's non-CUDA build,
# TCP protocol). The engine's library links libibverbs and libnl even when
# it only speaks TCP, so those Debian packages come first.
#
#   bash build/setup_bench_peers.sh [VENV]     (default: .venv-bench-peers)
#
# The environment sees the system site-packages (vLLM, torch, ecmooncake)
# and adds only the engine, so the two connectors run the same vLLM. Run
# the benchmark with VENV/bin/python. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
. build/apt.sh

venv=${1:-${ECMOONCAKE_BENCH_PEERS_VENV:-.venv-bench-peers}}
python=${PYTHON:-python3}
engine=mooncake-transfer-engine-non-cuda==0.3.13.post1

missing=()
for pkg in libibverbs1 libnl-3-200 libnl-route-3-200; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
apt_install "${missing[@]}"
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv" >&2
  "$python" -m venv --system-site-packages "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$engine"
"$venv/bin/python" -c 'from mooncake.engine import TransferEngine' \
  || { echo "setup: mooncake.engine does not import in $venv" >&2; exit 1; }
echo "setup: $engine in $venv; run: $venv/bin/python -m ecmooncake bench-vllm --peers example,mooncake" >&2
