#!/usr/bin/env bash
# The full forward grid (96 rows, docs/performance.md) in one or two device calls, logs and CSVs under $OUT.
#   source .device/bootstrap.sh; FLASHDELTA_COMMIT=<sha> bash bench/dev/grid.sh 1   # heads 1-4
#   ... bash bench/dev/grid.sh 2                                                     # heads 5-8
#   ... MAX_S=450 bash bench/dev/grid.sh all  # all 8 in one call (~330 s on an H200 with 16 cores; MAX_S caps it)
#   ... SUITE=bwd HEADS="h16v32 h16v64" ROWS="(1x8192|8192x4)$" bash bench/dev/grid.sh some
#       (another suite, chosen head configs, and rows whose seqlens match the regex ROWS)
#   ... PROVIDERS=flashdelta,fla,flashqla,flashinfer MAX_S=570 bash bench/dev/grid.sh all
#       (the providers, run.py's --providers; default flashdelta,fla,flashqla)
#   ... PACK_NEW=1 ... bash bench/dev/grid.sh ...   (also return the kernels compiled here: bench/dev/tlcache.sh,
#       and FLA's Triton cache: carry it as .cache/triton-<card>.tar.xz)
# (The device copy has no .git: expand FLASHDELTA_COMMIT=$(git rev-parse --short HEAD) on this side.)
# Phase 1 compiles every provider's kernels for this half's head configs in parallel processes (one per head
# config, timings discarded: one rep, no gate), so the JIT work (FlashQLA's TileLang kernels take ~80 s per head
# config, FLA's Triton kernels less) runs concurrently on the host's cores and lands in the on-disk caches.
# Phase 2 times the half sequentially in one process with the normal protocol (gate, CUDA graphs, medians).
# Carry a TileLang cache with flashdelta's kernels (bench/precompile.py --grid, bench/dev/tlcache.sh) to skip
# their compile too. Merge the CSVs of two halves with `python3 bench/report.py a.csv b.csv --png merged.png`.
set -u
HALF=${1:?usage: bench/dev/grid.sh 1|2|all}
MAX_S=${MAX_S:-570}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export FLASHDELTA_COMMIT=${FLASHDELTA_COMMIT:-unknown}
SUITE=${SUITE:-fwd}
ROWS=${ROWS:-}
PROVIDERS=${PROVIDERS:-flashdelta,fla,flashqla}
# PACK_NEW=1: the TileLang kernels this call compiled (FlashQLA's, which the CPU machine cannot build) go to
# $OUT/tl-new-$HALF.tar.xz, for .cache/tl-peers.tar.xz (bench/dev/tlcache.sh)
PACK_NEW=${PACK_NEW:-0}
touch /tmp/grid_marker
# FLA's Triton kernels: FLA autotunes with cache_results, so each kernel's winning config lands in TRITON_CACHE_DIR
# (<hash>/<kernel>.autotune.json); carried from an earlier call on the same card (.cache/triton-<card>.tar.xz, returned
# by PACK_NEW=1 as $OUT/triton-<card>.tar.xz), FLA compiles only the winners instead of every config it tunes.
# Keyed by the card: a winner tuned on an H100 is not FLA's pick on an H200.
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr -cs 'A-Za-z0-9' '-' | sed 's/-$//')
export TRITON_CACHE_DIR=/tmp/triton
if [ -f ".cache/triton-$CARD.tar.xz" ]; then
  tar -C /tmp -xJf ".cache/triton-$CARD.tar.xz" && echo "Triton cache ($CARD): $(find /tmp/triton -name '*.json' | wc -l) files"
fi
# phase 1's limit per head config: FlashQLA's backward kernels compile past the forward's 240 s (a backward case whose
# warm-up is cut compiles inside the timed phase instead), so the backward suites get 400 s and fewer HEADS per call
WARM_S=${WARM_S:-$([ "$SUITE" = fwd ] && echo 240 || echo 400)}
case "$HALF" in
  1) HEADS=${HEADS:-"h2v8 h4v16 h8v32 h16v64"} ;;
  2) HEADS=${HEADS:-"h16v32 h8v24 h16v48 h16v16"} ;;
  *) HEADS=${HEADS:-"h2v8 h4v16 h8v32 h16v64 h16v32 h8v24 h16v48 h16v16"} ;;
esac
t0=$(date +%s)
for h in $HEADS; do
  timeout $WARM_S python3 bench/run.py --suite "$SUITE" --filter "$h/$ROWS" --providers "$PROVIDERS" --no-gate --budget-ms 1 --min-reps 1 --max-reps 1 \
    --rounds 1 --warmup 1 --flush-mb 0 --no-chart --out "/tmp/grid_warm_$h.csv" > "/tmp/grid_warm_$h.log" 2>&1 &
done
wait
echo "phase 1 (parallel compile) done at $(( $(date +%s) - t0 )) s"
FILTER="^$SUITE/($(echo $HEADS | tr ' ' '|'))/$ROWS"
timeout $(( MAX_S - ($(date +%s) - t0) )) python3 bench/run.py --suite "$SUITE" --filter "$FILTER" --providers "$PROVIDERS" \
  --out "$OUT/${SUITE}_grid_$HALF.csv" > "$OUT/${SUITE}_grid_$HALF.log" 2>&1
echo "phase 2 (timing) done at $(( $(date +%s) - t0 )) s"
grep -v "TileLang.*INFO" "$OUT/${SUITE}_grid_$HALF.log" | grep -A 110 "^case" | head -n 110
if [ "$PACK_NEW" = 1 ] && [ -n "${TILELANG_CACHE_DIR:-}" ]; then
  base=$(dirname "$TILELANG_CACHE_DIR"); name=$(basename "$TILELANG_CACHE_DIR")
  (cd "$base" && find "$name" -mindepth 4 -maxdepth 4 -type d -newer /tmp/grid_marker) > /tmp/grid_new.txt
  XZ_OPT="-9 -T0" tar -C "$base" -cJf "$OUT/tl-new-$HALF.tar.xz" -T /tmp/grid_new.txt
  echo "packed $(wc -l < /tmp/grid_new.txt) kernels compiled in this call: $(du -h "$OUT/tl-new-$HALF.tar.xz" | cut -f1)"
  # only the autotuning results (~40 small files; the compiled configs are ~220 MB and take minutes to pack)
  (cd /tmp && find triton -name '*.autotune.json') > /tmp/grid_tune.txt
  [ -s /tmp/grid_tune.txt ] && tar -C /tmp -cJf "$OUT/triton-$CARD.tar.xz" -T /tmp/grid_tune.txt &&
    echo "packed FLA's autotuning results ($(wc -l < /tmp/grid_tune.txt) kernels): $(du -h "$OUT/triton-$CARD.tar.xz" | cut -f1)"
fi
