#!/usr/bin/env bash
# The GPU proof run, in two halves:
#
#   bash build/gpu_run.sh pack        on the CPU build machine: puts what a
#                                     GPU host lacks into .artifacts/ (the
#                                     manylinux wheel of build/wheel.sh,
#                                     with the library, ecm-ceiling and
#                                     libzmq with what it loads inside; the
#                                     Go test binary of core/cuda)
#   bash build/gpu_run.sh run [DIR]   on a host with a GPU, from a copy of the
#                                     working tree plus .artifacts/: installs
#                                     the wheel into .artifacts/site (pip
#                                     --target, no index), then the Go
#                                     GPU tests, the Python GPU tests (the
#                                     connector's with CUDA tensors too), the
#                                     GPU benchmark (its cuda_ipc phases with
#                                     their per-phase breakdown and targets)
#                                     and the connector benchmark;
#                                     logs and JSON go to DIR; a summary
#                                     table comes last.
#   bash build/gpu_run.sh tcp [DIR]   on the same host, the TCP figures and
#                                     their ceilings: the TCP ceiling alone,
#                                     `python -m ecmooncake bench` and `demo`
#                                     (host memory) and the gpubench TCP
#                                     phases, each ratio to a ceiling taken
#                                     in the same run; a step fails when a
#                                     ratio is above 1.02 (the ceiling was
#                                     not one).
#   bash build/gpu_run.sh mooncake [DIR]
#                                     on the same host, GPU memory over the
#                                     `mooncake` transport with Mooncake's
#                                     CUDA 13 wheel, carried in .whl/
#                                     (bash build/gpu_run.sh fetch-mooncake
#                                     puts it there): installs it next to
#                                     ours (pip --target, no index), then,
#                                     in a network namespace of its own when
#                                     root (loopback and a veth pair, as
#                                     Mooncake advertises the first interface
#                                     that is not loopback): the GPU tests of
#                                     tests/python/test_gpu_mooncake.py
#                                     (shard and producer processes, GPU slab
#                                     and CUDA sources, 4 KiB..128 MiB
#                                     bit-exact, a producer killed mid-write,
#                                     a shard restarted), the engine's own
#                                     GPU -> GPU transfer of the same bytes
#                                     (the ceiling) and the connector
#                                     bench's mooncake rows, each a ratio to
#                                     the ceiling.
#
# The GPU host needs python3 with pip, PyTorch (CUDA), numpy and pytest,
# glibc 2.35 or newer (the wheel's manylinux_2_35 tag: Ubuntu 22.04 and
# later) and libcuda.so.1 on the loader path; no Go, no libzmq, no network.
# The wheel never carries the build machine's libstdc++ or libgcc_s:
# PyTorch needs the host's newer ones. Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ART=${ECM_ARTIFACTS:-$PWD/.artifacts}
SITE="$ART/site"

pack() {
	set -e
	mkdir -p "$ART"
	# What earlier packs copied by hand, so that nothing loose is loaded.
	rm -f "$ART"/libecmooncake.so "$ART"/libecmooncake_mooncake.so "$ART"/ecm-ceiling \
		"$ART"/libzmq.so.5 "$ART"/libsodium.so.23 "$ART"/libpgm-5.3.so.0 "$ART"/libnorm.so.1 "$ART"/libbsd.so.0 "$ART"/libmd.so.0
	rm -rf "$SITE" "$ART/mooncake-site"
	bash build/wheel.sh "$ART" >/dev/null
	CGO_ENABLED=1 go test -c -o "$ART/cuda.test" ./core/cuda
	CGO_ENABLED=1 go test -c -o "$ART/cudaipc.test" ./core/transport/cudaipc
	ls -l "$ART"
}

