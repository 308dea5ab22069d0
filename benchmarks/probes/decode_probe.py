"""Decode tiles / splits probe (CUDA-graph timing): fp8 dequantizing vs fp8q vs bf16, 32/8 heads, head 128."""
import sys, math, json, os, time, itertools
from pathlib import Path
import torch, triton
from kvserve.kernels import reference, triton_attention as ta

dev = torch.device("cuda")
hq, hk, d, bs = 32, 8, 128, 16
scale = d ** -0.5
t_end = time.time() + float(os.environ.get("PROBE_S", "150"))
nb = 1 << 17
pools = {"bf16": torch.randn(nb, 2, bs, hk, d, device=dev, dtype=torch.bfloat16),
         "fp8": (torch.randn(nb, 2, bs, hk, d, device=dev) * 50).to(torch.float8_e4m3fn).view(torch.uint8)}
quants = {"bf16": None, "fp8": reference.CacheQuant(torch.float8_e4m3fn, 448.0, 0.02, 0.015, dev),
          "fp8q": reference.CacheQuant(torch.float8_e4m3fn, 448.0, 0.02, 0.015, dev, query_fp8=True)}
def bench(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3
rows = []
points = [(32, 1024), (32, 4096), (64, 1024), (256, 4096), (32, 16384), (32, 512), (64, 4096), (256, 1024)]
for b, ctx in points:
    nblk = math.ceil(ctx / bs)
    bt = torch.randperm(nb, device=dev)[: b * nblk].to(torch.int32).view(b, nblk)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    sl = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    auto = ta.choose_num_splits(b, hk, ctx, dev)
    kvb = b * ctx * hk * d * 2
    for read in ("bf16", "fp8", "fp8q"):
        pool = pools["bf16" if read == "bf16" else "fp8"]
        quant = quants[read]
        splits_set = sorted({auto, 1, 2, 4, 8, 16}) if ctx <= 1024 else sorted({auto, max(1, auto // 2), auto * 2})
        cfg = ta._tile_config(1, 4, 128, True, quant is not None, auto > 1, False)
        tiles_set = [None, (16, 64, 4, 2, 0), (16, 128, 4, 2, 0), (16, 64, 4, 3, 0), (16, 128, 4, 3, 0), (16, 128, 4, 2, 168)]
        for ns, tiles in itertools.product(splits_set, tiles_set):
            if time.time() > t_end:
                break
            if tiles is not None and ns != auto:
                continue  # tiles at the auto split, splits at the default tiles
            for f16 in ([None, False] if read == "fp8q" and tiles is None and ns == auto else [None]):
                try:
                    fn = lambda: ta.paged_attention(q, pool, bt, qsl, sl, scale, 1, ctx, quant=quant, out=out,
                                                    num_splits=ns, tiles=tiles, fp16_mma=f16)
                    us = bench(fn)
                    el = 2 if read == "bf16" else 1
                    r = {"b": b, "ctx": ctx, "read": read, "splits": ns, "auto": auto, "tiles": tiles or list(cfg),
                         "fp8_mma": f16 is False, "us": us, "pct": kvb * el / (us * 1e-6) / 4.27e12 * 100}
                except Exception as e:
                    r = {"b": b, "ctx": ctx, "read": read, "splits": ns, "tiles": tiles, "err": str(e)[:200]}
                rows.append(r)
                print(json.dumps(r), flush=True)
    Path(os.environ["OUT"], "decode_probe.json").write_text(json.dumps(rows, indent=1))
