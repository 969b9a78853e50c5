#!/usr/bin/env bash
# NanoInfer against llama.cpp on the CPU of a lent machine (the GPU hosts are
# Sapphire Rapids: AVX512-BF16, AMX) that cannot receive the real weights
# (64 MiB upload limit): both engines run the same random weights in
# SmolLM2-135M's shapes and metadata, pinned to 2 cores, side by side.
#
#   here:  scripts/bench_cpu_lent.sh prepare
#          fills cpu-carry/ (git-ignored): llama.cpp built for Sapphire Rapids
#          (scripts/build_llamacpp.sh --arch sapphirerapids), a release
#          nanoinfer, the model skeleton (scripts/random_smollm2.py skeleton),
#          gguf-py, membw.c and the shared libraries llama.cpp links.
#   there: scripts/bench_cpu_lent.sh run [--runs N] [--cores 2,3] [--precisions "F32 BF16 Q8_0"]
#          (through the device tool with carry ["cpu-carry"]); needs python3
#          with numpy, torch and safetensors, and cc for membw.
# Prints one table per run and a median table last. NANOINFER_AMX=0 rows
# show NanoInfer's BF16 without AMX (AVX512-BF16 only) in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=cpu-carry
CACHE="${NANOINFER_CACHE:-$HOME/.cache/nanoinfer}"

prepare() {
    local llama gguf_f32
    llama="$(bash scripts/build_llamacpp.sh --arch sapphirerapids | tail -1)"
    gguf_f32="$CACHE/gguf/SmolLM2-135M-Instruct-F32.gguf"
    [[ -f "$gguf_f32" ]] || { echo "missing $gguf_f32: run scripts/bench_cpu.sh once" >&2; exit 1; }
    cargo build --release --bin nanoinfer
    rm -rf "$CARRY"
    mkdir -p "$CARRY/lib"
    strip -o "$CARRY/nanoinfer" "${CARGO_TARGET_DIR:-target}/release/nanoinfer"
    cp "$llama/llama-bench" "$llama/llama-quantize" "$CARRY/"
    cp -r "$(dirname "$llama")/../src/gguf-py" "$CARRY/gguf-py"
    cp scripts/membw.c models/SmolLM2-135M-Instruct/config.json "$CARRY/"
    PYTHONPATH="$CARRY/gguf-py" python3 scripts/random_smollm2.py skeleton --gguf "$gguf_f32" \
        --out "$CARRY/skeleton.pkl"
    for lib in $(ldd "$llama/llama-bench" | awk '/=> \//{print $3}' | grep -E 'gomp|ssl|crypto'); do
        cp "$lib" "$CARRY/lib/"
    done
    du -sh "$CARRY"
}

median() { python3 -c 'import math,statistics,sys; v=[float(x) for x in sys.argv[1:] if x and not math.isnan(float(x))]; print(f"{statistics.median(v):.1f}" if v else "nan")' "$@"; }
ratio() { python3 -c 'import sys; a,b=map(float,sys.argv[1:]); print("n/a" if a!=a or b!=b else f"{a/b:.2f}×")' "$1" "$2"; }

