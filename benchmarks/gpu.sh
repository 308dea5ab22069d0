#!/usr/bin/env bash
# The H200 entry of the benchmark suite: runs the chosen families one after another, each under
# `timeout`, writes $OUT/<family>.json and $OUT/<family>.log, and prints one summary line each.
#
#   bash benchmarks/gpu.sh SUITE...     SUITE: kernels e2e gdn hybrid quant moe serve cpu profile parity, or all
#                                       (all = kernels e2e gdn hybrid quant moe serve cpu)
#
#   kernels  kernel_bench.py: copy, store, decode grid bf16 vs fp8 vs FlexAttention, prefill vs SDPA
#   e2e      e2e_bench.py: nano-vllm workload, Qwen3-0.6B (+ transformers on 64 requests), Llama-3-8B
#   gdn      gdn_bench.py: GDN prefill / conv / decode kernels (27B heads) vs fla-core (WHEELS)
#   quant    quant_bench.py: the W4A16 NVFP4 GEMM vs the bf16 GEMM (cuBLAS) on the 27B MLP shapes
#   moe      moe_bench.py: the 35B-A3B routed experts (256 x 2048 -> 512, top-8): grouped GEMMs vs copy
#            bandwidth and dense bf16 GEMMs, SparseMoeBlock device path vs the torch loop, tokens 1-8192
#   hybrid   hybrid_bench.py: Qwen3.6-27B-shaped prefill + decode, bf16 vs fp8 KV, transformers generate
#   serve    serve_bench.py --offline: kvserve serve + kvserve bench serve, c1/16/64/256, bf16 vs fp8 KV, the offline engine on each point's workload
#   cpu      cpu_bench.py on the host CPU (default model if built, else SmolLM2-shaped random weights)
#   profile  e2e_bench.py --profile: where a Qwen3-0.6B decode step's time goes, bf16 and fp8
#   parity   parity_bench.py: the golden set's greedy / teacher-forced parity of every read (fp32, the fp8 reads)
#            (the default model, or PARITY_ARGS="--gguf part1,part2" to build it from a carried GGUF)
#
# Seconds each family may take (a device call allows 600 s: two families fit one call):
#   KERNELS_S=150 E2E_S=330 GDN_S=150 HYBRID_S=330 QUANT_S=240 MOE_S=240 SERVE_S=420 CPU_S=300 PROFILE_S=120 PARITY_S=480
# More flags for one family's script: KERNELS_ARGS E2E_ARGS GDN_ARGS HYBRID_ARGS QUANT_ARGS MOE_ARGS SERVE_ARGS CPU_ARGS PROFILE_ARGS PARITY_ARGS.
# OUT: the output folder (default a new /tmp/kvserve-bench.* folder). KVSERVE_COMMIT: the commit
# each JSON records (set it on the device machine: its copy of the tree has no or a stale .git).
# WHEELS: a folder of .whl files carried to the device (the server's wheels for `serve`, peers such
# as fla-core): installed with pip --no-index --no-deps into /tmp/kvserve-site, first on PYTHONPATH.
set -uo pipefail

