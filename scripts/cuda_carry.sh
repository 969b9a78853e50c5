#!/usr/bin/env bash
# Builds the release binaries the GPU machine runs (it has no Rust) and puts
# stripped copies in gpu-carry/ (git-ignored): nanoinfer, nanoinfer-serve, engine_bench,
# w4_bench, grammar_bench, state_bench, spec_bench and the tests/cuda.rs test binary. Then, through the device tool, run e.g.
#   BIN=gpu-carry bash scripts/cuda_device_run.sh fixtures tests
# With `--baseline REV` it also builds nanoinfer, engine_bench and w4_bench of
# git revision REV into gpu-carry/baseline/, for same-call comparisons (e.g.
# cuda_device_run.sh's `ab4` step).
set -euo pipefail
cd "$(dirname "$0")/.."
target=$(realpath -m "${CARGO_TARGET_DIR:-target}")
mkdir -p gpu-carry
if [ "${1:-}" = --baseline ]; then
    rev=${2:?--baseline takes a git revision}
    tree=$(mktemp -d)/nanoinfer-baseline
    git worktree add --detach "$tree" "$rev" >/dev/null
    trap 'git worktree remove --force "$tree"' EXIT
    # A target directory of its own: sharing one, the two builds would
    # overwrite each other's binaries under the same names.
    (cd "$tree" && CARGO_TARGET_DIR=$target/baseline cargo build --release --bin nanoinfer --example engine_bench \
        --example w4_bench)
    mkdir -p gpu-carry/baseline
    strip -o gpu-carry/baseline/nanoinfer "$target/baseline/release/nanoinfer"
    strip -o gpu-carry/baseline/engine_bench "$target/baseline/release/examples/engine_bench"
    strip -o gpu-carry/baseline/w4_bench "$target/baseline/release/examples/w4_bench"
    git rev-parse "$rev" > gpu-carry/baseline/REVISION
fi
cargo build --release --bin nanoinfer --bin nanoinfer-serve --example engine_bench --example w4_bench \
    --example grammar_bench --example state_bench --example spec_bench
test_bin=$(cargo test --release --test cuda --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda" and m.get("executable"):
        print(m["executable"])')
strip -o gpu-carry/nanoinfer "$target/release/nanoinfer"
strip -o gpu-carry/nanoinfer-serve "$target/release/nanoinfer-serve"
strip -o gpu-carry/engine_bench "$target/release/examples/engine_bench"
strip -o gpu-carry/w4_bench "$target/release/examples/w4_bench"
strip -o gpu-carry/grammar_bench "$target/release/examples/grammar_bench"
strip -o gpu-carry/state_bench "$target/release/examples/state_bench"
strip -o gpu-carry/spec_bench "$target/release/examples/spec_bench"
# SmolLM2's tokenizer, for random models that have none (the `grammar` step).
mkdir -p gpu-carry/tok
cp models/SmolLM2-135M-Instruct/tokenizer.json models/SmolLM2-135M-Instruct/tokenizer_config.json gpu-carry/tok/
strip -o gpu-carry/cuda "$test_bin"
ls -la gpu-carry
