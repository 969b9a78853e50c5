#!/usr/bin/env bash
# Same-run A/B of two NanoInfer builds on a lent machine's CPU (the GPU
# hosts are Intel Xeons with AVX-512 and AMX, which this 2-core VM may lack).
#
#   scripts/cpu_ab_lent.sh prepare OLD_COMMIT
#       (here) builds OLD_COMMIT in a worktree and the current tree, and puts
#       both stripped binaries, this script and SmolLM2's config and tokenizer
#       into cpu-carry/ (ignored; ~20 MB)
#   bash cpu-carry/cpu_ab_lent.sh run [--threads "4 16"] [--rounds 5]
#       (there, through the device tool with carry ["cpu-carry"]) makes random
#       weights in SmolLM2's shapes with transformers (f32, bf16, and an AWQ
#       int4 g128 checkpoint by the new build), then runs `nanoinfer bench -p
#       512 -n 128 -r 3` per precision, the two binaries interleaved, pinned to
#       the first T cores; prints the median of the rounds per cell and writes
#       every round to $OUT/ab.txt.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

prepare() {
    local old="$1" repo wt
    repo="$(cd "$here/.." && pwd)"
    wt="${TMPDIR:-/tmp}/nanoinfer-ab-old"
    cd "$repo"
    cargo build --release --quiet --bin nanoinfer
    rm -rf "$wt" && git worktree prune && git worktree add -q "$wt" "$old"
    # A copy of this target dir: only the nanoinfer crate recompiles.
    mkdir -p "$wt-target" && cp -r target/release "$wt-target/"
    (cd "$wt" && CARGO_TARGET_DIR="$wt-target" cargo build --release --quiet --bin nanoinfer)
    mkdir -p cpu-carry
    cp "$wt-target/release/nanoinfer" cpu-carry/ni-old
    cp target/release/nanoinfer cpu-carry/ni-new
    strip cpu-carry/ni-old cpu-carry/ni-new
    cp models/SmolLM2-135M-Instruct/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} cpu-carry/
    cp "$0" cpu-carry/cpu_ab_lent.sh
    git worktree remove --force "$wt"
    echo "cpu-carry/: ni-old = $old, ni-new = $(git rev-parse --short HEAD)$(git diff --quiet || echo ' + local changes')"
}

run() {
    local threads="4 16" rounds=5 w=/tmp/nanoinfer-ab
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --threads) threads="$2"; shift 2 ;;
            --rounds) rounds="$2"; shift 2 ;;
            *) echo "cpu_ab_lent.sh run: unknown argument $1" >&2; exit 2 ;;
        esac
    done
    local out="${OUT:-$w/out}" c="$here"
    mkdir -p "$w" "$out"
    grep -m1 "model name" /proc/cpuinfo
    echo "flags: $(grep -o 'avx512f\|avx512_bf16\|avx512_vnni\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')cores: $(nproc)"
    python3 - "$c" "$w" <<'PY'
import json, sys, torch, transformers
c, w = sys.argv[1:]
cfg = {k: v for k, v in json.load(open(f"{c}/config.json")).items() if k not in ("architectures", "torch_dtype")}
torch.manual_seed(0)
m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).float()
for dtype, name in [(torch.float32, "f32"), (torch.bfloat16, "bf16")]:
    m.to(dtype).save_pretrained(f"{w}/{name}", safe_serialization=True)
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        open(f"{w}/{name}/{f}", "wb").write(open(f"{c}/{f}", "rb").read())
PY
    chmod +x "$c/ni-old" "$c/ni-new"
    rm -rf "$w/awq"
    "$c/ni-new" quantize --model "$w/f32" --out "$w/awq" --method awq --group-size 128 >/dev/null
    : >"$out/ab.txt"
    local t r q b a res
    for t in $threads; do
        for r in $(seq 1 "$rounds"); do
            for q in F32 BF16 Q8_0 INT4; do
                case $q in
                    F32) a="--model $w/f32 --dtype f32" ;;
                    BF16) a="--model $w/bf16 --dtype bf16" ;;
                    Q8_0) a="--model $w/f32 --quant q8_0" ;;
                    INT4) a="--model $w/awq --quant q8_0" ;;
                esac
                for b in old new; do
                    # shellcheck disable=SC2086  # $a is a list of arguments
                    res=$(timeout 120 taskset -c "0-$((t - 1))" "$c/ni-$b" bench $a -p 512 -n 128 -t "$t" -r 3 --json |
                        python3 -c "import json,sys; d=json.load(sys.stdin); print('%.1f %.1f' % (d['pp_tokens_per_s'], d['tg_tokens_per_s']))") ||
                        res="fail fail"
                    echo "T$t r$r $q $b $res" | tee -a "$out/ab.txt"
                done
            done
        done
    done
    python3 - "$out/ab.txt" <<'PY'
import collections, statistics, sys
cells = collections.defaultdict(lambda: ([], []))
for t, r, q, b, pp, tg in (l.split() for l in open(sys.argv[1])):
    if pp != "fail":
        cells[(t, q, b)][0].append(float(pp)); cells[(t, q, b)][1].append(float(tg))
print("threads precision | pp512 old -> new (median) | tg128 old -> new (median)")
for t in sorted({k[0] for k in cells}, key=lambda s: int(s[1:])):
    for q in ["F32", "BF16", "Q8_0", "INT4"]:
        o, n = cells.get((t, q, "old")), cells.get((t, q, "new"))
        if o and n:
            mo, mn = [statistics.median(x) for x in o], [statistics.median(x) for x in n]
            print(f"{t[1:]} {q} | {mo[0]:.0f} -> {mn[0]:.0f} ({mn[0]/mo[0]:.2f}x) | {mo[1]:.1f} -> {mn[1]:.1f} ({mn[1]/mo[1]:.2f}x)")
PY
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 prepare OLD_COMMIT | run [--threads \"4 16\"] [--rounds 5]" >&2; exit 2 ;;
esac
