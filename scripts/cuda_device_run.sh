#!/usr/bin/env bash
# Runs the CUDA checks on a GPU machine that has no Rust: the release binaries
# built elsewhere are in $BIN (nanoinfer, cuda test binary), torch +
# transformers are installed. Prints a short table last.
#   BIN=gpu-carry bash scripts/cuda_device_run.sh [fixtures|tests|bench]...
set -uo pipefail
BIN=${BIN:-gpu-carry}
WORK=${WORK:-/tmp/nanoinfer-gpu}
mkdir -p "$WORK"
# cuBLAS / NVRTC: the toolkit's, else the pip wheels torch brought.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, s, "lib") for p in nvidia.__path__ for s in os.listdir(p)))' 2>/dev/null); do
    [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$d"
done
export LD_LIBRARY_PATH NANOINFER_KERNEL_CACHE="$WORK/kernels"
for step in "$@"; do
    case $step in
    fixtures)
        python3 scripts/cuda_fixtures.py "$WORK/fx" ;;
    tests)
        NANOINFER_CUDA_FIXTURES="$WORK/fx" "$BIN/cuda" --test-threads 1 --nocapture 2>&1 | tail -40 ;;
    make8b)
        [ -f "$WORK/l8b/config.json" ] || python3 scripts/cuda_bench_hf.py --make-8b "$WORK/l8b"
        [ -f "$WORK/l8b/golden.json" ] || python3 scripts/cuda_bench_hf.py --golden "$WORK/l8b" ;;
    tests8b)
        NANOINFER_CUDA_FIXTURES="$WORK/fx" NANOINFER_CUDA_8B="$WORK/l8b" "$BIN/cuda" --test-threads 1 --nocapture \
            eight_b 2>&1 | tail -12 ;;
    profile)
        if command -v nsys >/dev/null; then
            nsys profile -o "$WORK/prof" --force-overwrite true "$BIN/nanoinfer" bench --model "$WORK/l8b" \
                --device cuda -p 512 -n 64 -r 1 >/dev/null 2>&1
            nsys stats -r cuda_gpu_kern_sum -f csv "$WORK/prof.nsys-rep" 2>/dev/null \
                | python3 -c 'import sys,csv; r=list(csv.DictReader(l for l in sys.stdin if "," in l)); [print(f"{float(x["Time (%)"]):5.1f}% {int(float(x["Total Time (ns)"]))/1e6:9.2f} ms {x["Instances"]:>6} {x["Name"][:70]}") for x in r[:14]]'
        else
            echo "nsys not found"
        fi ;;
    bench)
        "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda -p 512 -n 128 -r 3 --json | tee "$WORK/ours.json"
        NANOINFER_CUDA_GRAPHS=0 "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda -p 512 -n 128 -r 3 --json \
            | tee "$WORK/ours-nographs.json"
        NANOINFER_CUDA_GEMV=0 "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda -p 0 -n 128 -r 3 --json \
            | tee "$WORK/ours-cublas.json"
        for depth in 1024 32768; do
            "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda -p 0 -n 64 -d $depth -r 3
        done
        python3 scripts/cuda_bench_hf.py --model "$WORK/l8b" -p 512 -n 128 -r 3 | tee "$WORK/hf.json" ;;
    engine)
        "$BIN/engine_bench" --model "$WORK/l8b" --device cuda --concurrency 1,16,64,256 --decode-tokens 128 \
            --prompt-len 512 --skip-prefix ;;
    offline)
        "$BIN/engine_bench" --model "$WORK/l8b" --device cuda --offline 1000 --prompt-len 512 --decode-tokens 256 \
            --max-seqs 256 --max-batched-tokens 8192 ;;
    esac
done
