#!/usr/bin/env bash
# Idempotent set-up shared by run.sh and test.sh: Python packages for the
# model converter, and the default model (F32, plus a BF16 copy for tests).
# NANOINFER_SETUP_PACKAGING=1 (test.sh) also installs the system packages
# scripts/test_packaging.sh needs (cmake, make, a C/C++ compiler, binutils,
# pkg-config, valgrind), with apt-get as root or through passwordless sudo;
# NANOINFER_SETUP_SERVER=1 (test.sh) what scripts/test_server.sh needs.
set -euo pipefail
cd "$(dirname "$0")/.."

# apt_install_missing COMMAND:PACKAGE...
source scripts/apt_install_missing.sh

if [ "${NANOINFER_SETUP_PACKAGING:-0}" = 1 ]; then
  apt_install_missing cmake:cmake make:make cc:gcc c++:g++ readelf:binutils pkg-config:pkg-config valgrind:valgrind
  # Go is not installed here: Debian's golang-go is older than the binding's
  # minimum (1.24). test_packaging.sh finds a go >= 1.24 on PATH or in
  # /usr/local/go, and otherwise skips the Go tests with a message.
fi
if [ "${NANOINFER_SETUP_SERVER:-0}" = 1 ]; then
  # scripts/test_server.sh: Chromium and chromedriver for the chat page's
  # browser test, the OpenAI client, httpx and Selenium.
  apt_install_missing chromium:chromium chromedriver:chromium-driver
  if ! python3 -c "import openai, httpx, selenium" 2>/dev/null; then
    echo "setup: installing Python packages for the server tests" >&2
    python3 -m pip install --quiet --disable-pip-version-check -r scripts/requirements-server.txt
  fi
fi
if ! python3 -c "import gguf, numpy" 2>/dev/null; then
  echo "setup: installing Python packages for the model converter" >&2
  python3 -m pip install --quiet --disable-pip-version-check -r scripts/requirements-fetch.txt
fi
python3 scripts/fetch_model.py
if [ "${NANOINFER_SETUP_BF16:-0}" = 1 ]; then
  python3 scripts/fetch_model.py --dtype bf16
fi
