# Probe (to history): batch-1 fixed cost / stream-K waves / ncu metrics, then the GPU W4A16 tests.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/probe_w4a16_prefetch/probe2.py 2>&1 | tail -8
NCU=$(ls /usr/local/cuda/bin/ncu 2>/dev/null || which ncu)
M=sm__cycles_active.min,sm__cycles_active.max,sm__cycles_active.avg,sm__cycles_elapsed.max,smsp__inst_executed.sum,dram__bytes_read.sum,smsp__warps_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warps_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warps_issue_stalled_wait_per_warp_active.pct,smsp__warps_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warps_issue_stalled_not_selected_per_warp_active.pct,smsp__warps_issue_stalled_selected_per_warp_active.pct,smsp__warps_issue_stalled_lg_throttle_per_warp_active.pct,smsp__warps_issue_stalled_dispatch_stall_per_warp_active.pct,smsp__warps_issue_stalled_no_instruction_per_warp_active.pct,smsp__warps_issue_stalled_barrier_per_warp_active.pct,smsp__warps_issue_stalled_membar_per_warp_active.pct,smsp__warps_issue_stalled_drain_per_warp_active.pct,smsp__warps_issue_stalled_mio_throttle_per_warp_active.pct,smsp__warps_issue_stalled_branch_resolving_per_warp_active.pct,gpu__time_duration.sum
timeout 90 $NCU --clock-control none --kernel-name regex:w4a16_mma --metrics $M \
  python3 benchmarks/probe_w4a16_prefetch/ncu_probe.py > $OUT/ncu2.txt 2>&1
grep -E "w4a16_mma|sm__|smsp__|dram__|gpu__" $OUT/ncu2.txt | head -70
timeout -s INT 240 .ci/gpu -k "gluon or w4a16 or quant_experts or fp8_gemm or cuda_matches_cpu" -p no:logging --show-capture=no --tb=line > $OUT/tests.log 2>&1
tail -c 1500 $OUT/tests.log
