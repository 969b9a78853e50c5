# Sourced by scripts/setup.sh and scripts/test_aarch64.sh (bash).

# Installs the Debian packages of "command:package" pairs whose command is
# missing (a "command" starting with / is a file that must exist), as root
# or through passwordless sudo.
apt_install_missing() {
  local missing=() pair as_root
  for pair in "$@"; do
    local what=${pair%%:*}
    if [[ $what == /* ]]; then
      [ -e "$what" ] || missing+=("${pair#*:}")
    else
      command -v "$what" >/dev/null || missing+=("${pair#*:}")
    fi
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  if [ "$(id -u)" = 0 ]; then
    as_root=()
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
  else
    echo "setup: missing ${missing[*]}; install them (apt-get install ${missing[*]}) or rerun as root" >&2
    exit 1
  fi
  command -v apt-get >/dev/null || { echo "setup: missing ${missing[*]} and no apt-get to install them" >&2; exit 1; }
  echo "setup: installing ${missing[*]}" >&2
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
