"""Probe (issue 14, H200): (1) why fp8 pages slow the 27B-shaped prefill at c1 / c4: an 8-layer slice
(6 GDN + 2 attention), bf16 and fp8 engines alive side by side, wall time interleaved, and each
kernel's CUDA time bf16 vs fp8; (2) where the decode step goes (graphs on): kernels by CUDA time at
batch 1 and 32. Run from the repository root: python3 benchmarks/probes/fp8_prefill_decode_probe.py"""
import json, os, statistics, sys, tempfile, time
from pathlib import Path
import torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, os.getcwd())
from kvserve import LLM, SamplingParams

src = Path("benchmarks/configs/qwen3.6-27b")
cfg = json.loads((src / "config.json").read_text())
t = cfg.get("text_config", cfg)
t["num_hidden_layers"] = 8
t["layer_types"] = t["layer_types"][:8]
d = Path(tempfile.mkdtemp()) / "slice"; d.mkdir()
(d / "config.json").write_text(json.dumps(cfg))
gen = torch.Generator().manual_seed(0)
P = lambda n, L: [{"prompt_token_ids": torch.randint(10, 1000, (L,), generator=gen).tolist()} for _ in range(n)]
p1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
engines = {kv: LLM(str(d), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", kv_cache_dtype=kv,
                   max_num_seqs=32, max_num_batched_tokens=8192, max_model_len=2048, enable_prefix_caching=False,
                   kv_cache_memory=4 << 30) for kv in ("bfloat16", "fp8")}

def kernels(prof):
    out = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            out[e.key[:70]] = (e.device_time_total, e.count)
    return out

for n in (1, 4):
    prompts = P(n, 1024)
    for llm in engines.values():
        llm.generate(prompts, p1, use_tqdm=False)
    walls = {kv: [] for kv in engines}
    for _ in range(7):
        for kv, llm in engines.items():
            torch.cuda.synchronize(); t0 = time.perf_counter()
            llm.generate(prompts, p1, use_tqdm=False); torch.cuda.synchronize()
            walls[kv].append(time.perf_counter() - t0)
    med = {kv: statistics.median(w) * 1e3 for kv, w in walls.items()}
    print(f"PREFILL {n}x1024 wall ms median of 7 (interleaved): bf16 {med['bfloat16']:.2f} fp8 {med['fp8']:.2f} "
          f"ratio bf16/fp8 {med['bfloat16'] / med['fp8']:.3f}; all: " + json.dumps({k: [round(x * 1e3, 2) for x in v] for k, v in walls.items()}))
    ks = {}
    for kv, llm in engines.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, p1, use_tqdm=False); torch.cuda.synchronize()
        ks[kv] = kernels(prof)
    tot = {kv: sum(v[0] for v in k.values()) for kv, k in ks.items()}
    print(f"  gpu us total bf16 {tot['bfloat16']:.0f} fp8 {tot['fp8']:.0f}")
    names = sorted(set(ks["bfloat16"]) | set(ks["fp8"]), key=lambda k: -max(ks["bfloat16"].get(k, (0, 0))[0], ks["fp8"].get(k, (0, 0))[0]))
    for k in names[:25]:
        b, f = ks["bfloat16"].get(k, (0, 0)), ks["fp8"].get(k, (0, 0))
        print(f"  {k:70s} bf16 {b[0]:9.0f} ({b[1]:4d})  fp8 {f[0]:9.0f} ({f[1]:4d})  diff {f[0] - b[0]:+8.0f}")

# decode with graphs (the engines above have them): kernels of 16 steps at batch 1 and 32
for n in (1, 32):
    for kv, llm in engines.items():
        prompts = P(n, 1024)
        pd = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, detokenize=False)
        llm.generate(prompts, pd, use_tqdm=False)
        torch.cuda.synchronize(); t0 = time.perf_counter(); llm.generate(prompts, p1, use_tqdm=False); torch.cuda.synchronize()
        first = time.perf_counter() - t0
        t0 = time.perf_counter(); llm.generate(prompts, pd, use_tqdm=False); torch.cuda.synchronize()
        full = time.perf_counter() - t0
        print(f"DECODE slice c{n} {kv}: step {(full - first) / 16 * 1e3:.3f} ms wall (graphs {llm.llm_engine.runner.graphs is not None})")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, pd, use_tqdm=False); torch.cuda.synchronize()
        ks = kernels(prof)
        tot = sum(v[0] for v in ks.values())
        print(f"  gpu us total {tot:.0f} (prefill + 16 steps)")
        for k, (us, c) in sorted(ks.items(), key=lambda kv_: -kv_[1][0])[:22]:
            print(f"  {k:70s} {us:9.0f} ({c:5d})")
