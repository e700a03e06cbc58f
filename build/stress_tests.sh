#!/usr/bin/env bash
# Runs the test command N times with a CPU hog beside it, the way a shared
# CI runner loads a machine, and says which runs passed:
#
#   bash build/stress_tests.sh N
#
# prints one line per run ("run 2/3: FAIL (rc 1, 812 s): --- FAIL: TestX")
# with the first failure line of that run, keeps each run's output, kills
# the hog on any exit, and exits 1 if any run failed.
#
# Environment:
#   ECM_STRESS_CMD   the command (bash -c), default the README's
#                    `bash build/test.sh`
#   ECM_STRESS_HOG   stress-ng (default; installed through build/apt.sh
#                    when missing), loop (busy shell loops) or none
#   ECM_STRESS_CPUS  CPUs the hog keeps busy, default 2
#   ECM_STRESS_LOGS  where run-I.log files go, default a new temporary folder
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)

n=${1:-}
case $n in '' | *[!0-9]* | 0)
  echo "usage: $0 N (N must be a positive count, got '${n}')" >&2
  exit 2
  ;;
esac
cmd=${ECM_STRESS_CMD:-bash "$here/test.sh"}
hog=${ECM_STRESS_HOG:-stress-ng}
cpus=${ECM_STRESS_CPUS:-2}
case $cpus in '' | *[!0-9]* | 0)
  echo "stress: ECM_STRESS_CPUS must be a positive count, got '$cpus'" >&2
  exit 2
  ;;
esac
logs=${ECM_STRESS_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/ecm-stress.XXXXXX")}
mkdir -p "$logs" || exit 2

# Each hog runs in a session of its own (setsid), so that stopping it
# stops every process it forked: stress-ng's workers, a loop's subshell.
hogs=()
stop_hogs() {
  local pid tries
  for pid in "${hogs[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null
  done
  for pid in "${hogs[@]}"; do
    for ((tries = 0; tries < 50; tries++)); do
      pgrep -s "$pid" >/dev/null || break
      sleep 0.1
    done
    if pgrep -s "$pid" >/dev/null; then
      echo "stress: hog session $pid ignored SIGTERM for 5 s; killing it" >&2
      kill -KILL -- "-$pid" 2>/dev/null
    fi
    wait "$pid" 2>/dev/null
  done
  hogs=()
}
# The run in progress is in a session of its own too, waited for with
# `wait`, which a signal interrupts: an interrupted stress run stops its
# hog and its test run at once, not when the run ends.
running=""
stop_run() {
  [ -n "$running" ] || return 0
  kill -TERM -- "-$running" 2>/dev/null
  wait "$running" 2>/dev/null
  running=""
}
trap 'stop_run; stop_hogs' EXIT
trap 'stop_run; stop_hogs; exit 130' INT
trap 'stop_run; stop_hogs; exit 143' TERM

if [ "$hog" = stress-ng ] && ! command -v stress-ng >/dev/null; then
  . "$here/apt.sh"
  if ! apt_install stress-ng || ! command -v stress-ng >/dev/null; then
    echo "stress: could not install stress-ng; the hog is $cpus busy shell loops instead" >&2
    hog=loop
  fi
fi
case $hog in
  stress-ng)
    setsid stress-ng --cpu "$cpus" --quiet </dev/null >/dev/null 2>&1 &
    hogs+=($!)
    ;;
  loop)
    for ((i = 0; i < cpus; i++)); do
      setsid bash -c 'while :; do :; done' </dev/null >/dev/null 2>&1 &
      hogs+=($!)
    done
    ;;
  none) ;;
  *)
    echo "stress: ECM_STRESS_HOG must be stress-ng, loop or none, got '$hog'" >&2
    exit 2
    ;;
esac
echo "stress: $n runs of: $cmd"
echo "stress: hog $hog on $cpus CPUs; logs in $logs"
echo "stress: hog pids ${hogs[*]}"

# first_failure LOG: the line of a run's output that best says what failed.
first_failure() {
  local pat line
  for pat in '^\s*--- FAIL: ' '^panic: ' '^FAILED ' '^(E\s|ERROR)' '^FAIL\b' '(error|Error|ERROR)'; do
    if line=$(grep -m1 -E -- "$pat" "$1"); then
      echo "$line"
      return
    fi
  done
  grep -v '^\s*$' "$1" | tail -1
}

passed=0
for ((i = 1; i <= n; i++)); do
  log=$logs/run-$i.log
  start=$SECONDS
  setsid bash -c "$cmd" >"$log" 2>&1 </dev/null &
  running=$!
  wait "$running"
  rc=$?
  running=""
  took=$((SECONDS - start))
  if ((rc == 0)); then
    passed=$((passed + 1))
    echo "run $i/$n: pass ($took s)"
  else
    echo "run $i/$n: FAIL (rc $rc, $took s): $(first_failure "$log")"
    echo "         log: $log"
  fi
done
stop_hogs
echo "stress: $passed of $n runs passed"
((passed == n))
