#!/usr/bin/env bash
# First GPU call of a session: kernel/engine tests on CUDA, then the decode tile probe.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py tests/test_gpu_triton.py tests/test_triton_backend.py tests/test_gpu.py 2>&1 | tee $OUT/pytest_gpu.log | tail -25
timeout 240 python3 benchmarks/decode_probe.py --out $OUT/decode_probe.json 2>&1 | tee $OUT/decode_probe.log
