#!/usr/bin/env bash
# One GPU-machine session: GPU test tier, benchmark, self-check and cold-start, logs under $OUT.
# Run from the project root after `source .device/bootstrap.sh`. Phases have hard time limits so the
# whole script ends inside one 10-minute device call. At most 8 files come back from $OUT: tests.log,
# bench.log (+ 2 CSV, 2 PNG), misc.log. A TileLang cache built on the CPU machine can be carried along
# (`TILELANG_CACHE_DIR=.cache/tl-ship flashdelta warmup ...`, then carry .cache/tl-ship): set
# TILELANG_CACHE_DIR before running this and the benchmark's own kernels load instead of compiling.
# COLDSTART=0 skips the cold-start measurement.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export FLASHDELTA_COMMIT=${FLASHDELTA_COMMIT:-unknown}
L=/tmp/gpu_session; mkdir -p $L
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$OUT/misc.log" 2>&1
t0=$(date +%s)
# phase 1: the three GPU test files in parallel (compilation dominates), plus the bench kernels' warm-up
for f in prepare fwd e2e_gpu l2norm; do
  timeout 195 python3 -m pytest tests/gpu/test_$f.py -q -p no:cacheprovider > "$L/test_$f.log" 2>&1 &
done
timeout 195 python3 -m flashdelta.cli warmup --heads 16/64 --heads 8/32 --heads 2/8 --beta-dtype fp32 \
  > "$L/warmup.log" 2>&1 &
wait
for f in $L/test_*.log $L/warmup.log; do echo "===== $f"; grep -v "TileLang.*INFO" "$f"; done > "$OUT/tests.log"
echo "phase 1 (tests) done at $(( $(date +%s) - t0 )) s"
# phase 2: forward benchmark, TP1 first, then TP2/TP8
timeout 150 python3 bench/run.py --suite fwd --filter 'h16v64/' --max-minutes 1.8 --out "$OUT/fwd_h16v64.csv" \
  > "$OUT/bench.log" 2>&1
timeout 95 python3 bench/run.py --suite fwd --filter 'h8v32/(1x32768|8192x4|4096x8|28672)|h2v8/(1x32768|4096x8|1024x8)' \
  --max-minutes 1.0 --out "$OUT/fwd_small.csv" >> "$OUT/bench.log" 2>&1
echo "phase 2 (bench) done at $(( $(date +%s) - t0 )) s"
timeout 45 python3 -m flashdelta.cli check >> "$OUT/misc.log" 2>&1
timeout 30 python3 -m flashdelta.cli check --l2norm >> "$OUT/misc.log" 2>&1
if [ "${COLDSTART:-1}" = 1 ]; then
  timeout 60 python3 bench/coldstart.py --heads 16/64 2>&1 | grep -v "TileLang.*INFO" >> "$OUT/misc.log"
fi
echo "all done at $(( $(date +%s) - t0 )) s"
for f in $L/test_*.log; do echo "== $f"; tail -n 3 "$f"; done
tail -n 22 "$OUT/misc.log"
grep -v "TileLang.*INFO" "$OUT/bench.log" | tail -n 45
