"""Probe (issue 14, H200): the full Qwen3.6-27B shape, bf16 and fp8 engines alive side by side
(kv_cache_memory 4 GiB each), c1 x 1024 prefill (one output token): wall times interleaved over
many rounds, then one torch-profiler trace of each (CPU + CUDA) exported for offline analysis.
Run from the repository root: OUT=... python3 benchmarks/probes/fp8_prefill_full_probe.py"""
import gzip, json, os, shutil, statistics, sys, time
from pathlib import Path
import torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, os.getcwd())
from kvserve import LLM, SamplingParams

out = Path(os.environ.get("OUT", "/tmp"))
gen = torch.Generator().manual_seed(0)
P = lambda n, L: [{"prompt_token_ids": torch.randint(10, 1000, (L,), generator=gen).tolist()} for _ in range(n)]
p1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
kvs = os.environ.get("KVS", "bfloat16,fp8").split(",")
engines = {}
for kv in kvs:
    t0 = time.perf_counter()
    engines[kv] = LLM("benchmarks/configs/qwen3.6-27b", load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                      kv_cache_dtype=kv, max_num_seqs=32, max_num_batched_tokens=8192, max_model_len=2048,
                      enable_prefix_caching=False, kv_cache_memory=4 << 30)
    print(f"engine {kv}: {time.perf_counter() - t0:.1f} s, mem {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)
res = {}
for n in (1, 4):
    prompts = P(n, 1024)
    for llm in engines.values():
        for _ in range(2):
            llm.generate(prompts, p1, use_tqdm=False)
    walls = {kv: [] for kv in engines}
    for _ in range(15 if n == 1 else 7):
        for kv, llm in engines.items():
            torch.cuda.synchronize(); t0 = time.perf_counter()
            llm.generate(prompts, p1, use_tqdm=False); torch.cuda.synchronize()
            walls[kv].append(time.perf_counter() - t0)
    med = {kv: statistics.median(w) * 1e3 for kv, w in walls.items()}
    mn = {kv: min(w) * 1e3 for kv, w in walls.items()}
    res[f"c{n}"] = {"median_ms": med, "min_ms": mn, "all_ms": {k: [round(x * 1e3, 2) for x in v] for k, v in walls.items()}}
    print(f"PREFILL {n}x1024 interleaved: median {json.dumps(med)} min {json.dumps(mn)}", flush=True)
    if len(engines) == 2:
        print(f"  fp8/bf16 tok/s median {med['bfloat16'] / med['fp8']:.4f} min {mn['bfloat16'] / mn['fp8']:.4f}", flush=True)
    if n == 1:
        for kv, llm in engines.items():
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    llm.generate(prompts, p1, use_tqdm=False)
                torch.cuda.synchronize()
            tmp = f"/tmp/trace_{kv}.json"
            prof.export_chrome_trace(tmp)
            with open(tmp, "rb") as f, gzip.open(out / f"trace_{kv}.json.gz", "wb") as g:
                shutil.copyfileobj(f, g)
(out / "fp8_prefill_full_probe.json").write_text(json.dumps(res, indent=1))
