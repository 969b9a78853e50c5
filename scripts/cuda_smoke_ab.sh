#!/usr/bin/env bash
# Greedy, sampled, int4 and FP8-KV generations of a small random Llama on the
# GPU by the baseline build ($BIN/baseline/nanoinfer, from `cuda_carry.sh
# --baseline REV`) and this one: the token ids must be identical (a refactor
# that keeps every kernel and launch the same). About a minute.
set -uo pipefail
BIN=${BIN:-gpu-carry}
WORK=${WORK:-/tmp/nanoinfer-gpu}
mkdir -p "$WORK"
for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, s, "lib") for p in nvidia.__path__ for s in os.listdir(p)))' 2>/dev/null); do
    [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$d"
done
export LD_LIBRARY_PATH NANOINFER_KERNEL_CACHE="$WORK/kernels-smoke"
model=$WORK/smoke-llama
[ -f "$model/config.json" ] || python3 - "$model" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
c = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=False)
LlamaForCausalLM(c).to(torch.bfloat16).save_pretrained(sys.argv[1])
PY
same=0; differ=0
for args in "" "--quant awq" "--temperature 0.8 --top-p 0.9 --seed 7" "--kv-cache-dtype fp8" "--kv-backend token"; do
    for build in baseline new; do
        bin=$BIN/nanoinfer; [ $build = baseline ] && bin=$BIN/baseline/nanoinfer
        $bin generate --model "$model" --device cuda --prompt-ids 1,5,9,200,3000,17 --max-tokens 48 --ignore-eos \
            --json $args > "$WORK/smoke-$build.json" 2>"$WORK/smoke-$build.err" || tail -3 "$WORK/smoke-$build.err"
    done
    if cmp -s <(grep -o '"output_ids":\[[0-9,]*\]' "$WORK/smoke-baseline.json") \
              <(grep -o '"output_ids":\[[0-9,]*\]' "$WORK/smoke-new.json") \
       && grep -q output_ids "$WORK/smoke-new.json"; then
        same=$((same + 1)); echo "identical: ${args:-greedy bf16}"
    else
        differ=$((differ + 1)); echo "DIFFERENT: ${args:-greedy bf16}"; head -c 400 "$WORK/smoke-baseline.json"; echo; head -c 400 "$WORK/smoke-new.json"; echo
    fi
done
echo "smoke A/B: $same identical, $differ different"
