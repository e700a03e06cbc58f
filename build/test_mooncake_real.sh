#!/usr/bin/env bash
# Runs the Go mooncake tests again, against the real Mooncake engine of two
# wheel versions (the newest and the oldest the shim supports), each the
# pip wheel's mooncake/engine.so carried by ecmooncake's shim, with
# mooncake_protocol tcp, inside a network namespace this script
# creates (loopback plus a veth pair on 10.231.0.1/24, since Mooncake
# advertises the first interface that is not loopback). Nothing of it can
# reach this machine's network; ss, sampled inside the namespace while the
# tests run, must show every socket bound and connected to loopback or the
# namespace's own address, and the engine listening there. Then the
# Mooncake Store tests (tests/python/test_store_real.py) against a real
# mooncake_master of both wheels, which make and check their own
# namespaces the same way.
#
# ECMOONCAKE_REQUIRE_MOONCAKE=1 (test.sh sets it) makes a missing or
# unsupported wheel a failure; otherwise the run is skipped, saying so.
# Needs root (unshare --net) and iproute2. ECMOONCAKE_MOONCAKE_RUN=REGEX
# runs only the tests/go scenarios it matches, verbosely (while working on
# one of them).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
require=${ECMOONCAKE_REQUIRE_MOONCAKE:-0}

skip() {
  if [ "$require" = 1 ]; then
    echo "test_mooncake_real: FAIL: $* (ECMOONCAKE_REQUIRE_MOONCAKE=1; bash build/setup.sh installs the wheel)" >&2
    exit 1
  fi
  echo "test_mooncake_real: SKIPPED, the real Mooncake engine is NOT tested: $*" >&2
  exit 0
}

