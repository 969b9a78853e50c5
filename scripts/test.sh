#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, formatting, Rust tests
# (unit, goldens against transformers, bad files, engine, C ABI misuse).
set -euo pipefail
cd "$(dirname "$0")/.."
NANOINFER_SETUP_BF16=1 bash scripts/setup.sh
echo "== cargo fmt --check" >&2
cargo fmt --all -- --check
echo "== cargo test --release" >&2
cargo test --release
