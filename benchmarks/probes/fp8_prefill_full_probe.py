"""Probe (issue 14, H200): the full Qwen3.6-27B shape, one engine at a time as hybrid_bench runs
them, c1 / c4 x 1024 prefill (one output token), bf16 vs fp8 KV, three set-ups: the whole free
memory for pages (as the benchmark), 4 GiB of pages, and the whole memory with the startup heap
frozen (gc.freeze, as vLLM's EngineCore). Per timed prefill: wall, Python GC pauses, allocator
cudaMalloc / cudaFree / retries. Run from the repository root: OUT=... python3 <this file>"""
import gc, json, os, statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd())
from kvserve import LLM, SamplingParams

out = Path(os.environ.get("OUT", "/tmp"))
gen = torch.Generator().manual_seed(0)
P = lambda n, L: [{"prompt_token_ids": torch.randint(10, 1000, (L,), generator=gen).tolist()} for _ in range(n)]
p1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
pauses = []
_t = [0.0]
def _cb(phase, info):
    if phase == "start":
        _t[0] = time.perf_counter()
    else:
        pauses.append((info["generation"], time.perf_counter() - _t[0]))
gc.callbacks.append(_cb)
KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free")
res = {}
for setup in os.environ.get("SETUPS", "full,4g,full_frozen").split(","):
    for kv in ("bfloat16", "fp8"):
        t0 = time.perf_counter()
        llm = LLM("benchmarks/configs/qwen3.6-27b", load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  kv_cache_dtype=kv, max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=1041,
                  enable_prefix_caching=False, kv_cache_memory=(4 << 30) if setup == "4g" else None)
        start = time.perf_counter() - t0
        llm.generate(P(1, 1024), p1, use_tqdm=False)
        if setup.endswith("frozen"):
            gc.collect(); gc.freeze()
        row = {"start_s": start, "num_blocks": llm.llm_engine.config.cache_config.num_blocks,
               "gc_tracked": len(gc.get_objects())}
        for n, reps in ((1, 9), (4, 5)):
            prompts = P(n, 1024)
            walls, gcs = [], []
            m0 = torch.cuda.memory_stats()
            for _ in range(reps):
                pauses.clear()
                torch.cuda.synchronize(); t0 = time.perf_counter()
                llm.generate(prompts, p1, use_tqdm=False); torch.cuda.synchronize()
                walls.append(round((time.perf_counter() - t0) * 1e3, 2))
                gcs.append([(g, round(d * 1e3, 2)) for g, d in pauses])
            m1 = torch.cuda.memory_stats()
            row[f"c{n}"] = {"median_ms": statistics.median(walls), "min_ms": min(walls), "all_ms": walls, "gc": gcs,
                            "alloc": {k: m1.get(k, 0) - m0.get(k, 0) for k in KEYS}}
            print(f"{setup:12s} {kv:9s} c{n}: median {statistics.median(walls):7.2f} min {min(walls):7.2f} all {walls} "
                  f"gc {[sum(d for _, d in g) for g in gcs]} alloc {row[f'c{n}']['alloc']}", flush=True)
        res.setdefault(setup, {})[kv] = row
        if setup.endswith("frozen"):
            gc.unfreeze()
        del llm
        gc.collect(); torch.cuda.empty_cache()
    b, f = res[setup]["bfloat16"], res[setup]["fp8"]
    print(f"{setup}: fp8/bf16 tok/s c1 median {b['c1']['median_ms'] / f['c1']['median_ms']:.4f} min "
          f"{b['c1']['min_ms'] / f['c1']['min_ms']:.4f}; c4 median {b['c4']['median_ms'] / f['c4']['median_ms']:.4f}", flush=True)
    (out / "fp8_prefill_full_probe.json").write_text(json.dumps(res, indent=1))
