#!/usr/bin/env bash
# Packaging test for the embeddable library (issue 3), from the repo root:
#   1. include/nanoinfer.h equals what cbindgen generates (tests/ffi_header.rs);
#   2. the CMake package builds (reusing cargo's target dir) and installs to a
#      temporary prefix, with the files, SONAME and pkg-config data expected;
#   3. the installed static library defines exactly the header's ni_* functions
#      and nothing else, links with -Wl,--whole-archive beside another Rust
#      staticlib (a throwaway no-dependency crate) and leaves the app's libm
#      alone (sqrt(-1) sets errno); the installed shared library is stripped and
#      its .gnu_debuglink names an installed debug file with the right CRC;
#   4. the C and C++ examples build as separate CMake projects against the
#      installed package (find_package(nanoinfer CONFIG REQUIRED)), shared and
#      static, and run on the default model;
#   5. the C example runs under valgrind with no leaks and no errors, on a
#      tiny random model with the default model's tokenizer
#      (scripts/make_tiny_chat_model.py; the 540 MB model takes >20 min there);
#   6. `go test ./...` in bindings/go passes against the installed library.
# Needs cargo, cmake, a C/C++ compiler, pkg-config, valgrind, numpy (all
# installed by `NANOINFER_SETUP_PACKAGING=1 scripts/setup.sh`, which
# scripts/test.sh runs) and Go >= 1.24 (PATH or /usr/local/go; without it the
# Go step is skipped with a message, or fails if NANOINFER_REQUIRE_GO=1).
# Env: NANOINFER_MODEL (default models/SmolLM2-135M-Instruct), CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
model=${NANOINFER_MODEL:-$root/models/SmolLM2-135M-Instruct}
target_dir=${CARGO_TARGET_DIR:-$root/target}
work=$(mktemp -d "${TMPDIR:-/tmp}/nanoinfer-packaging.XXXXXX")
prefix=$work/prefix
passed=0
current=""

finish() {
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "FAILED: $current (logs in $work)" >&2
    echo "packaging: $passed passed, 1 failed"
  else
    rm -rf "$work"
    echo "packaging: $passed passed, 0 failed"
  fi
}
trap finish EXIT

step() { current=$*; echo "== $current ($((SECONDS - ${t0:-0})) s)" >&2; }
ok() { passed=$((passed + 1)); }
# Runs a command with its output in $work/<name>.log, shown on failure.
logged() {
  local name=$1; shift
  if ! "$@" >"$work/$name.log" 2>&1; then
    tail -n 60 "$work/$name.log" >&2
    return 1
  fi
}

need() {  # need COMMAND PACKAGE
  command -v "$1" >/dev/null && return 0
  echo "$1 is required: run NANOINFER_SETUP_PACKAGING=1 scripts/setup.sh (or apt-get install $2)" >&2
  exit 1
}
need cmake cmake
need make make
need c++ g++
need readelf binutils
need objcopy binutils
need cc gcc
need pkg-config pkg-config
need valgrind valgrind
# Go >= 1.24, from PATH or the official tarball's default location.
go_ok() { command -v go >/dev/null && go version | grep -qE 'go1\.(2[4-9]|[3-9][0-9])|go[2-9]'; }
if ! go_ok && [ -x /usr/local/go/bin/go ]; then export PATH=$PATH:/usr/local/go/bin; fi
if go_ok; then have_go=1; else
  have_go=0
  if [ "${NANOINFER_REQUIRE_GO:-0}" = 1 ]; then echo "go >= 1.24 is required for bindings/go" >&2; exit 1; fi
fi
t0=$SECONDS
[ -f "$model/config.json" ] || { echo "default model missing at $model: run scripts/setup.sh" >&2; exit 1; }
version=$(sed -n 's/^version *= *"\([0-9.]*\)".*/\1/p' Cargo.toml | head -n 1)
abi=$(sed -n 's/^pub const NI_ABI_VERSION: u32 = \([0-9]*\);/\1/p' src/ffi/version.rs)

step "header is what cbindgen generates"
logged header cargo test --release --test ffi_header
ok

