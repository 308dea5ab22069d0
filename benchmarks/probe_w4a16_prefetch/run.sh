# Probe (to history): prefetch depth sweep of the Gluon W4A16 kernel + ncu + the GPU W4A16 tests.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv
timeout -s INT 300 python3 benchmarks/quant_bench.py --sweep --fp8-batches "" --batches 1,16,32 \
  --shapes gate_or_up,down,gate_up_fused --time-budget-s 270 --out $OUT/sweep.json > $OUT/sweep.log 2>&1
grep -v "^\s*$" $OUT/sweep.log | tail -12
NCU=$(ls /usr/local/cuda/bin/ncu 2>/dev/null || which ncu)
timeout 100 $NCU --clock-control none --kernel-name regex:w4a16_mma --launch-skip 0 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis \
  python3 benchmarks/probe_w4a16_prefetch/ncu_probe.py > $OUT/ncu.txt 2>&1
grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Stall Long|No Eligible|Issued Warp|Warp Cycles Per Issued|Block Limit Reg|Memory Throughput" $OUT/ncu.txt | head -80
timeout -s INT 150 .ci/gpu -k "gluon or w4a16 or quant_experts or fp8_gemm or cuda_matches_cpu" -p no:logging --show-capture=no --tb=line > $OUT/tests.log 2>&1
tail -15 $OUT/tests.log
