#!/usr/bin/env bash
# call 1 (2026-12-06 sixth session): swapped-decode probe, fp8q GPU tests (the swapped decode in the tree),
# e2e both shapes, store at 256/4k/16k tokens, prefill tile probe with what is left
set -uo pipefail
T0=$(date +%s); RUN_S=${RUN_S:-585}
left() { echo $(( RUN_S - ($(date +%s) - T0) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVSERVE_COMMIT=${KVSERVE_COMMIT:-unknown}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
timeout 130 python3 devcarry/swap_probe.py $OUT/swap_probe.json 95 > $OUT/swap_probe.log 2>&1
echo "swap rc=$? $(( $(date +%s) - T0 ))s"; cat $OUT/swap_probe.log | grep -v Warn | cut -c1-150
timeout 80 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -m gpu tests/test_fp8_query_attention.py > $OUT/pytest.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 ))s"; tail -2 $OUT/pytest.log; grep -E "^FAILED|^ERROR|assert" $OUT/pytest.log | head -12 | cut -c1-250
[ $(left) -gt 260 ] && timeout $(( $(left) - 110 )) python3 benchmarks/e2e_bench.py --models ${MODELS:-qwen3-0.6b,llama-3-8b} --skip-peer \
  --out $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s) - T0 ))s"; grep -vE "INFO|WARNING" $OUT/e2e.log | tail -14 | cut -c1-220
[ $(left) -gt 150 ] && timeout 45 python3 benchmarks/kernel_bench.py --out $OUT/kernels.json --no-flex --sections copy,store \
  --store-tokens 256,4096,16384 --time-budget-s 35 > $OUT/kernels.log 2>&1
echo "kernels rc=$? $(( $(date +%s) - T0 ))s"; grep -E "^\[(copy|store)" $OUT/kernels.log | cut -c1-220
timeout $(( $(left) - 2 )) python3 devcarry/prefill_probe.py $OUT/prefill_probe.json $(( $(left) - 25 )) > $OUT/prefill_probe.log 2>&1
echo "prefill probe rc=$? $(( $(date +%s) - T0 ))s"; cat $OUT/prefill_probe.log | grep -v Warn | cut -c1-150
echo "total $(( $(date +%s) - T0 ))s"
