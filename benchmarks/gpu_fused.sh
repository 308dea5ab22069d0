#!/usr/bin/env bash
# H200: the fused layer kernels (RMSNorm, rotary, SiLU-mul) on CUDA, the engine tests with them,
# then the decode-step profile (Qwen3-0.6B-shaped, bf16 KV) to see what they and the CPU-side cuts buy.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 110 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_layers.py tests/test_gpu_triton.py 2>&1 \
  | tee $OUT/pytest_fused.log | grep -E "passed|failed|Error|assert" | tail -6
timeout 80 python3 benchmarks/step_profile.py --kv-cache-dtype bfloat16 --steps 10 2>&1 | grep -v INFO | tee $OUT/step_fused.log \
  | grep -E "median|prefill|batch|_attention_kernel|_rmsnorm|_rotary|_silu|elementwise" | head -20
