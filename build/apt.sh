# Sourced by the setup scripts: apt_install installs the Debian packages
# it is given (none: nothing), through sudo unless already root.
apt_install() {
  (($#)) || return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "setup: installing $*" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}
