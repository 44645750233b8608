set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
NCU=$(command -v ncu)
t0=$(date +%s)
for spec in "2/8 2048" "8/32 2048" "16/32 2048" "8/24 2048" "16/64 2048" "8/32 8192" "2/8 32768"; do
  set -- $spec
  timeout 60 $NCU --clock-control none --profile-from-start off --section SpeedOfLight --section LaunchStats \
    -k regex:"prepare|chunk_fwd" python3 bench/ncu_forward.py --tokens $2 --heads $1 > $OUT/sol_${1/\//v}_$2.txt 2>&1
  echo "$1 $2: $(grep -E '^  [a-z_]+_kernel|Duration' $OUT/sol_${1/\//v}_$2.txt | awk '/kernel/{k=$1} /Duration/{printf "%s %s us  ", k, $3}')"
done
echo "done at $(( $(date +%s) - t0 )) s"
