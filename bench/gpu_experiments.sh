#!/usr/bin/env bash
# One GPU call for the open experiments (NOTES-gpu.md "Next GPU call"), logs under $OUT:
#   0. a 60-second smoke run of share_prep against the default kernel (a hang costs one minute, not the call),
#   1. if it ran: the share_prep correctness tests (bit-identical to the default kernel), A/B timing of the
#      fused-forward variants on one sequence and on four, the per-role timeline of share_prep;
#   2. the prepare phase timeline.
# Build the TileLang cache on the CPU machine first and carry it (saves ~20 s of device time per kernel):
#   TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/fwd_variants.py --compile-only --prepare
# then: source .device/bootstrap.sh; TILELANG_CACHE_DIR=$PWD/.cache/tl-ship bash bench/gpu_experiments.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
timeout 60 python3 bench/fwd_variants.py --tokens 8192 --variants default,share-prep > "$OUT/exp_smoke.log" 2>&1
smoke=$?
if [ $smoke = 0 ]; then
  echo "share_prep smoke run finished ($(( $(date +%s) - t0 )) s):"; tail -n 3 "$OUT/exp_smoke.log"
  timeout 200 python3 -m pytest tests/gpu/test_fwd.py -q -p no:cacheprovider -k "share_prep" > "$OUT/exp_tests.log" 2>&1
  echo "share_prep tests: $(tail -n 1 "$OUT/exp_tests.log") ($(( $(date +%s) - t0 )) s)"
  timeout 150 python3 bench/fwd_variants.py --tokens 8192,32768,8192x4 --prepare 2>&1 | grep -v "TileLang.*INFO" \
    > "$OUT/exp_variants.log"
  timeout 60 python3 bench/profile_fwd.py --no-plain --share-prep 2>&1 | grep -v "TileLang.*INFO" \
    > "$OUT/exp_profile_share.log"
else
  echo "share_prep smoke run failed (rc $smoke; 124 = timed out) at $(( $(date +%s) - t0 )) s:"
  grep -v "TileLang.*INFO" "$OUT/exp_smoke.log" | tail -n 20
  timeout 150 python3 bench/fwd_variants.py --tokens 8192,32768,8192x4 --prepare --variants default,no-early-release \
    2>&1 | grep -v "TileLang.*INFO" > "$OUT/exp_variants.log"
fi
timeout 60 python3 bench/profile_prepare.py 2>&1 | grep -v "TileLang.*INFO" > "$OUT/exp_profile_prepare.log"
echo "all done at $(( $(date +%s) - t0 )) s"
tail -n 24 "$OUT/exp_variants.log"; tail -n 16 "$OUT/exp_profile_share.log" 2>/dev/null
tail -n 30 "$OUT/exp_profile_prepare.log"