FAMILIES=(kernels e2e gdn hybrid quant moe serve cpu profile parity)
ALL=(kernels e2e gdn hybrid quant moe serve cpu)
known() {
  local f
  for f in "${FAMILIES[@]}" all; do [ "$1" = "$f" ] && return 0; done
  return 1
}
if [ $# -eq 0 ]; then
  echo "usage: bash benchmarks/gpu.sh SUITE...  (SUITE: ${FAMILIES[*]} all)" >&2
  exit 2
fi
suites=()
for s in "$@"; do
  if ! known "$s"; then
    echo "gpu.sh: unknown suite '$s'; accepted: ${FAMILIES[*]} all" >&2
    exit 2
  fi
  if [ "$s" = all ]; then suites+=("${ALL[@]}"); else suites+=("$s"); fi
done

cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-$(mktemp -d /tmp/kvserve-bench.XXXXXX)}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/kvserve-site "$WHEELS"/*.whl 2>&1 | tail -3
  export PYTHONPATH=/tmp/kvserve-site:$PYTHONPATH
fi
KERNELS_S=${KERNELS_S:-150} E2E_S=${E2E_S:-330} GDN_S=${GDN_S:-150} HYBRID_S=${HYBRID_S:-330} QUANT_S=${QUANT_S:-240}
MOE_S=${MOE_S:-240} SERVE_S=${SERVE_S:-420} CPU_S=${CPU_S:-300} PROFILE_S=${PROFILE_S:-120} PARITY_S=${PARITY_S:-480}

default_model_built() {
  python3 -c "from kvserve.loader import default_model as d; import sys; \
sys.exit(0 if (d.default_cache_dir() / d.DEFAULT_MODEL_NAME / d.MARKER).is_file() else 1)" 2>/dev/null
}

# the command of each family ($1 = the family); extra flags from <FAMILY>_ARGS, split on spaces
family_command() {
  case $1 in
    kernels) echo python3 benchmarks/kernel_bench.py --out "$OUT/kernels.json" \
               --time-budget-s $((KERNELS_S - 45)) --batches 32,256,64,1,8 --contexts 4096,16384,1024,32768 \
               ${KERNELS_ARGS:-} ;;
    e2e)     echo python3 benchmarks/e2e_bench.py --models qwen3-0.6b,llama-3-8b --peer-requests 64 \
               --peer-timeout-s 60 --out "$OUT/e2e.json" ${E2E_ARGS:-} ;;
    gdn)     echo python3 benchmarks/gdn_bench.py --out "$OUT/gdn.json" ${GDN_ARGS:-} ;;
    hybrid)  echo python3 benchmarks/hybrid_bench.py --out "$OUT/hybrid.json" ${HYBRID_ARGS:-} ;;
    quant)   echo python3 benchmarks/quant_bench.py --out "$OUT/quant.json" --time-budget-s $((QUANT_S - 60)) \
               ${QUANT_ARGS:-} ;;
    moe)     echo python3 benchmarks/moe_bench.py --out "$OUT/moe.json" --time-budget-s $((MOE_S - 60)) ${MOE_ARGS:-} ;;
    serve)   echo python3 benchmarks/serve_bench.py --offline --out "$OUT/serve.json" ${SERVE_ARGS:-} ;;
    cpu)     if default_model_built; then model=(); else model=(--model benchmarks/configs/smollm2-135m); fi
             echo env CUDA_VISIBLE_DEVICES= python3 benchmarks/cpu_bench.py "${model[@]}" --out "$OUT/cpu.json" \
               ${CPU_ARGS:-} ;;
    profile) echo python3 benchmarks/e2e_bench.py --profile --models qwen3-0.6b --profile-steps 10 \
               --out "$OUT/profile.json" ${PROFILE_ARGS:-} ;;
    parity)  echo python3 benchmarks/parity_bench.py --out "$OUT/parity.json" --time-budget-s $((PARITY_S - 30)) \
               ${PARITY_ARGS:-} ;;
  esac
}

budget_of() {
  case $1 in
    kernels) echo "$KERNELS_S" ;; e2e) echo "$E2E_S" ;; gdn) echo "$GDN_S" ;; quant) echo "$QUANT_S" ;;
    hybrid) echo "$HYBRID_S" ;; moe) echo "$MOE_S" ;;
    serve) echo "$SERVE_S" ;; cpu) echo "$CPU_S" ;; profile) echo "$PROFILE_S" ;; parity) echo "$PARITY_S" ;;
  esac
}

gpu=$(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader 2>/dev/null | head -1)
commit=${KVSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "[gpu.sh] ${gpu:-no GPU} | commit $commit | suites ${suites[*]} | OUT $OUT" | tee "$OUT/gpu.txt"

failed=0
for fam in "${suites[@]}"; do
  budget=$(budget_of "$fam")
  cmd=$(family_command "$fam")
  echo "$cmd" > "$OUT/$fam.log"
  t0=$SECONDS
  # shellcheck disable=SC2086  # the command line is split on spaces on purpose
  timeout -k 20 "$budget" $cmd >> "$OUT/$fam.log" 2>&1
  rc=$?
  line=$(grep '^summary:' "$OUT/$fam.log" | tail -1)
  note=""
  [ "$rc" = 124 ] && note=" (stopped at its ${budget} s budget)"
  echo "[gpu.sh] $fam: rc $rc, $((SECONDS - t0)) s$note: ${line#summary: }"
  if [ "$rc" != 0 ]; then
    failed=1
    grep -vE "INFO|WARNING|Warning" "$OUT/$fam.log" | tail -6 | sed 's/^/    /'
  fi
done
exit $failed
