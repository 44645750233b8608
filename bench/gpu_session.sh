#!/usr/bin/env bash
# One GPU-machine session: GPU test tier, benchmark, self-check and cold-start, logs under $OUT.
# Run from the project root after `source .device/bootstrap.sh`. Phases have hard time limits so the
# whole script ends inside one 10-minute device call.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export FLASHDELTA_COMMIT=${FLASHDELTA_COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
# phase 1: the three GPU test files in parallel (compilation dominates), plus the bench kernels' warm-up
for f in prepare fwd e2e_gpu; do
  timeout 210 python3 -m pytest tests/gpu/test_$f.py -q -p no:cacheprovider > "$OUT/test_$f.log" 2>&1 &
done
timeout 210 python3 -m flashdelta.cli warmup --heads 16/64 --heads 8/32 --heads 2/8 --beta-dtype fp32 \
  > "$OUT/warmup.log" 2>&1 &
wait
echo "phase 1 (tests) done at $(( $(date +%s) - t0 )) s"
# phase 2: forward benchmark, TP1 first, then TP2/TP8
timeout 170 python3 bench/run.py --suite fwd --filter 'h16v64/' --max-minutes 2 --out "$OUT/fwd_h16v64.csv" \
  > "$OUT/bench_h16v64.log" 2>&1
timeout 110 python3 bench/run.py --suite fwd --filter 'h8v32/(1x32768|8192x4|4096x8|28672)|h2v8/(1x32768|4096x8|1024x8)' \
  --max-minutes 1.2 --out "$OUT/fwd_small.csv" > "$OUT/bench_small.log" 2>&1
echo "phase 2 (bench) done at $(( $(date +%s) - t0 )) s"
timeout 60 python3 -m flashdelta.cli check > "$OUT/check.log" 2>&1
timeout 75 python3 bench/coldstart.py --heads 16/64 > "$OUT/coldstart.log" 2>&1
echo "all done at $(( $(date +%s) - t0 )) s"
for f in "$OUT"/test_*.log; do echo "== $f"; tail -n 4 "$f"; done
tail -n 14 "$OUT/check.log"; cat "$OUT/coldstart.log" | grep -v INFO | tail -n 6
tail -n 30 "$OUT/bench_h16v64.log"; tail -n 15 "$OUT/bench_small.log"
