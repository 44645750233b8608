#!/usr/bin/env bash
# One GPU call for the open experiments (NOTES-gpu.md), logs under $OUT. Timing first (the kernels come from the
# carried TileLang cache), then the GPU test tier (its own kernels compile there, four files in parallel):
#   1. prepare_fwd variants (bench/fwd_variants.py --prepare: the launcher's build vs the previous one) and the
#      fused forward's default kernel, on one sequence of 8192 and 32768 tokens and on 4 x 8192;
#   2. share_prep against the default kernel (60-s limit: a hang costs one minute), its per-role timeline;
#   3. the prepare phase timeline;
#   4. the GPU test tier.
# Build the TileLang cache on the CPU machine first and carry it packed (bench/tlcache.sh pack), then:
#   source .device/bootstrap.sh; source bench/tlcache.sh unpack; bash bench/gpu_experiments.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
L=/tmp/gpu_experiments; mkdir -p $L
t0=$(date +%s)
quiet() { grep -v "TileLang.*INFO"; }
timeout 150 python3 bench/fwd_variants.py --tokens 8192,32768,8192x4 --prepare --variants default 2>&1 | quiet \
  > "$OUT/exp_variants.log"
echo "prepare A/B done at $(( $(date +%s) - t0 )) s"
timeout 60 python3 bench/fwd_variants.py --tokens 8192,32768 --variants default,share-prep 2>&1 | quiet \
  > "$OUT/exp_share.log"
echo "share_prep A/B: rc $? at $(( $(date +%s) - t0 )) s"
timeout 40 python3 bench/profile_fwd.py --no-plain --share-prep 2>&1 | quiet > "$OUT/exp_profile_share.log"
timeout 40 python3 bench/profile_prepare.py 2>&1 | quiet > "$OUT/exp_profile_prepare.log"
echo "timelines done at $(( $(date +%s) - t0 )) s"
for f in prepare fwd e2e_gpu l2norm; do
  timeout 200 python3 -m pytest tests/gpu/test_$f.py -q -p no:cacheprovider > "$L/test_$f.log" 2>&1 &
done
wait
for f in $L/test_*.log; do echo "===== $f"; quiet < "$f"; done > "$OUT/exp_tests.log"
echo "tests done at $(( $(date +%s) - t0 )) s"
for f in $L/test_*.log; do echo "== $f: $(tail -n 1 "$f")"; done
tail -n 18 "$OUT/exp_variants.log"; tail -n 6 "$OUT/exp_share.log"; tail -n 22 "$OUT/exp_profile_share.log"
tail -n 28 "$OUT/exp_profile_prepare.log"
