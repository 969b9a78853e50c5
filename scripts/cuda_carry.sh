#!/usr/bin/env bash
# Builds the release binaries the GPU machine runs (it has no Rust) and puts
# stripped copies in gpu-carry/ (git-ignored): nanoinfer, engine_bench,
# w4_bench and the tests/cuda.rs test binary. Then, through the device tool, run e.g.
#   BIN=gpu-carry bash scripts/cuda_device_run.sh fixtures tests
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bin nanoinfer --example engine_bench --example w4_bench
test_bin=$(cargo test --release --test cuda --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda" and m.get("executable"):
        print(m["executable"])')
mkdir -p gpu-carry
target=${CARGO_TARGET_DIR:-target}
strip -o gpu-carry/nanoinfer "$target/release/nanoinfer"
strip -o gpu-carry/engine_bench "$target/release/examples/engine_bench"
strip -o gpu-carry/w4_bench "$target/release/examples/w4_bench"
strip -o gpu-carry/cuda "$test_bin"
ls -la gpu-carry