# install puts the packed wheel into $SITE, as pip would on any host: no
# index, no dependencies (the host's numpy and PyTorch are used).
install() {
	local wheels=("$ART"/ecmooncake-*.whl)
	[ -f "${wheels[0]}" ] || { echo "gpu_run: no ecmooncake wheel in $ART: run 'bash build/gpu_run.sh pack' on the build machine" >&2; return 1; }
	[ "${#wheels[@]}" = 1 ] || { echo "gpu_run: more than one wheel in $ART: ${wheels[*]}" >&2; return 1; }
	python3 -m pip install -q --no-index --no-deps --upgrade --target "$SITE" "${wheels[0]}" || return 1
	export ECMOONCAKE_LIBRARY="$SITE/ecmooncake/libecmooncake.so" ECMOONCAKE_CEILING="$SITE/ecmooncake/ecm-ceiling"
	export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
	echo "== installed ${wheels[0]##*/} into $SITE"
}

declare -a NAMES RESULTS DETAILS

record() { NAMES+=("$1"); RESULTS+=("$2"); DETAILS+=("$3"); }

# summary prints every recorded step's result.
summary() {
	echo
	echo "== summary ($(date -u +%Y-%m-%dT%H:%MZ))"
	printf '%-20s %-6s %s\n' step result detail
	for i in "${!NAMES[@]}"; do
		printf '%-20s %-6s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${DETAILS[$i]}"
	done
}

run() {
	local out=${1:-/tmp/ecm-gpu-run} rc=0 log
	mkdir -p "$out"
	install || return 1
	export PYTHONUNBUFFERED=1

	echo "== host"
	nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
	python3 -c 'import torch, numpy; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(), "numpy", numpy.__version__)'
	if ldd "$ECMOONCAKE_LIBRARY" | grep "not found"; then
		record "library loads" FAIL "missing libraries (above)"
		rc=1
	else
		record "library loads" PASS "$(python3 -c 'from ecmooncake import gpu_info; print(gpu_info())')"
	fi

	echo "== go: core/cuda against the driver"
	log="$out/go_cuda.log"
	(cd core/cuda && "$ART/cuda.test" -test.v -test.count=1) 2>&1 | tee "$log"
	local go_rc=${PIPESTATUS[0]}
	record "go test core/cuda" "$([ "$go_rc" = 0 ] && echo PASS || echo FAIL)" \
		"$(grep -c -- '^--- PASS' "$log") passed, $(grep -c -- '^--- SKIP' "$log") skipped, $(grep -c -- '^--- FAIL' "$log") failed"
	[ "$go_rc" = 0 ] || rc=1

	# cuda_ipc's ready words on the real driver: a shard in a child
	# process, the producer's GPU storing each word after its copies.
	echo "== go: cuda_ipc ready words against the driver"
	log="$out/go_cudaipc.log"
	(cd core/transport/cudaipc && ECM_TEST_REAL_GPU=1 "$ART/cudaipc.test" -test.v -test.count=1 -test.run RealGPU) 2>&1 | tee "$log"
	go_rc=${PIPESTATUS[0]}
	record "go test cudaipc (real GPU)" "$([ "$go_rc" = 0 ] && grep -q -- '^--- PASS' "$log" && echo PASS || echo FAIL)" \
		"$(grep -c -- '^--- PASS' "$log") passed, $(grep -c -- '^--- SKIP' "$log") skipped, $(grep -c -- '^--- FAIL' "$log") failed"
	[ "$go_rc" = 0 ] || rc=1

	echo "== pytest: GPU transfers and the ABI"
	log="$out/pytest.log"
	python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_gpu_transfer.py tests/python/test_two_gpu_transfer.py \
		tests/python/test_gpu_api.py tests/python/test_abi.py tests/python/test_connector_gpu.py 2>&1 | tee "$log"
	local py_rc=${PIPESTATUS[0]}
	record "pytest GPU" "$([ "$py_rc" = 0 ] && echo PASS || echo FAIL)" "$(grep -E '(passed|failed|error)' "$log" | tail -1)"
	[ "$py_rc" = 0 ] || rc=1

	echo "== gpubench"
	log="$out/bench.log"
	python3 -m ecmooncake gpubench --json "$out/bench.json" 2>&1 | tee "$log"
	local bench_rc=${PIPESTATUS[0]}
	record "gpubench" "$([ "$bench_rc" = 0 ] && echo PASS || echo FAIL)" "figures below; JSON in $out/bench.json"
	[ "$bench_rc" = 0 ] || rc=1
	if [ -f "$out/bench.json" ]; then
		# A measurement, not a test: a missed target is reported, not failed.
		local targets
		targets=$(python3 - "$out/bench.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1])).get("targets", [])
met = sum(1 for x in t if x["met"])
parts = ["%s %.2f %s" % (x["name"], x["value"], x["bound"]) for x in t]
print("%d of %d met: %s" % (met, len(t), "; ".join(parts)))
PY
)
		record "cuda_ipc targets" "$(echo "$targets" | grep -q '^\([0-9]*\) of \1 met' && echo MET || echo MISSED)" "$targets"
	fi
	if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
		echo "== gpubench across two GPUs"
		python3 -m ecmooncake gpubench --producer-device cuda:0 --consumer-device cuda:1 \
			--json "$out/bench2.json" 2>&1 | tee "$out/bench2.log"
		bench_rc=${PIPESTATUS[0]}
		record "gpubench 0->1" "$([ "$bench_rc" = 0 ] && echo PASS || echo FAIL)" "figures below; JSON in $out/bench2.json"
		[ "$bench_rc" = 0 ] || rc=1
	fi

	echo "== connector bench: save_caches to the PD's encoder_cache, through the connector's hooks"
	log="$out/connector_bench.log"
	python3 -m ecmooncake.tools.connector_gpu --json "$out/connector_bench.json" 2>&1 | tee "$log"
	bench_rc=${PIPESTATUS[0]}
	record "connector bench" "$([ "$bench_rc" = 0 ] && echo PASS || echo FAIL)" "figures below; JSON in $out/connector_bench.json"
	[ "$bench_rc" = 0 ] || rc=1

	summary
	sed -n '/^ecmooncake connector GPU bench/,$p' "$log"
	sed -n '/^ecmooncake GPU bench/,$p' "$out/bench.log"
	[ -f "$out/bench2.log" ] && sed -n '/^ecmooncake GPU bench/,$p' "$out/bench2.log"
	return $rc
}

