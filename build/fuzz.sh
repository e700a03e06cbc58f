#!/usr/bin/env bash
# Fuzzes every Fuzz target of the Go tree (run from the repository root) for
# a budget of executions each, on one worker, so that a loaded machine
# slows the pass down but cannot fail it for the harness's own reasons.
#
#   bash build/fuzz.sh                  every target under core, capi, tests/go
#   bash build/fuzz.sh PKG TARGET ...   these (package directory, target) pairs
#
# Any failing input fails the run and stays under PKG/testdata/fuzz/TARGET.
# Two errors of Go's fuzz coordinator itself (not of the code under test)
# are retried, and only when nothing is left to blame on the code:
#   - "fuzzing process hung or terminated unexpectedly while minimizing"
#     with a saved input that passes when re-run on its own
#     (go test -run=TARGET/INPUT): a starved worker missed its deadline;
#   - "context deadline exceeded" with no failing input named, or saved
#     ones that pass when re-run (golang/go#75804).
# Such an input is removed (it is not a failure) and the target fuzzed
# again, at most FUZZ_RETRIES times; every retry is logged and counted.
#
# Environment: FUZZTIME (default 20000x: executions, not seconds, so that
# no deadline of the coordinator's is involved), FUZZ_RETRIES (default 2),
# FUZZ_TIMEOUT (go test -timeout of one pass, default 10m), GO (the go
# command, default go).
set -uo pipefail

go_cmd=${GO:-go}
fuzztime=${FUZZTIME:-20000x}
retries=${FUZZ_RETRIES:-2}
timeout=${FUZZ_TIMEOUT:-10m}
hung='fuzzing process hung or terminated unexpectedly while minimizing'
deadline='context deadline exceeded'

case $retries in '' | *[!0-9]*)
  echo "fuzz: FUZZ_RETRIES=$retries is not a count" >&2
  exit 2
  ;;
esac

# inputs PKG TARGET: the saved inputs of a target, one path a line.
inputs() {
  local dir=$1/testdata/fuzz/$2
  [ -d "$dir" ] && find "$dir" -type f | sort
  return 0
}

# reruns_pass PKG TARGET PATH...: every saved input passes on its own.
reruns_pass() {
  local pkg=$1 target=$2 path out
  shift 2
  for path in "$@"; do
    if ! out=$("$go_cmd" test -count=1 -run="^${target}\$/^$(basename "$path")\$" "./$pkg" 2>&1); then
      echo "$out" | tail -20 >&2
      return 1
    fi
  done
}

harness_retries=0

# fuzz_one PKG TARGET: 0 when the target passes, maybe after retries of a
# harness error; 1 on a failure of the code under test.
fuzz_one() {
  local pkg=$1 target=$2 attempt=0 out before after
  local -a fresh
  while :; do
    before=$(inputs "$pkg" "$target")
    if out=$("$go_cmd" test -run=NONE -fuzz="^${target}\$" -fuzztime="$fuzztime" -parallel=1 -timeout="$timeout" "./$pkg" 2>&1); then
      return 0
    fi
    after=$(inputs "$pkg" "$target")
    mapfile -t fresh < <(comm -13 <(echo "$before") <(echo "$after") | sed '/^$/d')
    local why=""
    if grep -qF "$hung" <<<"$out" && ((${#fresh[@]} > 0)); then
      why="hung while minimizing"
    elif grep -qF "$deadline" <<<"$out" && ! grep -qF -- "--- FAIL: ${target}/" <<<"$out"; then
      why="coordinator deadline"
    fi
    if [ -n "$why" ] && { ((${#fresh[@]} == 0)) || reruns_pass "$pkg" "$target" "${fresh[@]}"; }; then
      if ((attempt < retries)); then
        attempt=$((attempt + 1))
        harness_retries=$((harness_retries + 1))
        echo "fuzz: $pkg $target: harness error ($why), no failing input; retry $attempt of $retries" >&2
        if ((${#fresh[@]} > 0)); then
          echo "fuzz: removing ${fresh[*]}: it passes on its own" >&2
          rm -f -- "${fresh[@]}"
        fi
        continue
      fi
      echo "$out" | tail -30 >&2
      echo "fuzz: $pkg $target: harness error ($why) on every one of $((retries + 1)) tries" >&2
      return 1
    fi
    echo "$out" | tail -30 >&2
    if ((${#fresh[@]} > 0)); then
      echo "fuzz: $pkg $target found a failing input: ${fresh[*]}" >&2
    fi
    return 1
  done
}

pairs=()
if (($# > 0)); then
  if (($# % 2 != 0)); then
    echo "fuzz: arguments come in pairs: PKG TARGET" >&2
    exit 2
  fi
  pairs=("$@")
else
  while read -r pkg; do
    for target in $(grep -h '^func Fuzz' "$pkg"/*_test.go | sed -E 's/^func (Fuzz[A-Za-z0-9_]*).*/\1/'); do
      pairs+=("$pkg" "$target")
    done
  done < <(grep -rl --include='*_test.go' '^func Fuzz' core capi tests/go 2>/dev/null | xargs -r -n1 dirname | sort -u)
fi

echo "== fuzz (${fuzztime} each, one worker)" >&2
failed=0
for ((i = 0; i < ${#pairs[@]}; i += 2)); do
  echo "   ${pairs[i]} ${pairs[i + 1]}" >&2
  fuzz_one "${pairs[i]}" "${pairs[i + 1]}" || failed=$((failed + 1))
done
echo "fuzz: $((${#pairs[@]} / 2)) targets, $failed failed, $harness_retries harness retries" >&2
((failed == 0))
