"""Profiled launches of the Gluon W4A16 kernel (ncu): gate/up shape, batch 1 / 16 / 32, stream-K in one wave and two."""
import sys
import torch
from kvserve.kernels import gluon_w4a16 as g
from kvserve.kernels.triton_w4a16 import pack_w4a16
from kvserve.quant.nvfp4 import quantize_nvfp4

n, k = 17408, 5120
w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
wq = pack_w4a16(*(t.cuda() for t in quantize_nvfp4(w)))
for m, tiles in ((1, g.GluonTiles(128, 8, 8, None, 1)), (1, g.GluonTiles(128, 8, 8, 6, 1)),
                 (16, g.GluonTiles(128, 16, 4, None, 1)), (32, g.GluonTiles(64, 32, 2, None, 2))):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        g.w4a16_mma_matmul(x, wq, y, tiles)
    torch.cuda.synchronize()
    print(m, tiles, file=sys.stderr)
