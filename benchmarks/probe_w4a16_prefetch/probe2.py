"""Where the Gluon W4A16 kernel's time goes at batch 1: fixed cost vs bytes (N swept at K 5120,
cuBLAS beside it), stream-K waves (programs_per_sm above the occupancy), CUDA-graph timing as quant_bench."""
import json, os, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import quant_bench as qb
from kvserve.kernels import gluon_w4a16 as g
from kvserve.kernels.triton_w4a16 import pack_w4a16
from kvserve.quant.nvfp4 import quantize_nvfp4, dequantize_nvfp4

out = {"n_sweep": [], "waves": []}
k = 5120
for n in (2176, 4352, 8704, 17408, 34816, 69632):
    w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    pk = [t.cuda() for t in quantize_nvfp4(w)]
    wd = dequantize_nvfp4(*pk, torch.bfloat16)
    qbytes = n * k // 2 + n * k // 16
    wqs = [pack_w4a16(*pk) for _ in range(qb._copies(qbytes))]
    wds = [wd] + [wd.clone() for _ in range(qb._copies(wd.numel() * 2) - 1)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    dense = qb._time_ms([lambda c=c: torch.matmul(x, c.t(), out=y) for c in wds])
    row = {"n": n, "q_mb": qbytes / 1e6, "dense_us": dense * 1e3}
    for name, t in (("default", g.GluonTiles(128, 8, 8)), ("64x4p2", g.GluonTiles(64, 8, 4, None, 2))):
        row[name + "_us"] = qb._time_ms([lambda c=c: g.w4a16_mma_matmul(x, c, y, t) for c in wqs]) * 1e3
    for per_sm in (1, 2, 6, 9, 12):
        t = g.GluonTiles(128, 8, 8, per_sm)
        row[f"per_sm{per_sm}_us"] = qb._time_ms([lambda c=c: g.w4a16_mma_matmul(x, c, y, t) for c in wqs]) * 1e3
    t = g.GluonTiles(128, 8, 8, 0)  # one program a tile, no split
    row["tile_programs_us"] = qb._time_ms([lambda c=c: g.w4a16_mma_matmul(x, c, y, t) for c in wqs]) * 1e3
    print(json.dumps(row), flush=True)
    out["n_sweep"].append(row)
    del wqs, wds
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe2.json"), "w"), indent=1)
