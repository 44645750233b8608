#!/usr/bin/env bash
# One device call: the GPU test tier, then a forward benchmark subset (or, with GRID=1, the whole forward grid,
# only if every test file passed and GRID_MIN_S of the call is left), `flashdelta check` with and without l2norm,
# and the cold start. Logs under $OUT; the device returns only a few files, so the test logs come back as one.
#   source .device/bootstrap.sh; source bench/dev/tlcache.sh unpack
#   FLASHDELTA_COMMIT=<sha> [GRID=1 | BENCH=0] [COLDSTART=0] [PRECOMPILE=1] bash bench/dev/gpu_session.sh
# PRECOMPILE=1 first fills the TileLang cache with the GPU tier's builds on all cores (bench/dev/precompile_par.py,
# ~270 s from cold; PRECOMPILE_ARGS="--tests --bwd-grid" adds the backward grid's) and packs it into
# $OUT/tl-ship.tar.xz for the next calls.
# Every step has its own timeout and runs unbuffered, so a step killed at its limit keeps what it printed.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export FLASHDELTA_COMMIT=${FLASHDELTA_COMMIT:-unknown}
CALL_S=${CALL_S:-580}                 # the device call's limit, less a margin
L=/tmp/gpu_session; mkdir -p $L
quiet() { grep -v "TileLang.*INFO"; }
t0=$(date +%s)
left() { echo $(( CALL_S - ($(date +%s) - t0) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$OUT/misc.log" 2>&1
if [ "${PRECOMPILE:-0}" = 1 ]; then
  export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tl-ship}
  timeout 330 python3 -u bench/dev/precompile_par.py ${PRECOMPILE_ARGS:---tests} --jobs "$(nproc)" --budget-s 280 \
    > $L/precompile.log 2>&1
  echo "precompile: $(grep -c '^\[shard' $L/precompile.log) builds, $(grep -c 'budget spent' $L/precompile.log) skipped, at $(( $(date +%s) - t0 )) s"
  XZ_OPT="-9e -T0" tar -C "$(dirname "$TILELANG_CACHE_DIR")" -cJf "$OUT/tl-ship.tar.xz" "$(basename "$TILELANG_CACHE_DIR")"
fi
# phase 1: the GPU test files in parallel (kernel compiles dominate unless the cache is carried), then the bigmem
# tests (tensors past 2^31 elements, up to ~76 GB) one at a time: two of them at once overflow an 80 GB H100.
# TEST_FILES narrows the files (e.g. "tests/gpu/test_cp_gpu.py").
for f in ${TEST_FILES:-tests/gpu/test_*.py}; do
  # 300 s: test_cp_gpu.py, the longest, took ~250 s beside FLA's tests on an H100 (cut at 240 after 78 of 79)
  timeout "${TEST_S:-300}" python3 -u -m pytest "$f" -m "not bigmem" -q -p no:cacheprovider \
    > "$L/$(basename "$f" .py).log" 2>&1 &
done
wait
timeout "${BIGMEM_S:-180}" python3 -u -m pytest ${TEST_FILES:-tests/gpu} -m bigmem -q -p no:cacheprovider \
  > "$L/test_zz_bigmem.log" 2>&1
[ $? = 5 ] && rm "$L/test_zz_bigmem.log"      # pytest's "no tests collected": TEST_FILES holds none
for f in $L/test_*.log; do echo "===== $f"; quiet < "$f"; done > "$OUT/tests.log"
passed=1
for f in $L/test_*.log; do
  last=$(tail -n 1 "$f"); echo "== $(basename "$f"): $last"
  case "$last" in *failed*|*error*) passed=0 ;; *passed*) ;; *) passed=0 ;; esac
done
echo "phase 1 (tests) done at $(( $(date +%s) - t0 )) s"
# phase 2: the benchmark (BENCH=0 skips it)
if [ "${BENCH:-1}" = 0 ]; then
  echo "bench skipped (BENCH=0)"
elif [ "${GRID:-0}" = 1 ]; then
  if [ "$passed" = 1 ] && [ "$(left)" -ge "${GRID_MIN_S:-400}" ]; then
    MAX_S=$(( $(left) - 60 )) bash bench/dev/grid.sh all 2>&1 | tail -n 4
  else
    echo "GRID skipped: tests passed=$passed, $(left) s left (run bench/dev/grid.sh all in a call of its own)"
  fi
else
  timeout 150 python3 -u bench/run.py --suite fwd --filter 'h16v64/' --max-minutes 1.8 \
    --out "$OUT/fwd_h16v64.csv" > "$OUT/bench.log" 2>&1
  timeout 95 python3 -u bench/run.py --suite fwd --filter 'h8v32/(1x32768|8192x4|4096x8|28672)|h2v8/(1x32768|4096x8|1024x8)' \
    --max-minutes 1.0 --out "$OUT/fwd_small.csv" >> "$OUT/bench.log" 2>&1
  quiet < "$OUT/bench.log" | tail -n 45
fi
echo "phase 2 (bench) done at $(( $(date +%s) - t0 )) s"
# phase 3: self-check and cold start
timeout 45 python3 -m flashdelta.cli check >> "$OUT/misc.log" 2>&1
timeout 30 python3 -m flashdelta.cli check --l2norm >> "$OUT/misc.log" 2>&1
if [ "${COLDSTART:-1}" = 1 ] && [ "$(left)" -ge 70 ]; then
  timeout 60 python3 -u bench/dev/coldstart.py --heads 16/64 2>&1 | quiet >> "$OUT/misc.log"
fi
echo "all done at $(( $(date +%s) - t0 )) s"
tail -n 22 "$OUT/misc.log"
