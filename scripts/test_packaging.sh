#!/usr/bin/env bash
# Packaging test for the embeddable library (issue 3), from the repo root:
#   1. include/nanoinfer.h equals what cbindgen generates (tests/ffi_header.rs);
#   2. the CMake package builds (reusing cargo's target dir) and installs to a
#      temporary prefix, with the files, SONAME and pkg-config data expected;
#   3. the C and C++ examples build as separate CMake projects against the
#      installed package (find_package(nanoinfer CONFIG REQUIRED)), shared and
#      static, and run on the default model;
#   4. the C example runs under valgrind with no leaks and no errors, on a
#      tiny random model with the default model's tokenizer
#      (scripts/make_tiny_chat_model.py; the 540 MB model takes >20 min there);
#   5. `go test ./...` in bindings/go passes against the installed library.
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
echo "== done ($((SECONDS - t0)) s)" >&2
