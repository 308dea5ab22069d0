#!/usr/bin/env bash
# short call: the swapped-decode probe, then the fp8q GPU tests (both decode kernels) with what is left
set -uo pipefail
T0=$(date +%s)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout 100 python3 devcarry/swap_probe.py $OUT/swap_probe.json 60 > $OUT/swap_probe.log 2>&1
echo "swap rc=$? $(( $(date +%s) - T0 ))s"; cat $OUT/swap_probe.log | grep -v Warn | cut -c1-150
timeout $(( ${RUN_S:-160} - ($(date +%s) - T0) )) python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -m gpu tests/test_fp8_query_attention.py > $OUT/pytest.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 ))s"; tail -2 $OUT/pytest.log; grep -E "^FAILED|^ERROR|assert" $OUT/pytest.log | head -12 | cut -c1-250
