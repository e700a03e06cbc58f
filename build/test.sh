#!/usr/bin/env bash
# Runs every test: go vet, the Go tests under the race detector, each fuzz
# target briefly, and the Python tests against the freshly built library.
set -euo pipefail
cd "$(dirname "$0")/.."
bash build/setup.sh

python=${PYTHON:-python3}
fuzztime=${FUZZTIME:-5s}

echo "== go vet" >&2
go vet ./...
echo "== go test -race" >&2
go test -race -count=1 -timeout 20m ./...
echo "== fuzz (${fuzztime} each)" >&2
grep -rl --include='*_test.go' '^func Fuzz' core capi tests/go 2>/dev/null | xargs -r -n1 dirname | sort -u |
  while read -r pkg; do
    for target in $(grep -h '^func Fuzz' "$pkg"/*_test.go | sed -E 's/^func (Fuzz[A-Za-z0-9_]*).*/\1/'); do
      echo "   $pkg $target" >&2
      go test -run=NONE -fuzz="^${target}\$" -fuzztime="$fuzztime" "./$pkg" >/dev/null
    done
  done
echo "== pytest" >&2
require_vllm=1
[ "${ECMOONCAKE_SKIP_VLLM:-0}" = 1 ] && require_vllm=0
ECMOONCAKE_REQUIRE_LIB=1 ECMOONCAKE_REQUIRE_VLLM=$require_vllm "$python" -m pytest -q tests/python
