"""Probe (to history): per-program globaltimer traces of the Gluon W4A16 kernel at batch 1 (start skew,
loop time, stream-K fix-up, end spread), for the fixed cost and imbalance seen in Nsight Compute."""
import json, os, sys
import torch
sys.path.insert(0, os.path.dirname(__file__))
import gluon_trace as g
from kvserve.kernels.triton_w4a16 import pack_w4a16
from kvserve.quant.nvfp4 import quantize_nvfp4

out = {}
for (n, k) in ((17408, 5120), (2176, 5120), (5120, 17408)):
    w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    wq = pack_w4a16(*(t.cuda() for t in quantize_nvfp4(w)))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    for name, t in (("default", g.GluonTiles(128, 8, 4, prefetch=2)), ("128x8w_p1", g.GluonTiles(128, 8, 8)),
                    ("per_sm1", g.GluonTiles(128, 8, 4, 1, 2)), ("tiles", g.GluonTiles(128, 8, 4, 0, 2))):
        if n != 17408 and name not in ("default", "tiles"):
            continue
        for _ in range(3):
            g.w4a16_mma_matmul(x, wq, y, t)
        torch.cuda.synchronize()
        g.TRACE[0].zero_()
        g.w4a16_mma_matmul(x, wq, y, t)
        torch.cuda.synchronize()
        tr = g.TRACE[0]
        used = int((tr[:, 1] > 0).sum())
        tr = tr[:used].cpu()
        t0 = int(tr[:, 1].min())
        rel = lambda c: ((tr[:, c] - t0).clamp(min=0).float() / 1e3)  # noqa: E731  (us)
        start, end = rel(1), rel(9)
        loop1 = (tr[:, 2] - tr[:, 1]).float() / 1e3
        fix1 = (tr[:, 3] - tr[:, 2]).float() / 1e3
        per_sm = {}
        for i in range(used):
            per_sm.setdefault(int(tr[i, 0]), []).append(i)
        sm_end = torch.tensor([max(end[i] for i in v) for v in per_sm.values()])
        sm_start = torch.tensor([min(start[i] for i in v) for v in per_sm.values()])
        q = lambda v: [round(float(torch.quantile(v, f)), 2) for f in (0, 0.1, 0.5, 0.9, 1)]  # noqa: E731
        row = {"programs": used, "sms": len(per_sm), "ctas_per_sm": q(torch.tensor([float(len(v)) for v in per_sm.values()])),
               "start_us": q(start), "end_us": q(end), "sm_end_us": q(sm_end), "sm_start_us": q(sm_start),
               "first_seg_loop_us": q(loop1), "first_seg_fixup_us": q(fix1), "segments": q(tr[:, 8].float())}
        out[f"{n}x{k} {name}"] = row
        out[f"{n}x{k} {name} raw"] = tr.tolist()
        print(f"{n}x{k} {name}: " + json.dumps(row), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "trace.json"), "w"))
