#!/usr/bin/env bash
# H200 call 3: the GPU tests the kernel call's time limit cut off, then where a decode step's time goes.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_triton.py tests/test_triton_kernels.py \
  -k "gpu_triton or decode_only_gpu or beyond or cuda_graph" 2>&1 | tee $OUT/pytest_gpu2.log | grep -E "passed|failed|Error|assert" | tail -8
timeout 100 python3 benchmarks/step_profile.py --kv-cache-dtype bfloat16 --steps 15 2>&1 | grep -v INFO | tee $OUT/step_bf16.log | tail -30
timeout 75 python3 benchmarks/step_profile.py --kv-cache-dtype fp8 --steps 15 2>&1 | grep -v INFO | tee $OUT/step_fp8.log | grep -E "median|prefill|batch"