step "CMake package: build (cargo target dir $target_dir) and install to $prefix"
logged cmake-configure cmake -S . -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DNANOINFER_CARGO_TARGET_DIR="$target_dir"
logged cmake-build cmake --build "$work/build"
logged cmake-install cmake --install "$work/build" --prefix "$prefix"
libdir=$prefix/lib
for f in "$libdir/libnanoinfer.so.$abi" "$libdir/libnanoinfer.a" "$prefix/include/nanoinfer.h" \
         "$libdir/cmake/nanoinfer/nanoinferConfig.cmake" "$libdir/cmake/nanoinfer/nanoinferConfigVersion.cmake" \
         "$libdir/pkgconfig/nanoinfer.pc"; do
  [ -f "$f" ] || { echo "not installed: $f" >&2; exit 1; }
done
[ "$(readlink "$libdir/libnanoinfer.so")" = "libnanoinfer.so.$abi" ] || { echo "libnanoinfer.so is not a link to libnanoinfer.so.$abi" >&2; exit 1; }
readelf -d "$libdir/libnanoinfer.so.$abi" | grep -q "SONAME.*\[libnanoinfer.so.$abi\]" || { echo "SONAME is not libnanoinfer.so.$abi" >&2; exit 1; }
cmp -s include/nanoinfer.h "$prefix/include/nanoinfer.h" || { echo "installed header differs" >&2; exit 1; }
pc_version=$(PKG_CONFIG_PATH=$libdir/pkgconfig pkg-config --modversion nanoinfer)
[ "$pc_version" = "$version" ] || { echo "pkg-config version $pc_version, crate $version" >&2; exit 1; }
ok

step "static library: exactly the header's ni_* functions are global"
# Function declarations start in column 0 in the generated header.
grep -oE '^[A-Za-z_][A-Za-z0-9_ *]*[ *]ni_[a-z0-9_]+\(' include/nanoinfer.h | grep -oE 'ni_[a-z0-9_]+\($' \
  | tr -d '(' | sort -u >"$work/api-header.txt"
# readelf, not nm: nm gives objects with embedded LLVM bitcode (Rust's std) to
# an installed LLVM gold plugin, which can fail on them and list nothing.
defined_globals() {  # every global or weak symbol an ELF file or archive defines
  readelf -sW "$1" | awk '$5 ~ /^(GLOBAL|WEAK|UNIQUE)$/ && $7 != "UND" { print $8 }' | sort
}
defined_globals "$libdir/libnanoinfer.a" >"$work/api-static.txt"
if ! diff -u "$work/api-header.txt" "$work/api-static.txt" >"$work/api.diff"; then
  head -n 40 "$work/api.diff" >&2
  echo "libnanoinfer.a's global symbols are not the header's $(wc -l <"$work/api-header.txt") ni_* functions" >&2
  exit 1
fi
echo "   libnanoinfer.a: $(wc -l <"$work/api-static.txt") global symbols = the header's functions" \
     "(cargo's archive: $(defined_globals "$target_dir/release/libnanoinfer.a" | wc -l))" >&2
ok