# The Mooncake wheel the mooncake step installs: the CUDA 13 build, as the
# GPU host's PyTorch is CUDA 13.
MOONCAKE_WHEEL=${ECM_MOONCAKE_WHEEL:-mooncake-transfer-engine-cuda13==0.3.14}
WHL=${ECM_WHEELS:-$PWD/.whl}

# fetch_mooncake downloads the wheel for the GPU host (cp312, manylinux
# x86_64), on the build machine, and writes into .whl/ the copy of it that
# is carried: its transfer engine only (build/slim_mooncake_wheel.py; the
# whole wheel, 49.7 MB, would not fit one upload beside .artifacts/).
fetch_mooncake() {
	local tmp
	tmp=$(mktemp -d /tmp/ecm-mooncake-wheel.XXXXXX) || return 1
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_35_x86_64 -d "$tmp" "$MOONCAKE_WHEEL" || { rm -rf "$tmp"; return 1; }
	rm -f "$WHL"/mooncake_transfer_engine*.whl
	python3 build/slim_mooncake_wheel.py "$tmp"/mooncake_transfer_engine*.whl "$WHL"
	local rc=$?
	rm -rf "$tmp"
	ls -l "$WHL"
	return $rc
}

mooncake() {
	local out=${1:-/tmp/ecm-mooncake-run} rc=0
	mkdir -p "$out"
	out=$(cd "$out" && pwd)
	install || return 1
	local wheels=("$WHL"/mooncake_transfer_engine*.whl)
	[ -f "${wheels[0]}" ] || { echo "gpu_run: no Mooncake wheel in $WHL: run 'bash build/gpu_run.sh fetch-mooncake' on the build machine and carry .whl" >&2; return 1; }
	[ "${#wheels[@]}" = 1 ] || { echo "gpu_run: more than one Mooncake wheel in $WHL: ${wheels[*]}" >&2; return 1; }
	python3 -m pip install -q --no-index --no-deps --upgrade --target "$ART/mooncake-site" "${wheels[0]}" || return 1
	export PYTHONPATH="$ART/mooncake-site:$PYTHONPATH" PYTHONUNBUFFERED=1
	echo "== installed ${wheels[0]##*/} into $ART/mooncake-site"
	# The tests import this tree's python/ (tests/python/conftest.py), whose
	# package looks for the shim beside itself: the wheel's, built here.
	cp -f "$SITE/ecmooncake/libecmooncake_mooncake.so" python/ecmooncake/ || return 1
	if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null && [ -z "${ECM_IN_NETNS:-}" ]; then
		echo "== in a network namespace of its own: loopback and a veth pair on 10.231.0.1/24"
		ECM_IN_NETNS=1 unshare --net bash -c '
			ip link set lo up && ip link add ecm0 type veth peer name ecm1 && ip addr add 10.231.0.1/24 dev ecm0 &&
			ip link set ecm0 up && ip link set ecm1 up || exit 1
			exec bash "$0" mooncake-steps "$1"' build/gpu_run.sh "$out"
		return $?
	fi
	echo "== in the host's network namespace (not root, or no unshare/ip): the engines may advertise a non-loopback address"
	mooncake_steps "$out"
}

