#!/usr/bin/env bash
# Which part of the L1/shared-memory unit paces prepare_fwd (docs/dev/prepare.md has what it found: the LSU data
# pipe, 86% busy at 16/64 1x32k). One profiled prepare_fwd launch; the breakdown of
# l1tex__throughput into its sub-units plus shared/global traffic by direction, as a raw CSV under $OUT and a
# short table on stdout.
#   source .device/bootstrap.sh; source bench/dev/tlcache.sh unpack; bash bench/dev/ncu_prepare_l1.sh [TOKENS] [H/HV]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TOKENS=${1:-32768}; HEADS=${2:-16/64}
METRICS=breakdown:l1tex__throughput.avg.pct_of_peak_sustained_elapsed
for m in l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum \
         l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum \
         l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum \
         smsp__inst_executed_op_shared_ld.sum smsp__inst_executed_op_shared_st.sum smsp__inst_executed_op_ldsm.sum \
         smsp__inst_executed.sum gpu__time_duration.sum; do
  METRICS="$METRICS,$m"
done
timeout 240 ncu --clock-control none --profile-from-start off -k regex:prepare --metrics "$METRICS" --csv \
  --page raw python3 bench/dev/ncu_forward.py --tokens "$TOKENS" --heads "$HEADS" > "$OUT/ncu_prepare_l1.csv" 2>&1
python3 - "$OUT/ncu_prepare_l1.csv" <<'PY'
import csv, sys
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = list(csv.reader(lines))
if len(rows) < 3:
    print("".join(open(sys.argv[1]).readlines()[-20:]))
    sys.exit(0)
head, units = rows[0], rows[1]
for row in rows[2:]:
    for name, unit, value in zip(head, units, row):
        # totals and the percent-of-peak averages; the per-SM min/max and the summed percentages are left out
        total = name.endswith(".sum") and not name.endswith("pct_of_peak_sustained_elapsed.sum")
        if name.startswith(("l1tex", "smsp", "gpu__")) and (total or name.endswith("avg.pct_of_peak_sustained_elapsed")):
            print(f"{name:<80} {value:>16} {unit}")
PY
