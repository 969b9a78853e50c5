#!/usr/bin/env bash
# Builds llama.cpp's `llama-bench` and `llama-quantize` (CPU only, Release,
# -DGGML_NATIVE=ON) from the llama.cpp sources vendored in the
# llama-cpp-python sdist on PyPI, into
#   ${NANOINFER_CACHE:-~/.cache/nanoinfer}/llama.cpp-<llama-cpp-python version>/
# Idempotent: an existing build is reused. Prints the directory holding the
# binaries on its last line of stdout (progress goes to stderr).
#
# --arch sapphirerapids builds instead for another machine (a lent Sapphire
# Rapids host): GGML_NATIVE off, AVX-512 (VBMI, VNNI, BF16) and AMX (tile,
# int8, bf16) on, into build-sapphirerapids/. Such a build may not run here.
#
# --arch avx2 builds for AVX2 without AVX-512 into build-avx2/, the peer of
# NanoInfer's NANOINFER_ISA=avx2 on an AVX-512 machine.
#
# usage: scripts/build_llamacpp.sh [--version X.Y.Z] [--jobs N] [--arch native|avx2|sapphirerapids]
set -euo pipefail

VERSION="0.3.36"   # llama-cpp-python release; its vendor/llama.cpp is pinned below
JOBS="$(nproc)"
ARCH=native
while [[ $# -gt 0 ]]; do
    case "$1" in
        --version) VERSION="$2"; shift 2 ;;
        --jobs) JOBS="$2"; shift 2 ;;
        --arch) ARCH="$2"; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "build_llamacpp.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

log() { echo "[build_llamacpp] $*" >&2; }

# The sdist carries no .git (llama.cpp's own build-info says "unknown"); the
# llama.cpp commit is named in llama-cpp-python's CHANGELOG for the release.
record_version() {
    local sdist commit
    sdist="$(ls "$ROOT"/sdist/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
    [[ -n "$sdist" ]] || return 0
    commit="$(tar -xzOf "$sdist" "llama_cpp_python-$VERSION/CHANGELOG.md" 2>/dev/null |
        awk -v v="## [$VERSION]" '$0 == v {on=1; next} /^## \[/ {on=0} on' |
        grep -o 'llama\.cpp@[0-9a-f]\+' | head -1 | cut -d@ -f2 || true)"
    echo "llama-cpp-python $VERSION (PyPI sdist), vendor/llama.cpp at ggml-org/llama.cpp@${commit:-unknown}" \
        >"$ROOT/LLAMA_CPP_VERSION"
}

CACHE="${NANOINFER_CACHE:-$HOME/.cache/nanoinfer}"
ROOT="$CACHE/llama.cpp-$VERSION"
SRC="$ROOT/src"
case "$ARCH" in
    native)
        BUILD="$ROOT/build"
        ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
    avx2)
        # What an AVX2-only CPU (AMD Zen 2/3, Intel client parts since Alder
        # Lake) runs, built on any x86-64 machine: the peer of
        # NANOINFER_ISA=avx2 on an AVX-512 host.
        BUILD="$ROOT/build-avx2"
        ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
            -DGGML_BMI2=ON -DGGML_AVX512=OFF) ;;
    sapphirerapids)
        BUILD="$ROOT/build-sapphirerapids"
        ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
            -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
            -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON) ;;
    *) echo "build_llamacpp.sh: unknown --arch $ARCH (native, avx2 or sapphirerapids)" >&2; exit 2 ;;
esac
BIN="$BUILD/bin"

if [[ -x "$BIN/llama-bench" && -x "$BIN/llama-quantize" ]]; then
    [[ -f "$ROOT/LLAMA_CPP_VERSION" ]] || record_version
    log "already built: $BIN ($(cat "$ROOT/LLAMA_CPP_VERSION" 2>/dev/null || echo 'version unknown'))"
    echo "$BIN"
    exit 0
fi

for tool in cmake python3 tar; do
    command -v "$tool" >/dev/null || { log "error: $tool is required"; exit 1; }
done
mkdir -p "$ROOT"

if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    SDIST_DIR="$ROOT/sdist"
    mkdir -p "$SDIST_DIR"
    SDIST="$(ls "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
    if [[ -z "$SDIST" ]]; then
        log "downloading the llama-cpp-python==$VERSION sdist from PyPI into $SDIST_DIR"
        python3 -m pip download --quiet --no-binary :all: --no-deps \
            -d "$SDIST_DIR" "llama-cpp-python==$VERSION" >&2
        SDIST="$(ls "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz)"
    fi
    log "extracting vendor/llama.cpp from $(basename "$SDIST")"
    rm -rf "$ROOT/extract" "$SRC"
    mkdir -p "$ROOT/extract"
    tar -xzf "$SDIST" -C "$ROOT/extract" "llama_cpp_python-$VERSION/vendor/llama.cpp"
    mv "$ROOT/extract/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
    rm -rf "$ROOT/extract"
fi

record_version
log "llama.cpp source: $(cat "$ROOT/LLAMA_CPP_VERSION")"
log "configuring (Release, ${ISA_FLAGS[*]}, LLAMA_CURL=OFF, CPU only) in $BUILD"
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF >&2
log "building llama-bench and llama-quantize with $JOBS jobs (a few minutes on 2 cores)"
cmake --build "$BUILD" --config Release -j "$JOBS" --target llama-bench llama-quantize >&2
log "done: $BIN"
echo "$BIN"
