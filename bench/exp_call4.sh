#!/usr/bin/env bash
# Session 6 call 4 (one-off experiment, NOTES-gpu.md): prepare's WARP_PHASES knob A/B on three head configs
# (interleaved rounds), test_prepare (knob vs the float64 reference), and Nsight Compute on the launcher's prepare.
#   source .device/bootstrap.sh; source bench/tlcache.sh unpack; bash bench/exp_call4.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
quiet() { grep -v "TileLang.*INFO"; }
timeout 200 python3 -m pytest tests/gpu/test_prepare.py -q -p no:cacheprovider > "$OUT/test_prepare.log" 2>&1 &
for hv in 16/64 16/16 8/24; do
  timeout 100 python3 bench/fwd_variants.py --heads $hv --tokens 2048,8192,32768,4096x8 --prepare \
    --prepare-variants prepare,prepare-warp-phases --variants default --rounds 5 2>&1 | quiet \
    > "$OUT/variants_${hv/\//v}.log"
done
wait
if command -v ncu > /dev/null; then
  timeout 150 ncu --clock-control none --set full --import-source yes -k regex:prepare --profile-from-start off \
    -o /tmp/prep python3 bench/ncu_forward.py --tokens 32768 --heads 16/64 > /tmp/ncu_run.log 2>&1
  ncu -i /tmp/prep.ncu-rep --page details --csv > "$OUT/ncu_prepare_details.csv" 2>&1
  ncu -i /tmp/prep.ncu-rep --page raw --csv --metrics regex:smsp__pcsamp_warps_issue_stalled_.* \
    > "$OUT/ncu_prepare_stalls.csv" 2>&1
fi
tail -n 1 "$OUT/test_prepare.log"
for f in "$OUT"/variants_*.log; do echo "== $f"; grep -E "^ +[0-9x]+ +[a-z0-9-]+ +[0-9.]+ " "$f"; done
grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|L1/TEX Cache Throughput|DRAM Throughput" \
  "$OUT/ncu_prepare_details.csv" 2>/dev/null | cut -c1-220 | head -12
