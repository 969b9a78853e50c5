#!/usr/bin/env bash
# Runs the cargo-fuzz targets in fuzz/ (libFuzzer + AddressSanitizer, release
# with debug assertions) for a fixed time each, and prints executions and
# findings per target. Needs the nightly toolchain and cargo-fuzz, which it
# installs when missing (rustup toolchain install nightly --profile minimal;
# cargo install cargo-fuzz --locked: about 16 s + 85 s here).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET (default 60)] [TARGET...]
#
# Seeds: fuzz/seeds/<target>/ (committed, small). New corpus entries go to
# fuzz/corpus/<target>/ and crashes to fuzz/artifacts/<target>/ (both
# ignored by git). Reproduce a crash with
#   cargo +nightly fuzz run -O -a <target> fuzz/artifacts/<target>/crash-...
# and turn it into a regression test in the normal suite.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
cargo fuzz --version >/dev/null 2>&1 || cargo install cargo-fuzz --locked
secs=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo +nightly fuzz list)
target_dir=${CARGO_TARGET_DIR:-$PWD/../target}/fuzz
cargo +nightly fuzz build -O -a --target-dir "$target_dir"
status=0
printf '%-16s %12s %10s %8s  %s\n' target executions exec/s corpus result
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  log=$(mktemp)
  if cargo +nightly fuzz run -O -a --target-dir "$target_dir" "$t" "corpus/$t" "seeds/$t" -- \
      -max_total_time="$secs" -max_len=16384 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="artifacts/$t/" >"$log" 2>&1; then
    result=ok
  else
    result="CRASH (see $log)"
    status=1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  corpus=$(find "corpus/$t" -type f | wc -l)
  printf '%-16s %12s %10s %8s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "$corpus" "$result"
  [ "$result" = ok ] && rm -f "$log"
done
exit $status
