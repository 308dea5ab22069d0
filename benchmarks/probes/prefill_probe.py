"""Prefill tile probe (2026-12-06 sixth session): one sequence, no context, bf16 / fp8q pages, tiles x heavy_first,
FlashAttention-2 (SDPA pinned) beside; do_bench median (L2 flushed), as kernel_bench's prefill table."""
import json, sys, time
import torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import kernel_bench as kb
from kvserve.kernels import reference as r, triton_attention as ta
from torch.nn.attention import SDPBackend, sdpa_kernel
out_path = sys.argv[1]; budget = float(sys.argv[2]) if len(sys.argv) > 2 else 150
t0 = time.time(); dev = torch.device("cuda"); timer = kb.Timer(True, 10, 40, False); bs = 16
T128 = [None, (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (64, 128, 4, 2),
        (128, 128, 8, 2), (32, 64, 4, 2), (64, 64, 8, 2)]
T256 = [None, (64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2), (128, 64, 8, 3)]
rows = []
for hq, hk, d, T in ((32, 8, 128, 1024), (32, 8, 128, 4096), (24, 4, 256, 4096), (32, 8, 128, 2048), (24, 4, 256, 1024)):
    nblk = T // bs
    q = torch.randn(T, hq, d, dtype=torch.bfloat16, device=dev)
    k = torch.randn(T, hk, d, dtype=torch.bfloat16, device=dev); v = torch.randn_like(k)
    kvb = torch.zeros((nblk + 2, 2, bs, hk, d), dtype=torch.bfloat16, device=dev)
    kv8 = torch.zeros((nblk + 2, 2, bs, hk, d), dtype=torch.uint8, device=dev)
    bt = torch.randperm(nblk + 2, device=dev)[:nblk].to(torch.int32).view(1, nblk)
    pos = torch.arange(T, device=dev); slots = bt[0, pos // bs].long() * bs + pos % bs
    quant = r.CacheQuant(torch.float8_e4m3fn, 448.0, 0.05, 0.04, dev, query_fp8=True)
    r.store_kv(k, v, kvb, slots, None); r.store_kv(k, v, kv8, slots, quant)
    qsl = torch.tensor([0, T], dtype=torch.int32, device=dev); sl = torch.tensor([T], dtype=torch.int32, device=dev)
    out = torch.empty_like(q); flops = 2 * 2 * T * T / 2 * hq * d
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
    kx, vx = ks.repeat_interleave(hq // hk, dim=1), vs.repeat_interleave(hq // hk, dim=1)
    def fa2():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qs, kx, vx, is_causal=True, scale=d ** -0.5)
    ref = fa2()[0].transpose(0, 1).float()
    t = timer.time(fa2); rows.append(dict(h=d, T=T, read="fa2", ms=t["ms"], tflops=flops / t["ms"] / 1e9))
    print(f"h{d} T{T} fa2 {t['ms']*1e3:8.1f} us {flops / t['ms'] / 1e9:6.1f} TF/s", flush=True)
    for read in (("bf16",) if d == 128 else ("fp8q", "bf16")):
        for tiles in (T128 if d == 128 else T256):
            for hf in (True, False):
                if time.time() - t0 > budget:
                    break
                if not hf and tiles is not None and tiles not in ((128, 64, 8, 2), (64, 32, 4, 2)):
                    continue
                try:
                    pool, qu = (kvb, None) if read == "bf16" else (kv8, quant)
                    fn = lambda: ta.paged_attention(q, pool, bt, qsl, sl, d ** -0.5, T, T, qu, out=out, tiles=tiles, heavy_first=hf)
                    out.fill_(float("nan")); fn(); torch.cuda.synchronize()
                    err = float((out.float() - ref).abs().max())
                    t = timer.time(fn)
                    rows.append(dict(h=d, T=T, read=read, tiles=tiles, heavy_first=hf, ms=t["ms"], tflops=flops / t["ms"] / 1e9, err=err))
                    print(f"h{d} T{T} {read:5s} {str(tiles):18s} hf{int(hf)} {t['ms']*1e3:8.1f} us {flops / t['ms'] / 1e9:6.1f} TF/s err {err:.1e}", flush=True)
                except Exception as e:
                    print(f"h{d} T{T} {read} {tiles} ERROR {type(e).__name__}: {str(e)[:160]}", flush=True)
json.dump({"rows": rows, "gpu": torch.cuda.get_device_name()}, open(out_path, "w"), indent=1)
print("done", time.time() - t0)