# mooncake_steps runs the mooncake step's measurements, the wheel installed.
mooncake_steps() {
	local out=$1 rc=0 log step_rc
	echo "== host"
	nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
	ip -brief addr 2>/dev/null || true
	python3 -c 'import json; from ecmooncake import native; print(json.dumps(native.mooncake_info(), indent=1))' 2>&1 | tee "$out/mooncake_info.json"

	echo "== go: core/cuda (AllocDevice, the GPU staging slab's memory)"
	(cd core/cuda && "$ART/cuda.test" -test.v -test.count=1 -test.run 'AllocDevice|CopiesRoundTrip') 2>&1 | tee "$out/go_cuda.log"
	step_rc=${PIPESTATUS[0]}
	if grep -q -- '^--- SKIP' "$out/go_cuda.log"; then step_rc=1; fi
	record "go AllocDevice" "$([ "$step_rc" = 0 ] && echo PASS || echo FAIL)" "$(grep -c -- '^--- PASS' "$out/go_cuda.log") passed, $(grep -c -- '^--- SKIP' "$out/go_cuda.log") skipped"
	[ "$step_rc" = 0 ] || rc=1

	echo "== pytest: mooncake GPU -> GPU, shard and producer processes"
	log="$out/pytest_mooncake.log"
	timeout 240 python3 -m pytest -q -s -p no:cacheprovider -rs tests/python/test_gpu_mooncake.py 2>&1 | tee "$log"
	step_rc=${PIPESTATUS[0]}
	# A skip is a failure here: this step exists to run them.
	if grep -q -E '[0-9]+ skipped' "$log"; then step_rc=1; fi
	record "pytest mooncake GPU" "$([ "$step_rc" = 0 ] && echo PASS || echo FAIL)" "$(grep -E '(passed|failed|error|skipped)' "$log" | tail -1)"
	[ "$step_rc" = 0 ] || rc=1
	# The library's own logs (log_level info) say which memory each end
	# registered: the producer's GPU staging, the shard's GPU slab.
	local staging slabs
	staging=$(grep -c 'mooncake GPU staging registered' "$log")
	slabs=$(grep 'mooncake engine serving the slab' "$log" | grep -c 'cuda:0')
	record "mooncake GPU memory" "$([ "$staging" -gt 0 ] && [ "$slabs" -gt 0 ] && echo PASS || echo FAIL)" \
		"GPU staging registered by $staging producer(s), GPU slab by $slabs shard(s) (the logs above)"
	[ "$staging" -gt 0 ] && [ "$slabs" -gt 0 ] || rc=1

	echo "== the engine's own GPU -> GPU transfer (the ceiling), and registering against copying"
	log="$out/mooncake_ceiling.log"
	timeout 120 python3 -m ecmooncake.tools.mooncake_gpu --reps 5 --json "$out/mooncake_ceiling.json" 2>&1 | tee "$log"
	step_rc=${PIPESTATUS[0]}
	record "mooncake ceiling" "$([ "$step_rc" = 0 ] && echo PASS || echo FAIL)" "$([ "$step_rc" = 0 ] && echo "JSON in $out/mooncake_ceiling.json" || echo "exit $step_rc, log $log")"
	[ "$step_rc" = 0 ] || rc=1

	echo "== connector bench, mooncake: save_caches -> the PD's encoder_cache, GPU -> GPU"
	log="$out/connector_mooncake.log"
	timeout 180 python3 -m ecmooncake.tools.connector_gpu --paths mooncake --reps 5 --json "$out/connector_mooncake.json" 2>&1 | tee "$log"
	step_rc=${PIPESTATUS[0]}
	record "connector mooncake" "$([ "$step_rc" = 0 ] && echo PASS || echo FAIL)" "$([ "$step_rc" = 0 ] && echo "JSON in $out/connector_mooncake.json" || echo "exit $step_rc, log $log")"
	[ "$step_rc" = 0 ] || rc=1

	summary
	if [ -f "$out/connector_mooncake.json" ] && [ -f "$out/mooncake_ceiling.json" ]; then
		python3 -m ecmooncake.tools.mooncake_gpu --compare "$out/connector_mooncake.json" "$out/mooncake_ceiling.json"
	fi
	return $rc
}

