#!/usr/bin/env bash
# call 2: e2e (nano-vllm workload, both shapes) at the reverted tree, then the step profile with what is left
set -uo pipefail
T0=$(date +%s); RUN_S=${RUN_S:-400}
left() { echo $(( RUN_S - ($(date +%s) - T0) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVSERVE_COMMIT=${KVSERVE_COMMIT:-unknown}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
timeout $(( $(left) - ${PROFILE_RESERVE:-70} )) python3 benchmarks/e2e_bench.py --models ${MODELS:-qwen3-0.6b,llama-3-8b} --skip-peer \
  --out $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s) - T0 ))s"; grep -vE "INFO|WARNING" $OUT/e2e.log | tail -16 | cut -c1-220
timeout $(( $(left) - 3 )) python3 benchmarks/e2e_bench.py --profile --models qwen3-0.6b --profile-steps 10 \
  --out $OUT/profile.json > $OUT/profile.log 2>&1
echo "profile rc=$? $(( $(date +%s) - T0 ))s"; grep -vE "INFO|WARNING" $OUT/profile.log | tail -12 | cut -c1-220
echo "total $(( $(date +%s) - T0 ))s"
