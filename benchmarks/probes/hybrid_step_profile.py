"""Probe (issue 14, H200): where an 8-layer slice of the 27B shape spends a prefill step (4 x 1024) and
a decode step (batch 32); torch profiler, kernels by CUDA time. EAGER=1: --enforce-eager.
Run from the repository root: python3 benchmarks/probes/hybrid_step_profile.py"""
import json, os, sys, tempfile, time
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
res = {}
eager = os.environ.get("EAGER") == "1"
llm = LLM(str(d), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_num_seqs=32,
          max_num_batched_tokens=8192, max_model_len=2048, enable_prefix_caching=False, enforce_eager=eager)
gen = torch.Generator().manual_seed(0)
P = lambda n, L: [{"prompt_token_ids": torch.randint(10, 1000, (L,), generator=gen).tolist()} for _ in range(n)]
p1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
llm.generate(P(4, 1024), p1, use_tqdm=False)
def top(prof, n=18):
    ev = [e for e in prof.key_averages() if e.device_time_total > 0]
    tot = sum(e.device_time_total for e in ev)
    ev.sort(key=lambda e: -e.device_time_total)
    return tot, [(e.key[:60], round(e.device_time_total), e.count) for e in ev[:n]]
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    t0 = time.perf_counter(); llm.generate(P(4, 1024), p1, use_tqdm=False); torch.cuda.synchronize(); wall = time.perf_counter() - t0
tot, rows = top(prof)
print("PREFILL 4x1024 wall ms %.1f gpu us %d" % (wall * 1e3, tot)); [print("  ", r) for r in rows]
# decode: 32 sequences, 64 steps after a short prompt
pd = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False)
llm.generate(P(32, 128), pd, use_tqdm=False)
torch.cuda.synchronize(); t0 = time.perf_counter(); llm.generate(P(32, 128), pd, use_tqdm=False); torch.cuda.synchronize()
print("DECODE c32 x 64 tokens (+prefill 32x128) wall ms %.1f (eager=%s)" % ((time.perf_counter() - t0) * 1e3, eager))
pd2 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    llm.generate(P(32, 16), pd2, use_tqdm=False); torch.cuda.synchronize()
tot, rows = top(prof)
print("DECODE c32 x 8 (+prefill 32x16) gpu us %d" % tot); [print("  ", r) for r in rows]
