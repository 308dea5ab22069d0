#!/usr/bin/env bash
# call 2: parity_bench (the golden model from the two GGUF halves) beside the GPU tests
set -uo pipefail
T0=$(date +%s)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVSERVE_CACHE=/tmp/kvc KVSERVE_COMMIT=${KVSERVE_COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --target /tmp/site2 devcarry/mB/*.whl 2>&1 | tail -2
export PYTHONPATH=$PYTHONPATH:/tmp/site2
(timeout ${TEST_S:-440} python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -m gpu --durations=15 \
  --junitxml=$OUT/pytest.xml tests/test_gpu_triton.py tests/test_fp8_query_attention.py tests/test_attention_backend.py \
  tests/test_triton_kernels.py tests/test_gpu.py --deselect tests/test_gpu.py::test_gpu_memory_utilization_sizes_the_pool \
  > $OUT/pytest.log 2>&1; echo "tests rc=$? $(( $(date +%s) - T0 ))s" > $OUT/tests_rc.txt) &
timeout ${PARITY_S:-460} python3 benchmarks/parity_bench.py --gguf /tmp/mw/gguf.a,devcarry/mB/gguf.b \
  --prompts devcarry/eval/golden_public.jsonl --vllm-reference devcarry/eval/golden_public_vllm_fp32.jsonl \
  --jobs ${JOBS:-4} --time-budget-s $(( ${PARITY_S:-460} - 60 )) --out $OUT/parity.json > $OUT/parity.log 2>&1
echo "parity rc=$? $(( $(date +%s) - T0 ))s"; grep -E "^\[parity\]|^summary|Error|error" $OUT/parity.log | head -60
sha256sum /tmp/kvc/SmolLM2-135M-Instruct/model.safetensors | tee $OUT/model_sha.txt
wait; cat $OUT/tests_rc.txt; tail -4 $OUT/pytest.log; grep -E "^FAILED|^ERROR" $OUT/pytest.log | head -20
echo "total $(( $(date +%s) - T0 ))s"
