"""Probe (devcarry, not committed): the paired fp8 decode's tile choices against the default decode,
clean L2 (kernel_bench's Timer), fp8 dequantizing and quantized-query reads; 32/8 heads, head 128."""
import json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from kernel_bench import Timer
from kvserve.kernels import triton_attention as ta
from kvserve.kernels.reference import CacheQuant

dev = torch.device("cuda"); torch.manual_seed(0)
HQ, HK, D, PAGE = 32, 8, 128, 16
SHAPES = [(32, 1024), (64, 1024), (256, 1024), (32, 4096), (256, 4096), (32, 16384)]
TILES = [None, (16, 128, 4, 2, 168), (16, 128, 4, 3, 168), (16, 128, 4, 2, 0), (16, 128, 4, 3, 0),
         (16, 64, 4, 3, 0), (16, 256, 4, 2, 0), (16, 128, 8, 2, 0), (16, 64, 2, 3, 0)]
timer = Timer(True, 25, 100, True)
copy_gbps = None
x = torch.empty(1 << 28, dtype=torch.uint8, device=dev); y = torch.empty_like(x)
t = timer.time(lambda: y.copy_(x)); copy_gbps = 2 * x.numel() / (t["clean_ms"] * 1e-3) / 1e9; del x, y
print(f"copy {copy_gbps:.0f} GB/s", flush=True)
rows = []
for B, C in SHAPES:
    nblk = B * C // PAGE
    pool = torch.randn(nblk, 2, PAGE, HK, D, device=dev).clamp_(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    bt = torch.randperm(nblk, device=dev, dtype=torch.int32).view(B, C // PAGE)
    q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(B + 1, device=dev, dtype=torch.int32); sl = torch.full((B,), C, device=dev, dtype=torch.int32)
    kv_bytes = nblk * 2 * PAGE * HK * D
    for qf in (False, True):
        quant = CacheQuant(torch.float8_e4m3fn, 448.0, 1.0, 1.0, dev, query_fp8=qf, p_shift=8)
        ref = ta.paged_attention(q, pool, bt, qsl, sl, D ** -0.5, 1, C, quant=quant, paired=False)
        for paired in (False, True):
            for tiles in TILES:
                if not paired and tiles is not None:
                    continue
                out = torch.full_like(q, float("nan"))
                try:
                    fn = lambda: ta.paged_attention(q, pool, bt, qsl, sl, D ** -0.5, 1, C, quant=quant, out=out,
                                                    paired=paired, tiles=tiles)
                    fn(); torch.cuda.synchronize()
                    err = float((out.double() - ref.double()).norm() / ref.double().norm())
                    r = timer.time(fn, f"{B}x{C}{qf}{paired}{tiles}")
                    us = (r.get("clean_ms") or r["ms"]) * 1e3
                    pct = kv_bytes / (us * 1e-6) / 1e9 / copy_gbps * 100
                except Exception as e:
                    print(f"{B}x{C} q8={qf} paired={paired} tiles={tiles}: {type(e).__name__} {str(e)[:200]}", flush=True)
                    continue
                rows.append(dict(batch=B, context=C, query_fp8=qf, paired=paired, tiles=tiles, us=us, pct_copy=pct, rel_err_vs_default=err))
                print(f"{B:4d}x{C:6d} q8={int(qf)} paired={int(paired)} tiles={str(tiles):22s} {us:8.1f} us {pct:5.1f}% err {err:.1e}", flush=True)
    del pool
json.dump({"copy_gbps": copy_gbps, "gpu": torch.cuda.get_device_name(), "rows": rows}, open(os.environ.get("OUT", ".") + "/paired_tiles.json", "w"), indent=1)