tcp() {
	local out=${1:-/tmp/ecm-tcp-run} rc=0 log step
	mkdir -p "$out"
	install || return 1
	export PYTHONUNBUFFERED=1
	echo "== host: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
	# name, then the command; its log is $out/name.log
	for step in \
		"ceiling|python3 -m ecmooncake ceiling --gomaxprocs 2 --conns 4" \
		"bench|python3 -m ecmooncake bench --quiet" \
		"demo|python3 -m ecmooncake demo --quiet" \
		"gpubench-tcp|python3 -m ecmooncake gpubench --quiet --phases tcp-4m,tcp-32m,tcp-32m-stream,tcp-64k --json $out/gpubench-tcp.json"; do
		local name=${step%%|*} cmd=${step#*|}
		log="$out/$name.log"
		echo "== $name: $cmd"
		bash -c "$cmd" 2>&1 | tee "$log"
		local step_rc=${PIPESTATUS[0]}
		if [ "$step_rc" != 0 ]; then
			record "$name" FAIL "exit $step_rc"
			rc=1
		elif grep -q 'CEILING EXCEEDED' "$log"; then
			record "$name" FAIL "a ratio above 1.02: $(grep -m1 -o '[a-z0-9 -]*: [0-9.]* of its ceiling' "$log")"
			rc=1
		else
			record "$name" PASS "every ratio within its ceiling"
		fi
	done
	summary
	return $rc
}

case "${1:-run}" in
pack) pack ;;
run) shift; run "$@" ;;
tcp) shift; tcp "$@" ;;
fetch-mooncake) fetch_mooncake ;;
mooncake) shift; mooncake "$@" ;;
# inside mooncake's network namespace, with the environment it set
mooncake-steps) shift; mooncake_steps "$@" ;;
*) echo "usage: $0 pack | run [DIR] | tcp [DIR] | fetch-mooncake | mooncake [DIR]" >&2; exit 2 ;;
esac
