"""Probe (issue 14, H200): prefill attention tiles on the Qwen3.6 attention shape (24 query / 4 KV heads,
head 256), bf16 vs fp8 pages, sequences of 1024 (x1, x4) and 4096 tokens without context.
Run from the repository root: python3 benchmarks/probes/attn_head256_sweep.py"""
import os, sys
import torch, triton
sys.path.insert(0, os.getcwd())
from kvserve.kernels import reference as ref, triton_attention as ta, triton_store as ts

torch.manual_seed(0)
HQ, HK, D, BS = 24, 4, 256, 16
quant = ref.CacheQuant(torch.float8_e4m3fn, 448.0, 1.0, 1.0, "cuda")
CFGS = [None, (32, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (64, 32, 8, 3),
        (128, 32, 8, 2), (128, 64, 8, 2), (128, 32, 8, 3)]
for nseq, T in ((1, 1024), (4, 1024), (1, 4096)):
    nblk = nseq * T // BS
    bt = torch.randperm(nblk * 2, device="cuda")[:nblk].to(torch.int32).view(nseq, T // BS)
    q = torch.randn(nseq * T, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(nseq * T, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(nseq * T, HK, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(T, device="cuda")
    slots = torch.cat([bt[i, pos // BS].long() * BS + pos % BS for i in range(nseq)])
    qsl = torch.arange(0, nseq + 1, device="cuda", dtype=torch.int32) * T
    sl = torch.full((nseq,), T, device="cuda", dtype=torch.int32)
    for name, qnt, dt in (("bf16", None, torch.bfloat16), ("fp8", quant, torch.uint8)):
        pool = torch.zeros(nblk * 2, 2, BS, HK, D, device="cuda", dtype=dt)
        ts.store_kv(k, v, pool, slots, qnt)
        base = ta.paged_attention(q, pool, bt, qsl, sl, D ** -0.5, T, T, qnt)
        line = []
        for cfg in CFGS:
            try:
                out = torch.full_like(q, float("nan"))
                fn = lambda: ta.paged_attention(q, pool, bt, qsl, sl, D ** -0.5, T, T, qnt, out=out, tiles=cfg)
                fn()
                err = ((out.float() - base.float()).abs().max() / base.float().abs().max()).item()
                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                line.append(f"{str(cfg):18s} {ms * 1e3:8.1f} us err {err:.1e}")
            except Exception as e:  # noqa: BLE001
                line.append(f"{str(cfg):18s} failed {type(e).__name__}: {str(e)[:80]}")
        print(f"{nseq}x{T} {name}:\n  " + "\n  ".join(line), flush=True)
