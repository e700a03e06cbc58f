#!/usr/bin/env bash
# Runs every test: go vet, the Go tests under the race detector, each fuzz
# target briefly, and the Python tests against the freshly built library.
set -euo pipefail
cd "$(dirname "$0")/.."
bash build/setup.sh

python=${PYTHON:-python3}
# A budget of executions, not of seconds: with a duration, Go 1.26's fuzz
# coordinator can report its own deadline as the target's failure
# ("context deadline exceeded", no failing input) when a loaded machine
# keeps a worker from stopping in time (golang/go#75804, fixed in 1.27).
# 20,000 executions take 1-8 s per target on the 2-core build machine.
fuzztime=${FUZZTIME:-20000x}

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
# One fuzz target: any failure fails the run; one that wrote a failing
# input under testdata/fuzz says where it is.
inputs_of() {
  if [ -d "$1/testdata/fuzz/$2" ]; then find "$1/testdata/fuzz/$2" -type f | wc -l; else echo 0; fi
}
fuzz_one() {
  local pkg=$1 target=$2 out before
  before=$(inputs_of "$pkg" "$target")
  if out=$(go test -run=NONE -fuzz="^${target}\$" -fuzztime="$fuzztime" "./$pkg" 2>&1); then
    return 0
  fi
  echo "$out" | tail -30 >&2
  if [ "$(inputs_of "$pkg" "$target")" != "$before" ]; then
    echo "fuzz: $pkg $target found a failing input (see $pkg/testdata/fuzz/$target)" >&2
  fi
  return 1
}
echo "== fuzz (${fuzztime} each)" >&2
grep -rl --include='*_test.go' '^func Fuzz' core capi tests/go 2>/dev/null | xargs -r -n1 dirname | sort -u |
  while read -r pkg; do
    for target in $(grep -h '^func Fuzz' "$pkg"/*_test.go | sed -E 's/^func (Fuzz[A-Za-z0-9_]*).*/\1/'); do
      echo "   $pkg $target" >&2
      fuzz_one "$pkg" "$target"
    done
  done
echo "== pytest" >&2
require_vllm=1
[ "${ECMOONCAKE_SKIP_VLLM:-0}" = 1 ] && require_vllm=0
ECMOONCAKE_REQUIRE_LIB=1 ECMOONCAKE_REQUIRE_VLLM=$require_vllm "$python" -m pytest -q tests/python
