#!/usr/bin/env bash
# H200, one call (session 2026-11-29 evening): async scheduling + pinned inputs + the new store
# tiling on the GPU: GPU tests, end to end (Qwen3-0.6B-shaped with the transformers peer on the
# first 64 requests, Llama-3-8B-shaped), and the decode-step profile under async scheduling.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee $OUT/gpu.txt
timeout 130 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_triton.py 2>&1 \
  | tee $OUT/pytest_gpu.log | grep -E "passed|failed|Error|assert" | tail -6
timeout 190 python3 benchmarks/e2e_bench.py --models qwen3-0.6b --peer-requests 64 --peer-timeout-s 90 \
  --out $OUT/e2e_qwen.json 2>&1 | tee $OUT/e2e_qwen.log | grep -vE "INFO|WARNING" | tail -14
timeout 45 python3 benchmarks/step_profile.py --kv-cache-dtype bfloat16 --steps 10 2>&1 | grep -v INFO \
  | tee $OUT/step_bf16_async.log | grep -E "median|prefill|async|_attention_kernel" | head -16
timeout 140 python3 benchmarks/e2e_bench.py --models llama-3-8b --skip-peer --out $OUT/e2e_llama.json 2>&1 \
  | tee $OUT/e2e_llama.log | grep -vE "INFO|WARNING" | tail -10
timeout 45 python3 benchmarks/step_profile.py --kv-cache-dtype fp8 --steps 10 2>&1 | grep -v INFO \
  | tee $OUT/step_fp8_async.log | grep -E "median|prefill|async|_attention_kernel" | head -16