# The wheels to test, as "engine.so version" lines: the one installed for
# $python (build/setup.sh installs the newest there) and the oldest the
# shim supports, in .mooncake-oldest/ (pip --target).
# ECMOONCAKE_MOONCAKE_SITES, space-separated folders that each hold
# mooncake/engine.so and its wheel's dist-info, replaces both.
site_wheel() { # folder -> "engine.so version", or nothing
  local info
  [ -f "$1/mooncake/engine.so" ] || return 0
  info=$(ls -d "$1"/mooncake_transfer_engine*.dist-info 2>/dev/null | head -1)
  [ -n "$info" ] || return 0
  info=${info##*/}
  info=${info%.dist-info}
  echo "$(cd "$1" && pwd)/mooncake/engine.so ${info#*-}"
}
wheels=()
if [ -n "${ECMOONCAKE_MOONCAKE_SITES:-}" ]; then
  for site in $ECMOONCAKE_MOONCAKE_SITES; do
    w=$(site_wheel "$site")
    [ -n "$w" ] || skip "no Mooncake wheel in $site"
    wheels+=("$w")
  done
else
  w=$("$python" -c '
import sys
sys.path.insert(0, "python")
from ecmooncake.environment import mooncake_wheel
w = mooncake_wheel()
print("" if w is None else w["engine"] + " " + w["version"])')
  [ -n "$w" ] || skip "no Mooncake wheel (mooncake/engine.so) installed for $python"
  wheels+=("$w")
  w=$(site_wheel .mooncake-oldest)
  [ -n "$w" ] || skip "no oldest Mooncake wheel in .mooncake-oldest/ (bash build/setup.sh installs it)"
  wheels+=("$w")
fi
[ "$(id -u)" = 0 ] || skip "unshare --net needs root"
command -v ss >/dev/null && command -v ip >/dev/null || skip "no iproute2 (ip, ss)"

work=$(mktemp -d /tmp/ecm-mooncake-real.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$python" - "$work" <<'EOF'
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("build_lib", "build/build_lib.py")
bl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bl)
if bl.build_shim(Path(sys.argv[1])) is None:
    sys.exit(1)
EOF
shim=$work/libecmooncake_mooncake.so
[ -f "$shim" ] || skip "the shim was not built (no g++)"
# run_wheel runs the tests against one wheel's engine.so, in a network
# namespace of its own, and checks where its sockets went.
run_wheel() { # engine version
  local engine=$1 version=$2 ss=$work/ss-$2 rc=0 bad
  echo "== go test -race, mooncake against the real engine ($engine, wheel $version, tcp, in a network namespace)" >&2
  : >"$ss"
  # The namespace lives as long as the one command unshare runs; the veth
  # pair, every socket and the etcd a test starts go with it.
  ECMOONCAKE_MOONCAKE_LIBRARY=$shim ECMOONCAKE_MOONCAKE_ENGINE=$engine ECMOONCAKE_MOONCAKE_PROTOCOL=tcp \
    ECMOONCAKE_REQUIRE_MOONCAKE=$require PYTHON=$python ECMOONCAKE_MOONCAKE_RUN=${ECMOONCAKE_MOONCAKE_RUN:-} \
    unshare --net bash -s "$ss" <<'EOF' || rc=$?
set -euo pipefail
ss=$1
ip link set lo up
ip link add ecm0 type veth peer name ecm1
ip addr add 10.231.0.1/24 dev ecm0
ip link set ecm0 up
ip link set ecm1 up
( while :; do ss -Htanp >>"$ss" 2>/dev/null; sleep 0.2; done ) &
sampler=$!
rc=0
if [ -n "$ECMOONCAKE_MOONCAKE_RUN" ]; then
  go test -race -count=1 -timeout 20m -v -run "$ECMOONCAKE_MOONCAKE_RUN" ./tests/go/ || rc=$?
else
  go test -race -count=1 -timeout 20m ./core/transport/mooncake/ || rc=$?
  go test -race -count=1 -timeout 20m -run 'Mooncake|IdleShardRestart/mooncake' ./tests/go/ || rc=$?
fi
kill "$sampler"
wait "$sampler" 2>/dev/null || true
exit $rc
EOF
  [ "$rc" = 0 ] || echo "test_mooncake_real: FAIL: the tests failed against wheel $version" >&2

  # Every socket the namespace held: its local and peer addresses (columns
  # 4 and 5 of ss -Htan) are loopback, the namespace's 10.231.0.0/24 or
  # unbound/wildcard, which inside the namespace is reachable only there.
  bad=$(awk '{print $4; print $5}' "$ss" | sed 's/:[^:]*$//; s/^\[//; s/\]$//; s/%.*//' | sort -u |
    grep -Ev '^(127\.[0-9.]+|::1|::ffff:127\.[0-9.]+|10\.231\.0\.[0-9]+|::ffff:10\.231\.0\.[0-9]+|0\.0\.0\.0|::|\*)$' || true)
  if [ -n "$bad" ]; then
    echo "test_mooncake_real: FAIL: sockets in the namespace used addresses outside it (wheel $version):" >&2
    echo "$bad" >&2
    rc=1
  fi
  if ! grep -q 'LISTEN.*10\.231\.0\.1:\|LISTEN.*\(0\.0\.0\.0\|\*\|\[::\]\):' "$ss"; then
    echo "test_mooncake_real: FAIL: ss never saw the engine listen in the namespace (wheel $version)" >&2
    rc=1
  fi
  [ "$rc" = 0 ] && echo "test_mooncake_real: wheel $version passed; every socket stayed inside the namespace ($(grep -c LISTEN "$ss") listening samples)" >&2
  return $rc
}

fail=0
for w in "${wheels[@]}"; do
  run_wheel ${w% *} ${w##* } || fail=1
done
# Mooncake Store: the tier's client against a real mooncake_master of the
# installed wheel and of the oldest one in .mooncake-oldest/ (ECMOONCAKE_MOONCAKE_SITES
# does not apply), each scenario in a network namespace the test creates
# and checks with ss.
if [ -z "${ECMOONCAKE_MOONCAKE_RUN:-}" ]; then
  echo "== pytest, Mooncake Store against a real mooncake_master (in network namespaces)" >&2
  if ! ECMOONCAKE_REQUIRE_MOONCAKE=$require "$python" -m pytest -q -p no:cacheprovider tests/python/test_store_real.py; then
    echo "test_mooncake_real: FAIL: the Mooncake Store tests failed" >&2
    fail=1
  fi
fi
exit $fail
