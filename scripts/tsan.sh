#!/usr/bin/env bash
# ThreadSanitizer run of the tests that use threads (not in CI: it needs the
# nightly toolchain and a ~20-minute instrumented rebuild of std and every
# crate on 2 cores). Any data race reported fails the run (TSan exits 66).
#
#   scripts/tsan.sh [SOAK_SECONDS (default 60)]
#
# Covers: the C ABI concurrency tests (tests/ffi_concurrency.rs: threads with
# their own sessions over one model, add/cancel/stats racing a stepping
# owner), cancel/stats from other threads and callbacks (ffi_api), thread-
# local errors and forced panics (ffi_misuse), the timed C ABI soak with its
# stats thread, and the unit tests of the kernel thread pool, the memory
# pools (4 threads per pool) and HostSlice. The models run with 2 kernel
# threads, so every forward pass goes through the shared worker pool.
#
# Instrumented builds go to $NANOINFER_TSAN_TARGET_DIR (default target/tsan),
# apart from normal and ASan builds so neither rebuilds the other.
set -euo pipefail
cd "$(dirname "$0")/.."
soak_secs=${1:-60}
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
rustup component list --toolchain nightly --installed | grep -q '^rust-src' ||
  rustup component add rust-src --toolchain nightly
export CARGO_TARGET_DIR=${NANOINFER_TSAN_TARGET_DIR:-$PWD/target/tsan}
export RUSTFLAGS="-Zsanitizer=thread"
export RUSTDOCFLAGS="-Zsanitizer=thread"
# The pools' out-of-memory tests ask for impossible sizes: TSan's allocator must
# return NULL for them (as the system allocator does) rather than abort.
export TSAN_OPTIONS="${TSAN_OPTIONS:-second_deadlock_stack=1 allocator_may_return_null=1}"
tsan_test() {
  cargo +nightly test -Zbuild-std --target x86_64-unknown-linux-gnu --release "$@"
}
echo "== TSan: unit tests (thread pool, memory pools, HostSlice)" >&2
tsan_test --lib -- threadpool memory:: tensor::buffer
echo "== TSan: C ABI tests" >&2
tsan_test --test ffi_concurrency --test ffi_api --test ffi_misuse
echo "== TSan: ${soak_secs} s soak through the C ABI" >&2
NANOINFER_SOAK_SECS=$soak_secs NANOINFER_SOAK_RSS_CHECK=0 \
  tsan_test --test engine_soak soak_timed -- --ignored --nocapture
