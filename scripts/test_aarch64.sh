#!/usr/bin/env bash
# The aarch64 NEON kernels, checked for correctness under qemu user
# emulation (their speed is not measured: qemu is no ARM CPU). Installs
# what it needs when missing (Debian's cross gcc and libc, qemu-user, the
# Rust target), builds for aarch64-unknown-linux-gnu into target/aarch64,
# and runs under qemu-aarch64:
#   - the CPU kernel unit tests (backend::cpu) three times: the default
#     path (NEON with sdot: qemu's CPU has DotProd), NANOINFER_ISA=neon
#     (widening int8 products instead of sdot) and NANOINFER_ISA=scalar;
#   - tests/emulated_goldens.rs (SmolLM2 F32, BF16, Q8_0, int4: greedy ids
#     against transformers' goldens, short perplexity) on the NEON path.
# Needs the default model (scripts/setup.sh). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/apt_install_missing.sh
apt_install_missing aarch64-linux-gnu-gcc:gcc-aarch64-linux-gnu \
  /usr/aarch64-linux-gnu/lib/crt1.o:libc6-dev-arm64-cross qemu-aarch64:qemu-user
triple=aarch64-unknown-linux-gnu
rustup target list --installed | grep -qx "$triple" || rustup target add "$triple"

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
export CARGO_TARGET_DIR=$PWD/target/aarch64
# The build is most of this script's time: no debug info (nothing here
# reads it). Dependencies stay optimized: at opt-level 1, loading the
# tokenizer and its JSON under qemu made the goldens 1.5 x slower.
export CARGO_PROFILE_RELEASE_DEBUG=0
args=(--release --target "$triple")

start=$(date +%s)
echo "== aarch64 build (target/aarch64)" >&2
cargo test "${args[@]}" --lib --test emulated_goldens --no-run
echo "== aarch64 build: $(( $(date +%s) - start )) s" >&2
# The x86 BF16 tilings' software models (bf16_amx, bf16_dot: no NEON code,
# 40 s under qemu) are left to the native run.
skip=(--skip bf16_amx:: --skip bf16_dot::)
for isa in default neon scalar; do
  echo "== CPU kernel unit tests under qemu-aarch64, NANOINFER_ISA=$isa" >&2
  t=$(date +%s)
  if [ "$isa" = default ]; then
    env -u NANOINFER_ISA cargo test "${args[@]}" --lib backend::cpu -- "${skip[@]}"
  else
    NANOINFER_ISA=$isa cargo test "${args[@]}" --lib backend::cpu -- "${skip[@]}"
  fi
  echo "== NANOINFER_ISA=$isa: $(( $(date +%s) - t )) s" >&2
done
echo "== SmolLM2 goldens under qemu-aarch64 (NEON with sdot)" >&2
t=$(date +%s)
env -u NANOINFER_ISA cargo test "${args[@]}" --test emulated_goldens -- --nocapture
echo "== emulated goldens: $(( $(date +%s) - t )) s; scripts/test_aarch64.sh: $(( $(date +%s) - start )) s" >&2
