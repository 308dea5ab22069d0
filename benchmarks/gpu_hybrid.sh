#!/usr/bin/env bash
# H200 (issue 5, GPU half): the Triton GDN kernels vs the reference (27B head shape included), the
# hybrid engine tests on CUDA (triton attention + GDN kernels, float32 vs transformers), then the
# Qwen3.6-27B-shaped prefill benchmark (bf16 vs fp8 KV, traffic's prediction, transformers peer).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gdn.py tests/test_hybrid_engine.py 2>&1 \
  | tee $OUT/pytest_hybrid_gpu.log | grep -E "passed|failed|Error|assert" | tail -8
timeout 420 python3 benchmarks/hybrid_bench.py --out $OUT/hybrid_27b.json 2>&1 | tee $OUT/hybrid_27b.log \
  | grep -vE "INFO|WARNING" | tail -20
