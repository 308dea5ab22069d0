# Probe (to history): the Gluon tile sweep (prefetch depth, two accumulators) at batch 1-32, then the GPU W4A16 tests.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout -s INT 230 python3 benchmarks/quant_bench.py --sweep --fp8-batches "" --batches 1,4,8,16,32 \
  --shapes gate_or_up,down,gate_up_fused --time-budget-s 210 --out $OUT/sweep3.json > $OUT/sweep3.log 2>&1
grep -E "^(gate|down)" $OUT/sweep3.log | cut -c1-200
timeout -s INT 330 python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -p no:logging --show-capture=no --durations=8 \
  tests/test_gluon_w4a16.py tests/test_modelopt_load.py::test_fp8_gemm_on_cuda_matches_the_cpu_run \
  tests/test_nvfp4.py::test_cuda_matches_cpu tests/test_triton_w4a16.py tests/test_quant_experts.py > $OUT/tests3.log 2>&1
tail -c 2500 $OUT/tests3.log
