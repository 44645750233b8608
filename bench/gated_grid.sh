#!/usr/bin/env bash
# One device call: the experiments and GPU tier (bench/gpu_experiments.sh), then, only if every test file passed
# and the launcher's fused kernel is below GATE_US us per chunk at 32k tokens, the full grid (bench/grid.sh all)
# and the cold-start measurement (bench/coldstart.py). Carry .device and the packed TileLang cache:
#   source .device/bootstrap.sh; source bench/tlcache.sh unpack; FLASHDELTA_COMMIT=<id> bash bench/gated_grid.sh
# The grid needs ~400 s (phase 1, the peers' parallel compiles, took 150-240 s in session 5): it runs only if the
# call still has GRID_MIN_S (400) of its CALL_S (580) left after the experiments, else run `bench/grid.sh all` in a
# call of its own. The device returns at most 8 files from $OUT: the experiment logs come back as one tarball.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
GATE_US=${GATE_US:-1.6}
t_start=$(date +%s)
timeout 200 bash bench/gpu_experiments.sh > "$OUT/exp_summary.log" 2>&1
grep "^== " "$OUT/exp_summary.log"
L=/tmp/gpu_experiments     # where gpu_experiments.sh leaves its logs (also packed into $OUT/exp_logs.tar.gz)
grep -A13 "^=== summary" "$L/exp_profile.log" 2>/dev/null
grep "w.stored\|s.o_empty " "$L/exp_profile.log" 2>/dev/null
tail -n 24 "$L/exp_profile_prepare.log" 2>/dev/null
grep -E "^ +[0-9x]+ +[a-z0-9-]+ +[0-9.]+ " "$L/exp_variants.log"
for f in "$L"/exp_pairs_*.log; do echo "== $f"; grep -E "^ +[0-9x]+ +pair-" "$f"; done
us=$(awk '$1 == "32768" && $2 == "default" {print $4}' "$L/exp_variants.log")
if [ -z "$us" ] || grep -q "failed\|error\|Timeout" /tmp/gpu_experiments/test_*.log; then
  echo "GATE: tests failed or no timing; no grid"; exit 1
fi
if ! awk "BEGIN {exit !($us < $GATE_US)}"; then echo "GATE: $us us/chunk >= $GATE_US; no grid"; exit 1; fi
left=$(( ${CALL_S:-580} - ($(date +%s) - t_start) - 10 ))
if [ "$left" -lt "${GRID_MIN_S:-400}" ]; then
  echo "GATE: passed, but only $left s left in this call: run bench/grid.sh all in a call of its own"; exit 0
fi
echo "GATE: $us us/chunk < $GATE_US: grid (up to $left s)"
MAX_S=$left bash bench/grid.sh all 2>&1 | tail -n 4
if [ "${COLDSTART:-1}" = 1 ]; then
  timeout 110 python3 bench/coldstart.py > "$OUT/coldstart.log" 2>&1; grep -v INFO "$OUT/coldstart.log" | tail -n 5
fi
