#!/usr/bin/env bash
# call 1: park the model's first half; FlashInfer warm-up in the background while the split probe and
# the head-256 prefill run; kernel_bench (FlashInfer + vLLM Triton peers); e2e with what is left
set -uo pipefail
T0=$(date +%s); RUN_S=${RUN_S:-550}
left() { echo $(( RUN_S - ($(date +%s) - T0) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVSERVE_COMMIT=${KVSERVE_COMMIT:-unknown}
mkdir -p /tmp/mw && cp devcarry/mA/gguf.a /tmp/mw/ && echo "parked $(ls -la /tmp/mw | tail -1)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
mkdir -p /tmp/site && tar -xJf devcarry/fi_site.tar.xz -C /tmp/site && echo "fi untar $(( $(date +%s) - T0 ))s"
for dt in bf16 fp8; do for m in cuda_cores tensor_cores; do
  (PYTHONPATH=$PYTHONPATH:/tmp/site timeout 240 python3 devcarry/fi_warm.py $dt $m > $OUT/fi_warm_${dt}_${m}.log 2>&1 &); done; done
timeout ${TEST_S:-120} python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -m gpu --durations=10 \
  --junitxml=$OUT/pytest_triton.xml tests/test_gpu_triton.py > $OUT/pytest_triton.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 ))s"; tail -3 $OUT/pytest_triton.log; grep -E "^FAILED|^ERROR" $OUT/pytest_triton.log | head
PROBE_S=${PROBE_S:-90} timeout $(( ${PROBE_S:-90} + 40 )) python3 devcarry/split_probe.py > $OUT/split_probe.log 2>&1
echo "probe rc=$? $(( $(date +%s) - T0 ))s"; python3 -c "
import json; rows=json.load(open('$OUT/split_probe.json'))
for r in rows: print(r['b'], r['ctx'], r['read'], 's%d' % r['splits'], 'auto%d' % r['auto'], '%.1f us' % (r['clean_ms']*1e3 if r.get('clean_ms') else -1), '%.1f%%' % (r['clean_pct'] or -1))"
timeout ${H256_S:-50} python3 benchmarks/kernel_bench.py --out $OUT/kernels_h256.json --no-flex \
  --sections prefill --q-heads 24 --kv-heads 4 --head-dim 256 --prefill-tokens 1024,4096 --fp8q-pv8 \
  --time-budget-s $(( ${H256_S:-50} - 10 )) > $OUT/kernels_h256.log 2>&1
echo "h256 rc=$? $(( $(date +%s) - T0 ))s"; grep -E "^\[prefill|summary" $OUT/kernels_h256.log | tail -8
for i in $(seq 1 60); do n=$(grep -l " ok " $OUT/fi_warm_*.log 2>/dev/null | wc -l); [ "$n" -ge 4 ] && break; sleep 2; done
cat $OUT/fi_warm_*.log | tail -8; echo "fi warm waited $(( $(date +%s) - T0 ))s"
KB=$(( $(left) - ${E2E_RESERVE:-130} )); [ $KB -gt 240 ] && KB=240
PYTHONPATH=$PYTHONPATH:/tmp/site timeout $KB python3 benchmarks/kernel_bench.py --out $OUT/kernels.json --no-flex --fp8q-pv8 \
  --vllm-triton-src devcarry/vsrc --batches 32,64,256 --contexts 512,1024,4096,16384 --store-tokens 4096,16384 \
  --prefill-tokens 1024,4096 --time-budget-s $(( KB - 25 )) > $OUT/kernels.log 2>&1
echo "kernels rc=$? $(( $(date +%s) - T0 ))s"; grep -E "^\[|summary|FAIL" $OUT/kernels.log | tail -70
E2=$(( $(left) - 5 ))
timeout $E2 python3 benchmarks/e2e_bench.py --models qwen3-0.6b,llama-3-8b --skip-peer --out $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s) - T0 ))s"; tail -22 $OUT/e2e.log
echo "total $(( $(date +%s) - T0 ))s"
