#!/usr/bin/env bash
# Timed soak through the C ABI (not in CI: too long). Drives random sessions
# (random KV backend / block size / small capacity / policy / preemption) with
# random requests, cancellations and concurrent stats reads on a tiny random
# model, checks every invariant the ABI exposes after each operation, compares
# greedy requests with solo runs, and samples RSS every second; fails if RSS
# grows by more than max(8 MiB, 10%) after the first tenth of the run.
#
#   scripts/soak.sh [MINUTES (default 10)] [SEED (default 1)]
#
# The RSS samples go to $NANOINFER_SOAK_RSS_CSV (default
# /tmp/nanoinfer-soak-rss.csv). Test: tests/engine_soak.rs,
# soak_timed_through_the_c_abi.
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-10}
seed=${2:-1}
export NANOINFER_SOAK_SECS=$((minutes * 60)) NANOINFER_SOAK_SEED=$seed
export NANOINFER_SOAK_RSS_CSV=${NANOINFER_SOAK_RSS_CSV:-/tmp/nanoinfer-soak-rss.csv}
cargo test --release --test engine_soak soak_timed_through_the_c_abi -- --ignored --nocapture --test-threads 1
echo "RSS samples: $NANOINFER_SOAK_RSS_CSV" >&2
