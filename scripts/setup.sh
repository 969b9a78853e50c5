#!/usr/bin/env bash
# Idempotent set-up shared by run.sh and test.sh: Python packages for the
# model converter, and the default model (F32, plus a BF16 copy for tests).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import gguf, numpy" 2>/dev/null; then
  echo "setup: installing Python packages for the model converter" >&2
  python3 -m pip install --quiet --disable-pip-version-check -r scripts/requirements-fetch.txt
fi
python3 scripts/fetch_model.py
if [ "${NANOINFER_SETUP_BF16:-0}" = 1 ]; then
  python3 scripts/fetch_model.py --dtype bf16
fi
