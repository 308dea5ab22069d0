#!/usr/bin/env bash
# H200, third session, call 3: engine GPU tests with the start-up kernel warm-up, then end to end on
# both models (Qwen3-0.6B-shaped with the transformers peer on 64 requests; Llama-3-8B-shaped).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_triton.py 2>&1 | tee $OUT/pytest_gpu_engine.log \
  | grep -E "passed|failed|Error|assert" | tail -4
timeout 170 python3 benchmarks/e2e_bench.py --models qwen3-0.6b --peer-requests 64 --peer-timeout-s 60 \
  --out $OUT/e2e_qwen.json > $OUT/e2e_qwen.log 2>&1
grep -E "Warmed up|Captured" $OUT/e2e_qwen.log | head -3; grep -vE "INFO|WARNING" $OUT/e2e_qwen.log | tail -10
timeout 150 python3 benchmarks/e2e_bench.py --models llama-3-8b --skip-peer --out $OUT/e2e_llama.json > $OUT/e2e_llama.log 2>&1
grep -E "Warmed up" $OUT/e2e_llama.log | head -2; grep -vE "INFO|WARNING" $OUT/e2e_llama.log | tail -6
