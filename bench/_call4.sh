set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
NCU=$(command -v ncu)
t0=$(date +%s)
timeout 150 $NCU --clock-control none --profile-from-start off --set full --import-source yes -k regex:"prepare|chunk_fwd" \
  -o /tmp/fwd32k python3 bench/ncu_forward.py --tokens 32768 --heads 16/64 > $OUT/ncu_run.log 2>&1
echo "profiled rc $? at $(( $(date +%s) - t0 )) s"
$NCU -i /tmp/fwd32k.ncu-rep --page raw --csv > $OUT/ncu_raw.csv 2>&1
for k in prepare chunk_fwd; do
  $NCU -i /tmp/fwd32k.ncu-rep -k regex:$k --page source --print-source sass --csv > $OUT/ncu_sass_$k.csv 2>&1
done
ls -la $OUT /tmp/fwd32k.ncu-rep
echo "done at $(( $(date +%s) - t0 )) s"
