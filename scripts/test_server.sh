#!/usr/bin/env bash
# The HTTP server's tests against a real `nanoinfer serve` on the default
# model: the official OpenAI client and raw HTTP (server/tests/test_openai.py),
# the chat page in headless Chromium (browser_test.py, screenshot under
# target/server-test-artifacts/), and a load run of 64 streaming clients
# with disconnects and bursts (load_test.py; NANOINFER_SERVER_LOAD_SECS,
# default 60). Set-up: NANOINFER_SETUP_SERVER=1 scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
NANOINFER_SETUP_SERVER=1 bash scripts/setup.sh
cargo build --release --quiet --bin nanoinfer --bin nanoinfer-serve
cd server/tests
echo "== server: OpenAI client and raw HTTP (test_openai.py)" >&2
python3 -m unittest -v test_openai 2>&1 | tail -40
echo "== server: the chat page in headless Chromium (browser_test.py)" >&2
python3 browser_test.py
echo "== server: load with disconnects and bursts (load_test.py)" >&2
python3 load_test.py --secs "${NANOINFER_SERVER_LOAD_SECS:-60}"
