#!/usr/bin/env bash
# Memory-subsystem benchmarks (issue 6), SmolLM2-135M-Instruct F32 and BF16:
#   T1 allocator micro-benchmark       cargo bench --bench alloc
#   T2 cold/hot load, mmap vs heap     mem_bench load
#   T3 step speed per memory pool      mem_bench decode
#   T6 peak RSS of generate, RSS of a second process sharing the mmap
# Prints markdown on stdout. BENCHMARKS.md "CPU memory" has the current
# figures and the machine they came from.
#
# usage: scripts/mem_bench.sh [--quick]
# env: NANOINFER_MODELS (default <repo>/models), T1_MS (ms per T1 cell, default 40)
set -euo pipefail
cd "$(dirname "$0")/.."
models=${NANOINFER_MODELS:-$PWD/models}
f32=$models/SmolLM2-135M-Instruct
bf16=$models/SmolLM2-135M-Instruct-bf16
quick=${1:-}
reps=5; rounds=2; t1_ms=${T1_MS:-40}
if [[ $quick == --quick ]]; then reps=2; rounds=1; t1_ms=10; fi

cargo build --release --example mem_bench --bin nanoinfer >&2
target=${CARGO_TARGET_DIR:-target}/release
bench=$target/examples/mem_bench
cli=$target/nanoinfer

echo "## T1: allocator micro-benchmark"
cargo bench --bench alloc -- "$t1_ms" 2>/dev/null

echo "## T2: load"
for dir in "$f32" "$bf16"; do
  "$bench" load "$dir" --reps "$reps"
  echo
done

echo "## T3: engine steps per memory pool"
for dir in "$f32" "$bf16"; do
  "$bench" decode "$dir" --threads 2 --rounds "$rounds"
  echo
done

echo "## T6: memory"
for dir in "$f32" "$bf16"; do
  echo "generate $(basename "$dir"), 4 prompts x 64 tokens:"
  /usr/bin/time -f "  /usr/bin/time: max RSS %M KiB" "$cli" generate --model "$dir" --threads 2 \
    --prompt "The capital of France is" --prompt "Write a haiku about memory." \
    --prompt "List three prime numbers:" --prompt "Once upon a time" \
    --max-tokens 64 --ignore-eos >/dev/null 2>/tmp/mem_bench_generate.$$ || true
  grep -E "memory budget|peak RSS|max RSS" /tmp/mem_bench_generate.$$ | sed 's/^/  /'
  rm -f /tmp/mem_bench_generate.$$
  echo "two processes loading $(basename "$dir") at once:"
  "$bench" rss "$dir" --forward 8 --hold 8 | sed 's/^/  first:  /' &
  first=$!
  sleep 4
  "$bench" rss "$dir" --forward 8 | sed 's/^/  second: /'
  wait "$first"
  echo
done
