#!/usr/bin/env bash
# Idempotent set-up shared by run.sh and test.sh: Python packages for the
# model converter, and the default model (F32, plus a BF16 copy for tests).
# NANOINFER_SETUP_PACKAGING=1 (test.sh) also installs the system packages
# scripts/test_packaging.sh needs (cmake, make, a C/C++ compiler, binutils,
# pkg-config, valgrind), with apt-get as root or through passwordless sudo.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${NANOINFER_SETUP_PACKAGING:-0}" = 1 ]; then
  missing=()
  for pair in cmake:cmake make:make cc:gcc c++:g++ readelf:binutils pkg-config:pkg-config valgrind:valgrind; do
    command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
  done
  if [ ${#missing[@]} -gt 0 ]; then
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
  fi
  # Go is not installed here: Debian's golang-go is older than the binding's
  # minimum (1.24). test_packaging.sh finds a go >= 1.24 on PATH or in
  # /usr/local/go, and otherwise skips the Go tests with a message.
fi
if ! python3 -c "import gguf, numpy" 2>/dev/null; then
  echo "setup: installing Python packages for the model converter" >&2
  python3 -m pip install --quiet --disable-pip-version-check -r scripts/requirements-fetch.txt
fi
python3 scripts/fetch_model.py
if [ "${NANOINFER_SETUP_BF16:-0}" = 1 ]; then
  python3 scripts/fetch_model.py --dtype bf16
fi
