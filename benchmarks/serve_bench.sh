#!/usr/bin/env bash
# Serving benchmark: `kvserve serve` on the default model, driven by `kvserve bench serve` with a
# concurrency sweep. Writes the JSON and the PNG chart to OUT_DIR (default benchmarks/results).
#
#   benchmarks/serve_bench.sh [OUT_DIR] [extra kvserve serve flags...]
#   env: INPUT_LEN (128) OUTPUT_LEN (64) NUM_PROMPTS (48) SWEEP (1,4,16) PORT (8011) TAG (cpu)
#        PLOT (1: write the PNG; 0 where matplotlib is missing) KVSERVE (the kvserve command)
set -euo pipefail
OUT_DIR=${1:-benchmarks/results}
shift || true
INPUT_LEN=${INPUT_LEN:-128}; OUTPUT_LEN=${OUTPUT_LEN:-64}; NUM_PROMPTS=${NUM_PROMPTS:-48}
SWEEP=${SWEEP:-1,4,16}; PORT=${PORT:-8011}; TAG=${TAG:-cpu}; PLOT=${PLOT:-1}
KV=${KVSERVE:-python -m kvserve.entrypoints.cli}
mkdir -p "$OUT_DIR"
stamp=$(date -u +%Y-%m-%d)
log="$OUT_DIR/${stamp}_serve_${TAG}_server.log"

$KV serve --port "$PORT" "$@" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null && break
  kill -0 $server 2>/dev/null || { echo "server died:"; tail -20 "$log"; exit 1; }
  sleep 1
done

$KV bench serve --base-url "http://127.0.0.1:$PORT" --dataset random \
  --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" \
  --sweep-concurrency "$SWEEP" $( [ "$PLOT" = 1 ] && echo --plot "$OUT_DIR/${stamp}_serve_${TAG}.png" ) \
  --result-file "$OUT_DIR/${stamp}_serve_${TAG}.json" --disable-tqdm
python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" \
  | grep -E '^vllm:(num_requests_running|kv_cache_usage_perc|generation_tokens_total)' || true
