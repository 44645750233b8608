#!/usr/bin/env bash
# One GPU call for the open experiments (NOTES-gpu.md), logs under $OUT. Timing first (the kernels come from the
# carried TileLang cache), then the GPU test tier (four files in parallel; test_e2e_gpu compiles its kernels there):
#   1. the fused kernel (the launcher's build and the VARIANTS given) and prepare_fwd at 16/64, 1x8192 and 1x32k
#      by default (bench/fwd_variants.py); unless PAIRS=0, on short rows (2/8, 4/16, 8/32; 1x2048, 1x4096, 4x2048)
#      prepare + fused in one CUDA graph with prepare's value heads per CTA as the launcher picks them and with all
#      of a key head's (--pair);
#   2. the per-role timeline of the launcher's kernel (bench/profile_fwd.py) and prepare's phases (profile_prepare.py);
#   3. the GPU test tier.
# Build the TileLang cache on the CPU machine first and carry it packed (bench/tlcache.sh pack), then:
#   source .device/bootstrap.sh; source bench/tlcache.sh unpack; bash bench/gpu_experiments.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# logs go to $L (bench/gated_grid.sh reads them there) and come back as one tarball: the device returns at most
# 8 files from $OUT
L=/tmp/gpu_experiments; mkdir -p $L
t0=$(date +%s)
quiet() { grep -v "TileLang.*INFO"; }
# Unbuffered Python (-u): a step killed by its timeout still leaves what it printed (session 7, call 2).
# env: TOKENS, VARIANTS, PREP_VARIANTS (fwd_variants.py's lists), ROUNDS (interleaved timing rounds), TESTS (test
# files), PROFILE=0 skips the timelines
timeout 120 python3 -u bench/fwd_variants.py --rounds "${ROUNDS:-1}" --tokens "${TOKENS:-8192,32768}" --prepare \
  --prepare-variants "${PREP_VARIANTS:-prepare}" --variants "${VARIANTS:-default}" \
  2>&1 | quiet > "$L/exp_variants.log"
# prepare's heads per CTA on short rows: the launcher's pick vs all of a key head's (prepare + fused in one graph)
for hv in $([ "${PAIRS:-1}" = 1 ] && echo 2/8 4/16 8/32); do   # PAIRS=0 skips them
  timeout 40 python3 -u bench/fwd_variants.py --heads $hv --tokens 2048,4096,2048x4 --pair --variants default --reps 50 \
    2>&1 | quiet > "$L/exp_pairs_${hv/\//v}.log"
done
echo "A/B done at $(( $(date +%s) - t0 )) s"
if [ "${PROFILE:-1}" = 1 ]; then
  OUT=$L timeout 60 python3 -u bench/profile_fwd.py --no-plain 2>&1 | quiet > "$L/exp_profile.log"
  OUT=$L timeout 40 python3 -u bench/profile_prepare.py 2>&1 | quiet > "$L/exp_profile_prepare.log"
fi
echo "timeline done at $(( $(date +%s) - t0 )) s"
for f in ${TESTS:-prepare fwd e2e_gpu l2norm}; do
  timeout 240 python3 -m pytest tests/gpu/test_$f.py -q -p no:cacheprovider > "$L/test_$f.log" 2>&1 &
done
wait
for f in $L/test_*.log; do echo "===== $f"; quiet < "$f"; done > "$L/exp_tests.log"
echo "tests done at $(( $(date +%s) - t0 )) s"
for f in $L/test_*.log; do echo "== $f: $(tail -n 1 "$f")"; done
tail -n 30 "$L/exp_profile.log" 2>/dev/null; tail -n 4 "$L/exp_variants.log"
for f in "$L"/exp_pairs_*.log; do echo "== $f"; grep -E "^ +[0-9x]+ +pair-" "$f"; done
tar -C "$L" -czf "$OUT/exp_logs.tar.gz" $(cd "$L" && ls *.log *.pt 2>/dev/null)
