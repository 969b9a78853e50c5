#!/usr/bin/env bash
# The numeric test groups (goldens against transformers, the op
# conformance suite against its f64 reference, Q8_0, int4 and FP8 quality,
# sampling goldens, speculative decoding's greedy goldens and sampling
# distribution) under each instruction-set path this CPU can
# run besides its own default: NANOINFER_ISA=avx512 (AVX-512 without the
# BF16/VNNI/AMX extensions the default uses), avx2 and scalar. A bound taken
# from a figure measured on one path must hold on all of them; a kernel that
# is wrong on one path fails here on any machine that has it.
# Usage: scripts/test_isa.sh [ISA...]   (default: every path this CPU has)
set -euo pipefail
cd "$(dirname "$0")/.."
groups=(goldens op_conformance quant_q8 int4 fp8 sampling_goldens speculative)
isas=("$@")
if [ ${#isas[@]} -eq 0 ]; then
  flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
  has() { [[ " $flags " == *" $1 "* ]]; }
  if has avx512f && has avx512bw; then isas+=(avx512); fi
  if has avx2 && has fma && has f16c; then isas+=(avx2); fi
  isas+=(scalar)
fi
args=()
for g in "${groups[@]}"; do args+=(--test "$g"); done
for isa in "${isas[@]}"; do
  echo "== numeric tests under NANOINFER_ISA=$isa (${groups[*]})" >&2
  start=$(date +%s)
  NANOINFER_ISA=$isa cargo test --release --no-fail-fast "${args[@]}"
  echo "== NANOINFER_ISA=$isa: $(( $(date +%s) - start )) s" >&2
done
