#!/usr/bin/env bash
# device call driver: STAGES=1,2,5 RUN_S=570 KVSERVE_COMMIT=sha bash devcarry/run.sh
set -uo pipefail
T0=$(date +%s); RUN_S=${RUN_S:-570}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVSERVE_COMMIT=${KVSERVE_COMMIT:-unknown}
left() { echo $(( RUN_S - ($(date +%s) - T0) )); }
cap() { local want=$1 l; l=$(left); [ "$want" -lt "$l" ] && echo "$want" || echo $(( l > 5 ? l - 5 : 1 )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
if [ -f devcarry/fi_site.tar.xz ] && [ "${FI:-1}" = 1 ]; then
  mkdir -p /tmp/site && tar -xJf devcarry/fi_site.tar.xz -C /tmp/site && export PYTHONPATH=$PYTHONPATH:/tmp/site
  echo "fi untar $(( $(date +%s) - T0 ))s"
  for dt in bf16 fp8; do for m in cuda_cores tensor_cores; do
    (timeout 240 python3 devcarry/fi_warm.py $dt $m > $OUT/fi_warm_${dt}_${m}.log 2>&1 &) ; done; done
fi
s1() { timeout $(cap ${STAGE1_S:-150}) python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
  --junitxml=$OUT/pytest1.xml ${TESTS:-tests/test_fp8_query_attention.py tests/test_attention_backend.py \
  tests/test_triton_kernels.py::test_attention_mixed_batch_gpu tests/test_triton_kernels.py::test_attention_decode_only_gpu} \
  ${STAGE1_ARGS:-} > $OUT/pytest1.log 2>&1; echo "s1 rc=$? $(( $(date +%s) - T0 ))s"; tail -3 $OUT/pytest1.log; }
s2() { timeout $(cap ${STAGE2_S:-240}) python3 benchmarks/kernel_bench.py --out $OUT/kernels.json --no-flex \
  --sections ${SECTIONS:-copy,store,prefill,decode} --fp8q-pv8 --batches ${BATCHES:-32,64,256} \
  --contexts ${CONTEXTS:-512,1024,4096,16384} --store-tokens 4096,16384 --prefill-tokens 1024,4096 \
  --time-budget-s $(( $(cap ${STAGE2_S:-240}) - 20 )) ${STAGE2_ARGS:-} > $OUT/kernels.log 2>&1
  echo "s2 rc=$? $(( $(date +%s) - T0 ))s"; grep -E "^\[|KERNEL|summary" $OUT/kernels.log | tail -60; }
s3() { timeout $(cap ${STAGE3_S:-330}) python3 benchmarks/e2e_bench.py --models ${E2E_MODELS:-qwen3-0.6b,llama-3-8b} --skip-peer \
  --out $OUT/e2e.json ${STAGE3_ARGS:-} > $OUT/e2e.log 2>&1; echo "s3 rc=$? $(( $(date +%s) - T0 ))s"; tail -25 $OUT/e2e.log; }
s4() { timeout $(cap ${STAGE4_S:-120}) python3 benchmarks/e2e_bench.py --profile --models qwen3-0.6b --profile-steps 10 \
  --out $OUT/profile.json ${STAGE4_ARGS:-} > $OUT/profile.log 2>&1; echo "s4 rc=$? $(( $(date +%s) - T0 ))s"; tail -30 $OUT/profile.log; }
s5() { timeout $(cap ${STAGE5_S:-150}) python3 devcarry/prefill_tiles_probe.py --out $OUT/prefill_tiles.json \
  --budget-s $(( $(cap ${STAGE5_S:-150}) - 15 )) ${PROBE_ARGS:-} > $OUT/probe.log 2>&1; echo "s5 rc=$? $(( $(date +%s) - T0 ))s"; tail -50 $OUT/probe.log; }
s6() { timeout $(cap ${STAGE6_S:-120}) python3 devcarry/diag_fp8q.py > $OUT/diag.log 2>&1; echo "s6 rc=$? $(( $(date +%s) - T0 ))s"; tail -40 $OUT/diag.log; }
s7() { PROBE_S=$(( $(cap ${STAGE7_S:-150}) - 20 )) timeout $(cap ${STAGE7_S:-150}) python3 devcarry/decode_probe.py > $OUT/decode_probe.log 2>&1; echo "s7 rc=$? $(( $(date +%s) - T0 ))s"; tail -5 $OUT/decode_probe.log; }
s8() { timeout $(cap ${STAGE8_S:-60}) python3 benchmarks/kernel_bench.py --out $OUT/kernels_h256.json --no-flex \
  --sections prefill --q-heads 24 --kv-heads 4 --head-dim 256 --prefill-tokens 1024,4096 --fp8q-pv8 \
  --time-budget-s $(( $(cap ${STAGE8_S:-60}) - 10 )) > $OUT/kernels_h256.log 2>&1
  echo "s8 rc=$? $(( $(date +%s) - T0 ))s"; grep -E "^\[prefill|summary" $OUT/kernels_h256.log | tail -5; }
for s in ${STAGES//,/ }; do
  if [[ $s == *+* ]]; then a=${s%+*}; b=${s#*+}; s$a > $OUT/par_$a.txt 2>&1 & s$b; wait; cat $OUT/par_$a.txt
  else [ "$(left)" -gt 15 ] && s$s; fi
done
cat $OUT/fi_warm_*.log 2>/dev/null | tail -8
echo "total $(( $(date +%s) - T0 ))s"
cd $OUT && tar -czf logs.tgz *.log *.txt *.xml 2>/dev/null; rm -f *.log *.txt *.xml; ls
