"""Decode tile probe (fifth 2026-12-06 session): fp8 pages with V transposed, the quantized-query and
the dequantizing reads, ragged short-context batches like the end-to-end workload's, clean-L2 timing."""
import json, math, os, sys, time
import torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import kernel_bench as kb
from kvserve.kernels import reference as r, triton_attention as ta
from kvserve.layers.attention import decode_order
out_path = sys.argv[1]; budget = float(sys.argv[2]) if len(sys.argv) > 2 else 150
t0 = time.time()
dev = torch.device("cuda")
timer = kb.Timer(True, 25, 100, True)
hq, hk, d, bs = 32, 8, 128, 16
g = torch.Generator().manual_seed(1234)
points = [("ragged600", [int(x) for x in torch.randint(100, 1101, (256,), generator=g)]),
          ("ragged1055", [int(x) for x in torch.randint(64, 2111, (256,), generator=g)]),
          ("u256x512", [512] * 256), ("u32x4096", [4096] * 32)]
need = sum(sum(math.ceil(n / bs) for n in lens) for _, lens in points)
pool8 = torch.randint(0, 0x7E, (need + 8, 2, bs, hk, d), dtype=torch.uint8, device=dev)
poolb = torch.randn((need + 8, 2, bs, hk, d), dtype=torch.bfloat16, device=dev)
src = poolb[: need // 2]; dst = torch.empty_like(src)
copy = timer.time(lambda: dst.copy_(src), "copy")
nbytes_copy = 2 * poolb[: need // 2].numel() * 2
copy_bw = nbytes_copy / (copy["clean_ms"] * 1e-3) / 1e9
print(f"copy {copy_bw:.0f} GB/s", flush=True)
CONFIGS = [None, (16, 64, 4, 3, 168)]
rows = []
perm = torch.randperm(need, generator=g).to(torch.int32)
used = 0
for pname, lens in points:
    b = len(lens); mb = max(math.ceil(n / bs) for n in lens)
    bt = torch.zeros(b, mb, dtype=torch.int32)
    for i, n in enumerate(lens):
        m = math.ceil(n / bs); bt[i, :m] = perm[used:used + m]; used += m
    bt = bt.to(dev)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    order = torch.tensor(decode_order(lens), dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, d, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    kv_bytes = sum(lens) * hk * d * 2
    for read in ("fp8q", "bf16"):
        quant = None if read == "bf16" else r.CacheQuant(torch.float8_e4m3fn, 448.0, 0.05, 0.04, dev, query_fp8=read == "fp8q")
        pool = poolb if read == "bf16" else pool8
        base = None
        split = ta.choose_num_splits(b, hk, max(lens), dev) > 1
        for cfg in (CONFIGS if read != "bf16" else [None]) + ([] if split else ["items2", "items3", "items4"]):
            if time.time() - t0 > budget:
                break
            try:
                kw = dict(items_per_sm=int(cfg[-1])) if isinstance(cfg, str) else dict(tiles=cfg, items_per_sm=0)
                fn = lambda: ta.paged_attention(q, pool, bt, qsl, sl, d ** -0.5, 1, max(lens), quant, out=out, order=order, **kw)
                fn(); torch.cuda.synchronize()
                o = out.clone()
                if base is None: base = o
                diff = float((o.float() - base.float()).abs().max())
                t = timer.time(fn, "dec")
                nb = kv_bytes * (2 if read == "bf16" else 1)
                pct = 100 * nb / (t["clean_ms"] * 1e-3) / 1e9 / copy_bw
                rows.append(dict(point=pname, read=read, cfg=cfg, clean_us=t["clean_ms"] * 1e3, pct=pct, maxdiff=diff,
                                 splits=ta.choose_num_splits(b, hk, max(lens), dev)))
                print(f"{pname:11s} {read:5s} {str(cfg):22s} {t['clean_ms']*1e3:8.1f} us {pct:5.1f}% diff {diff:.2e}", flush=True)
            except Exception as e:
                print(f"{pname} {read} {cfg} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
# prefill, one sequence, head 256 (24 / 4 heads) and 128 (32 / 8): tiles for the transposed V pages
for hq2, hk2, d2 in ((24, 4, 256), (32, 8, 128)):
    T = 4096
    nblk = T // bs
    kv8 = torch.randint(0, 0x7E, (nblk + 2, 2, bs, hk2, d2), dtype=torch.uint8, device=dev)
    kvb = torch.randn((nblk + 2, 2, bs, hk2, d2), dtype=torch.bfloat16, device=dev)
    bt = torch.randperm(nblk + 2, device=dev)[:nblk].to(torch.int32).view(1, nblk)
    q = torch.randn(T, hq2, d2, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, T], dtype=torch.int32, device=dev); sl = torch.tensor([T], dtype=torch.int32, device=dev)
    flops = 2 * 2 * T * T / 2 * hq2 * d2
    cfgs = [("bf16", None, None), ("fp8q", None, None), ("fp8q_nhd", None, None)]
    cfgs += [("fp8q", t, None) for t in ((64, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2))]
    cfgs += [("fp8q", None, False)]
    for read, tiles, pv in cfgs:
        if time.time() - t0 > budget + 60:
            break
        try:
            quant = None if read == "bf16" else r.CacheQuant(torch.float8_e4m3fn, 448.0, 0.05, 0.04, dev, query_fp8=True,
                                                            value_t=read == "fp8q")
            pool = kvb if read == "bf16" else kv8
            fn = lambda: ta.paged_attention(q, pool, bt, qsl, sl, d2 ** -0.5, T, T, quant, out=out, tiles=tiles, pv_fp8=pv)
            fn(); torch.cuda.synchronize()
            ok = bool(torch.isfinite(out).all())
            t = timer.time(fn, "prefill")
            rows.append(dict(point=f"prefill h{d2} T{T}", read=read, cfg=tiles, pv_fp8=pv, ms=t["ms"], tflops=flops / (t["ms"] * 1e-3) / 1e12, finite=ok))
            print(f"prefill h{d2} {read:8s} {str(tiles):18s} pv{pv} {t['ms']*1e3:8.1f} us {flops / (t['ms'] * 1e-3) / 1e12:6.1f} TF/s finite {ok}", flush=True)
        except Exception as e:
            print(f"prefill h{d2} {read} {tiles} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
json.dump({"copy_GBps": copy_bw, "rows": rows, "gpu": torch.cuda.get_device_name()}, open(out_path, "w"), indent=1)
print("done", time.time() - t0)
