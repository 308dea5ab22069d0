import sys; sys.path.insert(0, "."); sys.path.insert(0, "benchmarks"); import torch
import quant_bench as qb
from kvserve.kernels import gluon_w4a16 as G
from kvserve.kernels.triton_w4a16 import pack_w4a16, W4A16Weight
from kvserve.quant.nvfp4 import dequantize_nvfp4
n, k = 17408, 5120
g = torch.Generator(device="cuda").manual_seed(0)
packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
s = (torch.rand((n, k // 16), device="cuda", generator=g) * 2 + 0.25).to(torch.float8_e4m3fn)
s2 = torch.full((1,), 1e-3, device="cuda")
w = pack_w4a16(packed, s, s2); P = k // 128
def pmf(w):
    return W4A16Weight(w.codes.view(n, P, 32).transpose(0, 1).contiguous().transpose(0, 1),
                       w.scales.view(n, P, 8).transpose(0, 1).contiguous().transpose(0, 1), w.row_scale, w.in_features)
pm = pmf(w)
x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
ref = x.double() @ dequantize_nvfp4(packed, s, s2, torch.float32).double().t()
def err(y): return ((y.double() - ref).abs().max() / ref.abs().max()).item()
for t in (G.GluonTiles(64, 8, 4, 2), G.GluonTiles(128, 8, 4, None), G.GluonTiles(64, 8, 4, None)):
    for name, ww in (("pair", pm), ("row", w), ("pair", pm), ("pair", pm)):
        y = torch.full((1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        G.w4a16_mma_matmul(x, ww, y, t); torch.cuda.synchronize()
        print(t.block_n, t.programs_per_sm, name, "err %.3g" % err(y), "locks", int(G.tw._tile_locks(y.device).abs().sum()), flush=True)
ws = [w] + [pack_w4a16(packed, s, s2) for _ in range(3)]
pms = [pmf(v) for v in ws]
y = torch.empty((1, n), device="cuda", dtype=torch.bfloat16)
for t in (G.GluonTiles(64, 8, 4, 2), G.GluonTiles(64, 8, 4, None), G.GluonTiles(128, 8, 4, None)):
    for name, lst in (("row", ws), ("pair", pms)):
        us = qb._time_ms([lambda v=v: G.w4a16_mma_matmul(x, v, y, t) for v in lst]) * 1e3
        G.w4a16_mma_matmul(x, lst[1], y, t); torch.cuda.synchronize()
        print("time", t.block_n, t.programs_per_sm, name, "%.2f us" % us, "err after %.3g" % err(y), flush=True)
