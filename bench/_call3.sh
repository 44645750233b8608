set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"; $NCU --version | tail -1
t0=$(date +%s)
timeout 200 $NCU --clock-control none --profile-from-start off --set full -k regex:"prepare|chunk_fwd" \
  python3 bench/ncu_forward.py --tokens 32768 --heads 16/64 > $OUT/ncu_16v64_32k.txt 2> $OUT/ncu_16v64_32k.err
echo "rc $? at $(( $(date +%s) - t0 )) s"
timeout 150 $NCU --clock-control none --profile-from-start off --set full -k regex:"chunk_fwd" \
  python3 bench/ncu_forward.py --tokens 8192 --heads 8/32 > $OUT/ncu_8v32_8k.txt 2> $OUT/ncu_8v32_8k.err
echo "rc $? at $(( $(date +%s) - t0 )) s"
for f in $OUT/ncu_*.txt; do echo "== $f"; grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Executed Ipc A|Registers Per|Achieved Occupancy|L1/TEX Hit|Shared Memory|Warp Cycles Per Issued|No Eligible|One or More|Stall" $f | head -60; done
tail -5 $OUT/ncu_*.err
