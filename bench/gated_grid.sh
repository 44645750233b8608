#!/usr/bin/env bash
# One device call: the experiments and GPU tier (bench/gpu_experiments.sh), then, only if every test file passed
# and the launcher's fused kernel is below GATE_US us per chunk at 32k tokens, the full grid (bench/grid.sh all)
# and the cold-start measurement (bench/coldstart.py). Carry .device and the packed TileLang cache:
#   source .device/bootstrap.sh; source bench/tlcache.sh unpack; FLASHDELTA_COMMIT=<id> bash bench/gated_grid.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
GATE_US=${GATE_US:-1.6}
timeout 200 bash bench/gpu_experiments.sh > "$OUT/exp_summary.log" 2>&1
grep "^== " "$OUT/exp_summary.log"
grep -A13 "^=== summary" "$OUT/exp_profile.log"
grep "w.stored\|s.o_empty " "$OUT/exp_profile.log"
tail -n 24 "$OUT/exp_profile_prepare.log"
grep -E "^ +(8192|32768|8192x4) +(default|no-early-release|prepare) " "$OUT/exp_variants.log"
for f in "$OUT"/exp_pairs_*.log; do echo "== $f"; grep -E "^ +[0-9x]+ +pair-" "$f"; done
us=$(awk '$1 == "32768" && $2 == "default" {print $4}' "$OUT/exp_variants.log")
if [ -z "$us" ] || grep -q "failed\|error\|Timeout" /tmp/gpu_experiments/test_*.log; then
  echo "GATE: tests failed or no timing; no grid"; exit 1
fi
if ! awk "BEGIN {exit !($us < $GATE_US)}"; then echo "GATE: $us us/chunk >= $GATE_US; no grid"; exit 1; fi
echo "GATE: $us us/chunk < $GATE_US: grid"
MAX_S=${MAX_S:-440} bash bench/grid.sh all 2>&1 | tail -n 4
if [ "${COLDSTART:-1}" = 1 ]; then
  timeout 110 python3 bench/coldstart.py > "$OUT/coldstart.log" 2>&1; grep -v INFO "$OUT/coldstart.log" | tail -n 5
fi
