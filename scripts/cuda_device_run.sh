#!/usr/bin/env bash
# Runs the CUDA checks on a GPU machine that has no Rust: the release binaries
# built elsewhere are in $BIN (nanoinfer, cuda test binary), torch +
# transformers are installed. Prints a short table last.
#   BIN=gpu-carry bash scripts/cuda_device_run.sh [fixtures|tests|int4test|fp8test|make8b|tests8b|bench|bench8|bench4|ab|ab4|profile|trace|sampling|serve|http|grammar|spec|state|engine|offline|kvfp8]...
# Binaries: `bash scripts/cuda_carry.sh` (here, with Rust) fills gpu-carry/.
# KV_CACHE_DTYPE=fp8 runs the offline steps with an FP8 KV cache (default auto).
set -uo pipefail
BIN=${BIN:-gpu-carry}
WORK=${WORK:-/tmp/nanoinfer-gpu}
KV_CACHE_DTYPE=${KV_CACHE_DTYPE:-auto}
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
        [ -f "$WORK/fx/qwen3/golden_fp8kv.json" ] || python3 scripts/cuda_fixtures.py "$WORK/fx" ;;
    tests)
        NANOINFER_CUDA_FIXTURES="$WORK/fx" "$BIN/cuda" --test-threads 1 --nocapture 2>&1 | tail -40 ;;
    int4test)
        # tests/cuda.rs's int4 test alone (~1-2 minutes).
        NANOINFER_CUDA_FIXTURES="$WORK/fx" "$BIN/cuda" --test-threads 1 --nocapture int4 2>&1 | tail -32 ;;
    make8b)
        [ -f "$WORK/l8b/config.json" ] || python3 scripts/cuda_bench_hf.py --make-8b "$WORK/l8b"
        [ -f "$WORK/l8b/golden.json" ] || python3 scripts/cuda_bench_hf.py --golden "$WORK/l8b" ;;
    tests8b)
        NANOINFER_CUDA_FIXTURES="$WORK/fx" NANOINFER_CUDA_8B="$WORK/l8b" "$BIN/cuda" --test-threads 1 --nocapture \
            eight_b 2>&1 | grep -E "^test |test result|panicked|8B" ;;
    profile)
        # Per-kernel GPU time (NANOINFER_CUDA_PROFILE: events around every launch, graphs off).
        for args in "-p 0 -n 64" "-p 512 -n 0"; do
            echo "== profile: bench $args"
            NANOINFER_CUDA_PROFILE=20 "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda $args -r 1 2>&1 \
                | grep -A16 NANOINFER_CUDA_PROFILE
        done
        echo "== profile: offline, 256 requests x (512 + 128)"
        NANOINFER_CUDA_PROFILE=1 "$BIN/engine_bench" --model "$WORK/l8b" --device cuda --offline 256 --prompt-len 512 \
            --decode-tokens 128 --max-seqs 256 --max-batched-tokens 8192 2>&1 | grep -A16 "offline:\|NANOINFER_CUDA_PROFILE"
        echo "== profile: engine, 256 concurrent decodes"
        NANOINFER_CUDA_PROFILE=5 "$BIN/engine_bench" --model "$WORK/l8b" --device cuda --concurrency 256 \
            --decode-tokens 32 --prompt-len 512 --skip-prefix 2>&1 | grep -A16 NANOINFER_CUDA_PROFILE ;;
    trace)
        # In-graph time of every kernel of int4 and bf16 decode steps
        # (scripts/cuda_trace.c, a CUPTI tracer; no Nsight Systems here).
        inc=$(dirname "$(find /usr/local/cuda*/ -name cupti.h -path '*include*' 2>/dev/null | head -1)")
        lib=$(find /usr/local/cuda*/ -name 'libcupti.so*' 2>/dev/null | head -1)
        gcc -shared -fPIC -o "$WORK/libtrace.so" scripts/cuda_trace.c -I/usr/local/cuda/include -I"$inc" \
            -L"$(dirname "$lib")" -l:"$(basename "$lib")" -Wl,-rpath,"$(dirname "$lib")" || continue
        for q in awq none; do
            CUDA_INJECTION64_PATH="$WORK/libtrace.so" TRACE_OUT="$WORK/trace-$q.csv" "$BIN/nanoinfer" bench \
                --model "$WORK/l8b" --device cuda --quant $q -p 0 -n 48 -r 1 >/dev/null 2>&1
            echo "== trace: decode, quant $q"
            python3 scripts/cuda_timeline.py "$WORK/trace-$q.csv" --events
        done ;;
    bench)
        "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda -p 512 -n 128 -r 3 --json | tee "$WORK/ours.json"
        NANOINFER_CUDA_GRAPHS=0 "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda -p 512 -n 128 -r 3 --json \
            | tee "$WORK/ours-nographs.json"
        NANOINFER_CUDA_GEMV=0 "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda -p 0 -n 128 -r 3 --json \
            | tee "$WORK/ours-cublas.json"
        NANOINFER_CUDA_PDL=1 "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda -p 0 -n 128 -r 3 --json \
            | tee "$WORK/ours-pdl.json"
        for depth in 1024 32768; do
            "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda -p 0 -n 64 -d $depth -r 3
        done
        python3 scripts/cuda_bench_hf.py --model "$WORK/l8b" -p 512 -n 128 -r 3 | tee "$WORK/hf.json" ;;
    fp8test)
        # tests/cuda.rs's FP8 test alone.
        NANOINFER_CUDA_FIXTURES="$WORK/fx" "$BIN/cuda" --test-threads 1 --nocapture fp8_matches 2>&1 | tail -24 ;;
    bench8)
        # FP8 weights (E4M3, 128 x 128 blocks, quantized at load) against
        # bf16 in the same run, interleaved: batch-1 decode and prefill.
        for round in 1 2; do
            for q in none fp8; do
                echo "== bench8 round $round: --quant $q"
                "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda --quant $q -p 512 -n 128 -r 3 2>&1 \
                    | grep -E "pp512|tg128|fp8|bf16" | tail -4
            done
        done ;;
    bench4)
        # Int4 (AWQ round-to-nearest g128, quantized at load) against bf16 in
        # the same run: decode and prefill, then per-kernel times of 16
        # concurrent decodes (int4 MMA kernel vs cuBLAS on the same shapes).
        for q in none awq; do
            echo "== quant $q"
            "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda --quant $q -p 512 -n 128 -r 3 --json \
                | tee "$WORK/ours-$q.json"
            "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda --quant $q -p 2048 -n 0 -r 2 --json
            NANOINFER_CUDA_PROFILE=5 "$BIN/engine_bench" --model "$WORK/l8b" --device cuda --quant $q \
                --concurrency 16 --decode-tokens 16 --prompt-len 64 --skip-prefix 2>&1 | grep -A24 NANOINFER_CUDA_PROFILE
        done ;;
    ab4)
        # Int4 decode (tg128) of the baseline build ($BIN/baseline, from
        # `cuda_carry.sh --baseline REV`) and this one, interleaved twice in
        # the same call, bf16 once; then the int4 products alone.
        tg() { grep -o '"tg_tokens_per_s":[0-9.]*' | cut -d: -f2; }
        args="--model $WORK/l8b --device cuda -p 0 -n 128 -r 3 --json"
        for run in 1 2; do
            for build in baseline new; do
                bin=$BIN/nanoinfer; [ $build = baseline ] && bin=$BIN/baseline/nanoinfer
                echo "int4 tg128, $build (run $run): $($bin bench $args --quant awq 2>/dev/null | tg) tok/s"
            done
        done
        echo "bf16 tg128, new: $("$BIN/nanoinfer" bench $args --quant none 2>/dev/null | tg) tok/s"
        for build in baseline new; do
            bin=$BIN/w4_bench; [ $build = baseline ] && bin=$BIN/baseline/w4_bench
            echo "== w4_bench, $build"; $bin --rows 1,8,16 --reps 300 2>&1 | tail -13
        done ;;
    ab)
        # The baseline build ($BIN/baseline, from `cuda_carry.sh --baseline
        # REV`) against this one, interleaved in the same call: bf16 and int4
        # tg128 and pp512 of the 8B shape, then offline 1000 x (512 + 256).
        field() { grep -o "\"$1\":[0-9.]*" | cut -d: -f2; }
        for q in none awq; do
            for run in 1 2; do
                for build in baseline new; do
                    bin=$BIN/nanoinfer; [ $build = baseline ] && bin=$BIN/baseline/nanoinfer
                    out=$($bin bench --model "$WORK/l8b" --device cuda --quant $q -p 512 -n 128 -r 3 --json 2>/dev/null)
                    echo "ab $q $build run$run: pp512 $(echo "$out" | field pp_tokens_per_s) tg128 $(echo "$out" | field tg_tokens_per_s)"
                done
            done
        done
        for build in baseline new; do
            bin=$BIN/engine_bench; [ $build = baseline ] && bin=$BIN/baseline/engine_bench
            echo "ab offline $build: $($bin --model "$WORK/l8b" --device cuda --offline 1000 --prompt-len 512 \
                --decode-tokens 256 --max-seqs 256 --max-batched-tokens 8192 2>&1 | grep offline:)"
        done ;;
    sampling)
        # Full sampling (temperature, top-k, top-p, repetition penalty) on
        # the GPU against the host sampler and greedy, same run; then the
        # sampling kernel's own time.
        for mode in greedy device host; do
            echo "== sampling $mode"
            "$BIN/engine_bench" --model "$WORK/l8b" --device cuda --concurrency 1,16,64 --decode-tokens 64 \
                --prompt-len 128 --skip-prefix --sampling $mode
        done
        NANOINFER_CUDA_PROFILE=1 "$BIN/engine_bench" --model "$WORK/l8b" --device cuda --concurrency 1,64 \
            --decode-tokens 32 --prompt-len 128 --skip-prefix --sampling device 2>&1 | grep "NANOINFER_CUDA_PROFILE\|total ms\|sample_rows\|argmax" ;;
    engine)
        "$BIN/engine_bench" --model "$WORK/l8b" --device cuda --concurrency 1,16,64,256 --decode-tokens 128 \
            --prompt-len 512 --skip-prefix ;;
    offline)
        "$BIN/engine_bench" --model "$WORK/l8b" --device cuda --offline 1000 --prompt-len 512 --decode-tokens 256 \
            --max-seqs 256 --max-batched-tokens 8192 --kv-cache-dtype "$KV_CACHE_DTYPE" ;;
    serve)
        # Issue 9's throughput benchmark: nanoinfer bench in serving mode
        # (offline: all 1000 requests ready at once; then 256 at a time),
        # then the HF peer on 256 of the same shape in one batch.
        "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda --num-requests 1000 --input-len 512 \
            --output-len 256 --max-seqs 256 --max-batched-tokens 8192 --prefill-chunk 8192 --json
        "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda --num-requests 512 --input-len 512 \
            --output-len 256 --concurrency 256 --max-seqs 256 --max-batched-tokens 8192 --prefill-chunk 8192 --json
        python3 scripts/cuda_bench_hf.py --model "$WORK/l8b" --offline 256 --batch 256 -p 512 -n 256 ;;
    grammar)
        # Structured output's cost on the 8B shape (examples/grammar_bench.rs),
        # with SmolLM2's vocabulary and tokenizer (gpu-carry/tok, from
        # scripts/cuda_carry.sh): the random 8B model has no tokenizer.
        [ -f "$WORK/l8bt/config.json" ] || python3 scripts/cuda_bench_hf.py --make-8b "$WORK/l8bt" --vocab 49152
        cp "$BIN"/tok/* "$WORK/l8bt/"
        "$BIN/grammar_bench" --model "$WORK/l8bt" --device cuda --concurrency 1,64 --rounds 3 2>&1 | tail -4
        # Constrained rows sampled on the GPU against host sampling (tests/cuda.rs).
        NANOINFER_CUDA_GRAMMAR_MODEL="$WORK/l8bt" "$BIN/cuda" --test-threads 1 --nocapture constrained_rows 2>&1 \
            | grep -E "^test |test result|panicked|constrained rows" ;;
    spec)
        # Speculative decoding on the GPU: the fixtures' greedy tokens with
        # n-gram and draft-model speculation (tests/cuda.rs), then on the 8B
        # shape with SmolLM2's tokenizer (l8bt): the cost of a verify step
        # against a decode step, and the int4 copy as a draft against the
        # ideal its acceptance and step times allow (examples/spec_bench.rs;
        # random weights: acceptance is not a quality figure).
        NANOINFER_CUDA_FIXTURES="$WORK/fx" "$BIN/cuda" --test-threads 1 --nocapture speculative 2>&1 \
            | grep -E "^test |test result|panicked|speculative"
        [ -f "$WORK/l8bt/config.json" ] || python3 scripts/cuda_bench_hf.py --make-8b "$WORK/l8bt" --vocab 49152
        cp "$BIN"/tok/* "$WORK/l8bt/"
        echo "== forward time by shape: default, cuBLAS only, GEMV kernels up to 8 rows"
        "$BIN/spec_bench" --model "$WORK/l8bt" --device cuda --shapes-only 1 2>&1 | tail -10
        NANOINFER_CUDA_GEMV=0 "$BIN/spec_bench" --model "$WORK/l8bt" --device cuda --shapes-only 1 2>&1 | tail -10
        NANOINFER_CUDA_GEMV_ROWS=8 "$BIN/spec_bench" --model "$WORK/l8bt" --device cuda --shapes-only 1 2>&1 | tail -10
        # The int4 copy's argmax rarely agrees with random bf16 weights' near-flat
        # logits; the model drafting for itself (kept unless a near-tie flips)
        # measures the engine's efficiency against the ideal.
        for q in awq none; do
            echo "== draft: the target's copy, --draft-quant $q"
            "$BIN/spec_bench" --model "$WORK/l8bt" --device cuda --draft-quant $q --max-tokens 128 --rounds 3 \
                $([ $q = none ] && echo --batches 1,4,16,64) 2>&1 | tail -22
        done ;;
    state)
        # Saved conversations on the GPU (bf16 and FP8 KV): a conversation
        # saved after 12 tokens and continued in another process gives the
        # uninterrupted run's tokens, greedy and seeded sampled; then the
        # time to first token restored against recomputed (examples/state_bench.rs).
        ids=$(python3 -c 'print(",".join(str(7 + 13 * i % 5000) for i in range(300)))')
        for kv in auto fp8; do
            for samp in "" "--temperature 0.8 --top-p 0.9 --seed 5"; do
                g() { "$BIN/nanoinfer" generate --model "$WORK/l8b" --device cuda --kv-cache-dtype $kv --json \
                    --ignore-eos $samp "$@" 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["output_ids"])'; }
                whole=$(g --prompt-ids "$ids" --max-tokens 32)
                first=$(g --prompt-ids "$ids" --max-tokens 12 --save-state "$WORK/s.nistate")
                rest=$(g --load-state "$WORK/s.nistate" --max-tokens 20)
                python3 -c "import sys; w,f,r=$whole,$first,$rest; ok=f==w[:12] and r==w[12:]; \
print('state continuation (kv $kv, ${samp:-greedy}):', 'OK' if ok else 'MISMATCH', w, f, r)"
            done
        done
        "$BIN/state_bench" --model "$WORK/l8b" --device cuda --lengths 1024,8000 --dir "$WORK" 2>&1 | tail -5 ;;
    http)
        # nanoinfer serve's cost on the 8B shape: 64 concurrent streaming
        # clients against nanoinfer bench's serving mode, same call, A B A B.
        python3 server/tests/bench_http.py --cli "$BIN/nanoinfer" --model "$WORK/l8b" --requests 512 \
            --concurrency 64 --input-len 512 --output-len 256 --rounds 2 -- --device cuda 2>&1 | tail -5 ;;
    kvfp8)
        # bf16 against fp8 KV, offline and at 32k of context (BENCHMARKS.md "GPU FP8 KV cache").
        for kv in auto fp8; do
            echo "== kv cache $kv"
            "$BIN/engine_bench" --model "$WORK/l8b" --device cuda --offline 1000 --prompt-len 512 \
                --decode-tokens 256 --max-seqs 256 --max-batched-tokens 8192 --kv-cache-dtype $kv 2>&1 | grep offline:
            "$BIN/nanoinfer" bench --model "$WORK/l8b" --device cuda -p 0 -n 64 -d 32768 -r 3 --json \
                --kv-cache-dtype $kv
        done ;;
    offline_hf)
        # The peer: HF generate, 256 requests in one batch of 256 (its best case).
        "$BIN/engine_bench" --model "$WORK/l8b" --device cuda --offline 256 --prompt-len 512 --decode-tokens 256 \
            --max-seqs 256 --max-batched-tokens 8192 --kv-cache-dtype "$KV_CACHE_DTYPE"
        python3 scripts/cuda_bench_hf.py --model "$WORK/l8b" --offline 256 --batch 256 -p 512 -n 256 ;;
    esac
done
