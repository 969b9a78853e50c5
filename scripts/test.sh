#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, formatting, Rust tests
# (unit, goldens against transformers, bad files, engine, C ABI misuse and
# concurrency, fault injection, the fuzz targets' logic over seeds and
# mutations), a one-minute soak through the C ABI, the CUDA kernels' NVRTC
# compile, then the packaging check (CMake package, C/C++ examples,
# valgrind, Go binding).
set -euo pipefail
cd "$(dirname "$0")/.."
NANOINFER_SETUP_BF16=1 NANOINFER_SETUP_PACKAGING=1 bash scripts/setup.sh
echo "== cargo fmt --check" >&2
cargo fmt --all -- --check
echo "== cargo test --release" >&2
cargo test --release
echo "== one-minute soak through the C ABI (scripts/soak.sh for the full one)" >&2
NANOINFER_SOAK_SECS=60 NANOINFER_SOAK_RSS_CSV="${TMPDIR:-/tmp}/nanoinfer-ci-soak-rss.csv" \
  cargo test --release --test engine_soak soak_timed_through_the_c_abi -- --ignored --nocapture
echo "== scripts/check_kernels.py (CUDA kernels compile with NVRTC)" >&2
python3 scripts/check_kernels.py
echo "== scripts/test_packaging.sh" >&2
bash scripts/test_packaging.sh
