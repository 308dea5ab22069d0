#!/usr/bin/env bash
# H200, last call of the 2026-11-29 evening session: the unmasked-tile attention kernel against the
# previous one (A/B, same run), its GPU kernel tests, the engine tests, and the Qwen3-0.6B-shaped
# end to end (no peer) with it.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# benchmarks/baseline_attention.py: the previous kernel, copied beside it before the call (the
# device's checkout has no git history): git show 495dce0:kvserve/kernels/triton_attention.py
timeout 100 python3 benchmarks/attn_ab.py --baseline benchmarks/baseline_attention.py --out $OUT/attn_ab.json 2>&1 \
  | tee $OUT/attn_ab.log | grep -v Warning
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py -k "attention and (decode or boundaries)" 2>&1 \
  | tee $OUT/pytest_kernels.log | grep -E "passed|failed|Error|assert" | tail -4
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_triton.py 2>&1 \
  | tee $OUT/pytest_gpu.log | grep -E "passed|failed|Error|assert" | tail -4
timeout 120 python3 benchmarks/e2e_bench.py --models qwen3-0.6b --skip-peer --out $OUT/e2e_qwen.json 2>&1 \
  | tee $OUT/e2e_qwen.log | grep -vE "INFO|WARNING" | tail -8
