#!/usr/bin/env bash
# call 1 (2026-12-06 fifth session): fp8 V pages transposed -- GPU tests, then kernel_bench with the
# untransposed reads beside (--nhd), FlashInfer + vLLM Triton peers; head-256 prefill
set -uo pipefail
T0=$(date +%s); RUN_S=${RUN_S:-560}
left() { echo $(( RUN_S - ($(date +%s) - T0) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVSERVE_COMMIT=${KVSERVE_COMMIT:-unknown}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1; cat $OUT/gpu.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
mkdir -p /tmp/site && tar -xJf devcarry/fi_site.tar.xz -C /tmp/site && echo "fi untar $(( $(date +%s) - T0 ))s"
for dt in bf16 fp8; do for m in cuda_cores tensor_cores; do
  (PYTHONPATH=$PYTHONPATH:/tmp/site timeout 240 python3 devcarry/fi_warm.py $dt $m > $OUT/fi_warm_${dt}_${m}.log 2>&1 &); done; done
timeout ${TEST_S:-90} python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -m gpu --durations=8 \
  tests/test_fp8_query_attention.py tests/test_triton_kernels.py > $OUT/pytest.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 ))s"; tail -3 $OUT/pytest.log; grep -E "^FAILED|^ERROR" $OUT/pytest.log | head -20
timeout ${PROBE_S:-160} python3 devcarry/tile_probe.py $OUT/tile_probe.json $(( ${PROBE_S:-160} - 75 )) > $OUT/tile_probe.log 2>&1
echo "probe rc=$? $(( $(date +%s) - T0 ))s"; grep -c us $OUT/tile_probe.log; tail -2 $OUT/tile_probe.log
for i in $(seq 1 60); do n=$(grep -l " ok " $OUT/fi_warm_*.log 2>/dev/null | wc -l); [ "$n" -ge 4 ] && break; sleep 2; done
cat $OUT/fi_warm_*.log | tail -4; echo "fi warm waited $(( $(date +%s) - T0 ))s"
KB=$(( $(left) - 5 ))
PYTHONPATH=$PYTHONPATH:/tmp/site timeout $KB python3 benchmarks/kernel_bench.py --out $OUT/kernels.json --no-flex --nhd \
  --vllm-triton-src devcarry/vsrc --batches 32,64,256 --contexts 512,1024,4096,16384 --store-tokens 256,4096 \
  --prefill-tokens 1024,4096 --time-budget-s $(( KB - 30 )) > $OUT/kernels.log 2>&1
echo "kernels rc=$? $(( $(date +%s) - T0 ))s"; grep -E "^\[(store|prefill|mixed|ragged|decode|CHECK)|summary" $OUT/kernels.log | cut -c1-200 | tail -25
echo "total $(( $(date +%s) - T0 ))s"
