#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, formatting, Rust tests
# (unit, goldens against transformers, bad files, engine, C ABI misuse and
# concurrency, fault injection, the fuzz targets' logic over seeds and
# mutations), the numeric tests on every other instruction-set path, the
# aarch64 NEON kernels under qemu, a
# one-minute soak through the C ABI, the CUDA kernels' NVRTC
# compile, the HTTP server (OpenAI client, headless Chromium, load), then
# the packaging check (CMake package, C/C++ examples, valgrind, Go binding).
set -euo pipefail
cd "$(dirname "$0")/.."
NANOINFER_SETUP_BF16=1 NANOINFER_SETUP_PACKAGING=1 bash scripts/setup.sh
echo "== cargo fmt --check" >&2
cargo fmt --all -- --check
echo "== cargo test --release" >&2
cargo test --release
echo "== numeric tests under every other instruction-set path this CPU has (scripts/test_isa.sh)" >&2
bash scripts/test_isa.sh
echo "== the aarch64 NEON kernels and short goldens under qemu (scripts/test_aarch64.sh)" >&2
bash scripts/test_aarch64.sh
echo "== one-minute soak through the C ABI (scripts/soak.sh for the full one)" >&2
NANOINFER_SOAK_SECS=60 NANOINFER_SOAK_RSS_CSV="${TMPDIR:-/tmp}/nanoinfer-ci-soak-rss.csv" \
  cargo test --release --test engine_soak soak_timed_through_the_c_abi -- --ignored --nocapture
echo "== C/C++ examples under AddressSanitizer, LeakSanitizer and UBSan" >&2
cargo build --release --lib
lib=${CARGO_TARGET_DIR:-$PWD/target}/release
asan=$(mktemp -d "${TMPDIR:-/tmp}/nanoinfer-asan.XXXXXX")
abi=$(sed -n 's/^pub const NI_ABI_VERSION: u32 = \([0-9]*\);/\1/p' src/ffi/version.rs)
ln -s "$lib/libnanoinfer.so" "$asan/libnanoinfer.so.$abi"  # the SONAME the examples load
san=(-g -O1 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -Iinclude)
cc -std=c11 "${san[@]}" examples-c/chat/chat.c -o "$asan/chat" -L"$lib" -lnanoinfer -Wl,-rpath,"$asan"
c++ -std=c++17 "${san[@]}" examples-c/batch/batch.cpp -o "$asan/batch" -L"$lib" -lnanoinfer -Wl,-rpath,"$asan" -pthread
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
"$asan/chat" models/SmolLM2-135M-Instruct "What is the capital of France?" --max-tokens 24 --threads 2 >"$asan/chat.out"
grep -q Paris "$asan/chat.out" || { echo "ASan chat example: unexpected reply: $(cat "$asan/chat.out")" >&2; exit 1; }
"$asan/batch" models/SmolLM2-135M-Instruct --threads 2 >"$asan/batch.out"
grep -q "(.* tokens, cancelled)" "$asan/batch.out" || { echo "ASan batch example: no cancelled request" >&2; exit 1; }
unset ASAN_OPTIONS UBSAN_OPTIONS
rm -rf "$asan"
if [ -n "${NANOINFER_CI_FUZZ_SECS:-}" ]; then
  # Opt-in (see TESTING.md, "CI quick versions"): installs nightly and
  # cargo-fuzz when missing, then a cold ASan build of the targets.
  echo "== libFuzzer smoke: ${NANOINFER_CI_FUZZ_SECS} s per target" >&2
  bash scripts/fuzz.sh "$NANOINFER_CI_FUZZ_SECS"
fi
echo "== scripts/check_kernels.py --ptxas (CUDA kernels compile with NVRTC and assemble with ptxas)" >&2
python3 scripts/check_kernels.py --ptxas
echo "== scripts/test_server.sh (nanoinfer serve: OpenAI client, browser, load)" >&2
bash scripts/test_server.sh
echo "== scripts/test_packaging.sh" >&2
bash scripts/test_packaging.sh