step "static library beside another Rust staticlib, both --whole-archive; libm untouched"
other=$work/otherlib
mkdir -p "$other/src"
cat >"$other/Cargo.toml" <<'TOML'
[package]
name = "otherlib"
version = "0.1.0"
edition = "2021"
[lib]
crate-type = ["staticlib"]
TOML
cat >"$other/src/lib.rs" <<'RUST'
#[no_mangle]
pub extern "C" fn otherlib_answer() -> u32 {
    "forty-two".len() as u32 * 4 + 6
}
RUST
logged otherlib env CARGO_TARGET_DIR="$other/target" cargo build --release --offline --manifest-path "$other/Cargo.toml"
other_a=$other/target/release/libotherlib.a
cat >"$work/two_rust_libs.c" <<'C'
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "nanoinfer.h"
uint32_t otherlib_answer(void);
int main(void) {
  printf("nanoinfer %s\n", ni_version());
#ifdef WITH_OTHERLIB
  if (otherlib_answer() != 42) { fprintf(stderr, "otherlib_answer() = %u\n", otherlib_answer()); return 1; }
#endif
  /* A panic inside the library unwinds to its C boundary (with
     NANOINFER_TEST_HOOKS=1): its personality routine survives the prelink. */
  ni_status st = ni_debug_force_panic(NULL);
  if (st != NI_ERR_PANIC) { fprintf(stderr, "ni_debug_force_panic(NULL) = %s\n", ni_status_name(st)); return 1; }
#ifdef CHECK_LIBM
  volatile double minus_one = -1.0;  /* not constant-folded: libm's sqrt runs */
  errno = 0;
  double r = sqrt(minus_one);
  if (!isnan(r) || errno != EDOM) {
    fprintf(stderr, "sqrt(-1): errno %d, not EDOM: a sqrt other than libm's was linked\n", errno);
    return 1;
  }
#endif
  return 0;
}
C
# The static library's native dependencies as the installed .pc lists them.
static_deps=$(PKG_CONFIG_PATH=$libdir/pkgconfig pkg-config --static --libs nanoinfer | tr ' ' '\n' | grep -vE '^(-L.*|-lnanoinfer|)$' | tr '\n' ' ')
link_c() {  # link_c EXE [cc args...]: two_rust_libs.c with the given archives
  local exe=$1; shift
  # shellcheck disable=SC2086
  logged "link-$exe" cc -O2 -I"$prefix/include" "$work/two_rust_libs.c" -o "$work/$exe" "$@" $static_deps -lm
}
# A plain Rust staticlib carries compiler_builtins' own sqrt/fmod/..., so with
# it in the link sqrt is not libm's whatever nanoinfer does: the errno check
# then runs in a program with nanoinfer alone.
if defined_globals "$other_a" | grep -qx sqrt; then both_flags=""; else both_flags="-DCHECK_LIBM"; fi
# shellcheck disable=SC2086
link_c two_rust_libs -DWITH_OTHERLIB $both_flags -Wl,--whole-archive "$libdir/libnanoinfer.a" "$other_a" -Wl,--no-whole-archive
link_c nanoinfer_only -DCHECK_LIBM -Wl,--whole-archive "$libdir/libnanoinfer.a" -Wl,--no-whole-archive
for exe in two_rust_libs nanoinfer_only; do
  logged "run-$exe" env NANOINFER_TEST_HOOKS=1 "$work/$exe"
  grep -qx "nanoinfer $version" "$work/run-$exe.log" || { echo "$exe: ni_version() is not $version" >&2; exit 1; }
done
# Not a check, the reason for one: cargo's own archive in the same link.
if link_c cargo_archive -DCHECK_LIBM -Wl,--whole-archive "$target_dir/release/libnanoinfer.a" -Wl,--no-whole-archive 2>/dev/null \
   && env NANOINFER_TEST_HOOKS=1 "$work/cargo_archive" >/dev/null 2>&1; then
  echo "   (cargo's own archive leaves sqrt alone too with this toolchain)" >&2
else
  echo "   (cargo's own archive, linked the same way, replaces libm's sqrt)" >&2
fi
ok

step "shared library stripped, its debug info in lib/.debug"
so=$libdir/libnanoinfer.so.$abi
if readelf -SW "$so" | grep -qE ' \.(debug_info|symtab) '; then echo "$so still has debug info or .symtab" >&2; exit 1; fi
# .gnu_debuglink: the debug file's name, NUL, padding to 4 bytes, its CRC-32.
objcopy --dump-section .gnu_debuglink="$work/debuglink" "$so" "$work/so-copy" \
  || { echo "$so has no .gnu_debuglink" >&2; exit 1; }
debug_name=$(python3 - "$work/debuglink" "$libdir/.debug" <<'PY'
import os, struct, sys, zlib
link = open(sys.argv[1], "rb").read()
name = link.split(b"\0", 1)[0].decode()
path = os.path.join(sys.argv[2], name)
if not os.path.isfile(path):
    sys.exit(f".gnu_debuglink names {name}, not installed at {path}")
(want,) = struct.unpack("<I", link[-4:])
got = zlib.crc32(open(path, "rb").read()) & 0xFFFFFFFF
if got != want:
    sys.exit(f"{path}: CRC-32 {got:08x}, .gnu_debuglink says {want:08x}")
print(name)
PY
)
debug_file=$libdir/.debug/$debug_name
readelf -SW "$debug_file" | grep -q ' \.debug_info ' || { echo "$debug_file has no .debug_info" >&2; exit 1; }
build_id() { readelf -n "$1" | sed -n 's/^ *Build ID: //p'; }
[ "$(build_id "$so")" = "$(build_id "$debug_file")" ] || { echo "$debug_file is not $so's (build IDs differ)" >&2; exit 1; }
size_mb() { awk -v b="$(stat -c %s "$1")" 'BEGIN { printf "%.1f MB", b / 1e6 }'; }
echo "   $(basename "$so") $(size_mb "$so") (cargo's: $(size_mb "$target_dir/release/libnanoinfer.so")), .debug/$debug_name $(size_mb "$debug_file")," \
     "libnanoinfer.a $(size_mb "$libdir/libnanoinfer.a") (cargo's: $(size_mb "$target_dir/release/libnanoinfer.a"))" >&2