run() {
    local runs=3 cores=2,3 precisions="F32 BF16 Q8_0" work=/tmp/nanoinfer-cpu
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --runs) runs="$2"; shift 2 ;;
            --cores) cores="$2"; shift 2 ;;
            --precisions) precisions="$2"; shift 2 ;;
            *) echo "bench_cpu_lent.sh run: unknown argument $1" >&2; exit 2 ;;
        esac
    done
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$PWD/$CARRY/lib"
    mkdir -p "$work"
    if [[ ! -f "$work/bf16/model.safetensors" ]]; then
        PYTHONPATH="$CARRY/gguf-py" python3 scripts/random_smollm2.py make --skeleton "$CARRY/skeleton.pkl" \
            --config "$CARRY/config.json" --out "$work"
    fi
    for q in BF16 Q8_0; do
        [[ -f "$work/$q.gguf" ]] && continue
        if ! "$CARRY/llama-quantize" "$work/F32.gguf" "$work/$q.gguf.tmp" "$q" >"$work/quantize-$q.log" 2>&1; then
            echo "llama-quantize to $q failed:" >&2
            tail -5 "$work/quantize-$q.log" >&2
            continue
        fi
        mv "$work/$q.gguf.tmp" "$work/$q.gguf"
    done
    cc -O2 -march=native -pthread -o "$work/membw" "$CARRY/membw.c" 2>/dev/null || true
    local cpu flags
    cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
    flags="$(grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx512_bf16|amx_bf16|amx_tile|avx512_vnni)$' | tr '\n' ' ')"
    echo "cpu:$cpu; cores $cores; flags: $flags"
    [[ -x "$work/membw" ]] && taskset -c "$cores" "$work/membw" --threads 2 || true
    local pin=(taskset -c "$cores")
    declare -A res
    for r in $(seq 1 "$runs"); do
        for p in $precisions; do
            local model quant=() gguf="$work/$p.gguf"
            case $p in
                F32) model="$work/f32" ;;
                BF16) model="$work/bf16" ;;
                Q8_0) model="$work/f32"; quant=(--quant q8_0) ;;
            esac
            local lj nj
            lj="$("${pin[@]}" "$CARRY/llama-bench" -m "$gguf" -p 512 -n 128 -t 2 -r 3 -o json 2>"$work/llama-bench.err")" || {
                echo "llama-bench failed on $gguf:" >&2
                tail -5 "$work/llama-bench.err" >&2
                lj='[{"n_prompt": 512, "n_gen": 0, "avg_ts": "nan"}, {"n_prompt": 0, "n_gen": 128, "avg_ts": "nan"}]'
            }
            nj="$("${pin[@]}" "$CARRY/nanoinfer" bench --model "$model" "${quant[@]}" -p 512 -n 128 -t 2 -r 3 --json)"
            res[$p,llama_pp,$r]=$(echo "$lj" | python3 -c 'import json,sys; print(next(t["avg_ts"] for t in json.load(sys.stdin) if t["n_prompt"]>0))')
            res[$p,llama_tg,$r]=$(echo "$lj" | python3 -c 'import json,sys; print(next(t["avg_ts"] for t in json.load(sys.stdin) if t["n_gen"]>0))')
            res[$p,ours_pp,$r]=$(echo "$nj" | python3 -c 'import json,sys; print(json.load(sys.stdin)["pp_tokens_per_s"])')
            res[$p,ours_tg,$r]=$(echo "$nj" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tg_tokens_per_s"])')
            if [[ $p == BF16 ]]; then
                nj="$(NANOINFER_AMX=0 "${pin[@]}" "$CARRY/nanoinfer" bench --model "$model" -p 512 -n 0 -t 2 -r 3 --json)"
                res[$p,noamx_pp,$r]=$(echo "$nj" | python3 -c 'import json,sys; print(json.load(sys.stdin)["pp_tokens_per_s"])')
            fi
            echo "run $r $p: llama.cpp pp512 ${res[$p,llama_pp,$r]} tg128 ${res[$p,llama_tg,$r]} |" \
                "NanoInfer pp512 ${res[$p,ours_pp,$r]} tg128 ${res[$p,ours_tg,$r]}" \
                "${res[$p,noamx_pp,$r]:+| NanoInfer pp512 without AMX ${res[$p,noamx_pp,$r]}}"
        done
    done
    echo
    echo "| precision | llama.cpp pp512 | NanoInfer pp512 | ratio | llama.cpp tg128 | NanoInfer tg128 | ratio |"
    echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    for p in $precisions; do
        local lp op lt ot
        lp=$(median $(for r in $(seq 1 "$runs"); do echo "${res[$p,llama_pp,$r]}"; done))
        op=$(median $(for r in $(seq 1 "$runs"); do echo "${res[$p,ours_pp,$r]}"; done))
        lt=$(median $(for r in $(seq 1 "$runs"); do echo "${res[$p,llama_tg,$r]}"; done))
        ot=$(median $(for r in $(seq 1 "$runs"); do echo "${res[$p,ours_tg,$r]}"; done))
        echo "| $p | $lp | $op | $(ratio "$op" "$lp") | $lt | $ot | $(ratio "$ot" "$lt") |"
    done
    if [[ " $precisions " == *" BF16 "* ]]; then
        echo "BF16 pp512 without AMX (NANOINFER_AMX=0): $(median $(for r in $(seq 1 "$runs"); do echo "${res[BF16,noamx_pp,$r]}"; done))"
    fi
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    *) sed -n '2,17p' "$0"; exit 2 ;;
esac
