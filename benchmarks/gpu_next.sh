#!/usr/bin/env bash
# H200, first call of the next session: what this session wrote but could not measure (fp8 V as
# words, fused temperature sampling, persistent block table), then the end to end with them.
#   GPU tests (sampling kernel, engine) -> step profiles (async) -> e2e Qwen (peer on 64) -> e2e Llama
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# the fp8 V-as-words experiment against the default kernel (same file as baseline: "baseline" = default)
timeout 100 python3 benchmarks/attn_ab.py --baseline kvserve/kernels/triton_attention.py --tiles "16,64,4,2;16,128,4,3" --v-words \
  --out $OUT/attn_vwords.json 2>&1 | tee $OUT/attn_vwords.log | grep -v Warning
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_sampling.py tests/test_gpu_triton.py \
  tests/test_triton_kernels.py -k "not store and (sampl or gpu or async or graphs or eager or v_as_words or boundaries)" 2>&1 \
  | tee $OUT/pytest_gpu.log | grep -E "passed|failed|Error|assert" | tail -6
for kv in bfloat16 fp8; do
  timeout 45 python3 benchmarks/step_profile.py --kv-cache-dtype $kv --steps 10 2>&1 | grep -v INFO \
    | tee $OUT/step_${kv}.log | grep -E "median|async|_attention_kernel|_gumbel" | head -16
done
timeout 190 python3 benchmarks/e2e_bench.py --models qwen3-0.6b --peer-requests 64 --peer-timeout-s 90 \
  --out $OUT/e2e_qwen.json 2>&1 | tee $OUT/e2e_qwen.log | grep -vE "INFO|WARNING" | tail -12
timeout 140 python3 benchmarks/e2e_bench.py --models llama-3-8b --skip-peer --out $OUT/e2e_llama.json 2>&1 \
  | tee $OUT/e2e_llama.log | grep -vE "INFO|WARNING" | tail -8