ok

step "examples build against the installed package"
logged chat-configure cmake -S examples-c/chat -B "$work/chat" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release
logged chat-build cmake --build "$work/chat"
logged batch-configure cmake -S examples-c/batch -B "$work/batch" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release
logged batch-build cmake --build "$work/batch"
ok

step "C example (shared and static) streams a reply"
for exe in chat chat_static; do
  "$work/chat/$exe" "$model" "What is the capital of France?" --max-tokens 24 --threads 2 \
    >"$work/$exe.out" 2>"$work/$exe.err" || { cat "$work/$exe.err" >&2; exit 1; }
  grep -qx "nanoinfer $version" "$work/$exe.err" || { echo "$exe: ni_version() is not $version" >&2; exit 1; }
  grep -q "Paris" "$work/$exe.out" || { echo "$exe: unexpected reply: $(cat "$work/$exe.out")" >&2; exit 1; }
  echo "   $exe: $(head -c 120 "$work/$exe.out" | tr '\n' ' ')" >&2
done
ok

step "C++ example: concurrent requests, one cancelled"
logged batch-run "$work/batch/batch" "$model" --threads 2
grep -q "(.* tokens, cancelled)" "$work/batch-run.log"
ok

step "C example under valgrind on a tiny model (no leaks, no errors)"
tiny=$work/tiny-chat
logged tiny-model python3 scripts/make_tiny_chat_model.py --tokenizer "$model" --out "$tiny"
logged valgrind valgrind --leak-check=full --show-leak-kinds=definite,indirect,possible \
  --errors-for-leak-kinds=definite,indirect,possible --error-exitcode=1 --suppressions=examples-c/valgrind.supp \
  "$work/chat/chat" "$tiny" "Say hi" --max-tokens 8 --threads 2
grep -q "definitely lost: 0 bytes\|All heap blocks were freed" "$work/valgrind.log"
grep -E "ERROR SUMMARY|definitely lost|possibly lost" "$work/valgrind.log" | sed 's/^/   /' >&2
ok

if [ "$have_go" = 0 ]; then
  echo "== SKIPPED go test in bindings/go: no go >= 1.24 on PATH or in /usr/local/go" >&2
  exit 0
fi
step "go test ./... in bindings/go against the installed library"
(
  cd bindings/go
  export PKG_CONFIG_PATH=$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export CGO_LDFLAGS="-Wl,-rpath,$libdir"
  export NANOINFER_MODEL=$model GOTOOLCHAIN=local GOFLAGS=-mod=mod
  go vet ./... && go test -count=1 -v ./...
) >"$work/go-test.log" 2>&1 || { tail -n 60 "$work/go-test.log" >&2; exit 1; }
grep -E "^(--- |ok|FAIL)" "$work/go-test.log" | sed 's/^/   /' >&2
ok

step "bindings/go/example answers a question and stops at its -timeout"
(
  cd bindings/go
  export PKG_CONFIG_PATH=$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export CGO_LDFLAGS="-Wl,-rpath,$libdir" GOTOOLCHAIN=local GOFLAGS=-mod=mod
  go build -o "$work/go-example" ./example
)
"$work/go-example" -model "$model" -threads 2 -max-tokens 24 "What is the capital of France?" >"$work/go-example.out"
grep -q Paris "$work/go-example.out" || { echo "Go example: unexpected reply: $(cat "$work/go-example.out")" >&2; exit 1; }
long_question="Summarize this: $(printf 'the fox runs over the hill. %.0s' $(seq 400))"
if "$work/go-example" -model "$model" -threads 2 -timeout 300ms "$long_question" >"$work/go-example-timeout.out" 2>&1; then
  echo "Go example: a 300 ms timeout did not stop a long prompt" >&2; exit 1
fi
grep -q "context deadline exceeded" "$work/go-example-timeout.out"
ok
echo "== done ($((SECONDS - t0)) s)" >&2
