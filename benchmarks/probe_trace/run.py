"""PROBE (to git history): per-program %globaltimer traces of the Gluon W4A16 kernel at batch 1 with
the default tiles of cf52d58 (and split 1 / stream-K beside them), for the ~11.7 us of a launch that
does not scale with the bytes (benchmarks/RESULTS.md). Run on the H200 from the repo root:
python3 benchmarks/probe_trace/run.py  (writes $OUT/trace.json; prints one summary line a point)."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gluon_trace as g  # noqa: E402

from kvserve.kernels.triton_w4a16 import pack_w4a16  # noqa: E402
from kvserve.quant.nvfp4 import quantize_nvfp4  # noqa: E402

out = {}
for (n, k) in ((17408, 5120), (34816, 5120), (5120, 17408)):
    w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    wq = pack_w4a16(*(t.cuda() for t in quantize_nvfp4(w)))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    for name, t in (("default", g.default_tiles(1)), ("split1", g.GluonTiles(64, 8, 4, prefetch=3, split=1)),
                    ("stream_k", g.GluonTiles(64, 8, 4, prefetch=3)),
                    ("warp16_split0", g.GluonTiles(16, 8, 1, prefetch=3, split=0))):
        for _ in range(3):
            g.w4a16_mma_matmul(x, wq, y, t)
        torch.cuda.synchronize()
        g.TRACE[0].zero_()
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_ev.record()
        g.w4a16_mma_matmul(x, wq, y, t)
        end_ev.record()
        torch.cuda.synchronize()
        tr = g.TRACE[0]
        used = int((tr[:, 1] > 0).sum())
        tr = tr[:used].cpu()
        t0 = int(tr[:, 1].min())
        rel = lambda c: ((tr[:, c] - t0).clamp(min=0).float() / 1e3)  # noqa: E731  (us)
        start, end, loop_end = rel(1), rel(9), rel(2)
        per_sm = {}
        for i in range(used):
            per_sm.setdefault(int(tr[i, 0]), []).append(i)
        ctas = torch.tensor([float(len(v)) for v in per_sm.values()])
        sm_end = torch.tensor([max(float(end[i]) for i in v) for v in per_sm.values()])
        q = lambda v: [round(float(torch.quantile(v.float(), f)), 2) for f in (0, 0.1, 0.5, 0.9, 1)]  # noqa: E731
        row = {"programs": used, "sms": len(per_sm), "event_us": round(start_ev.elapsed_time(end_ev) * 1e3, 1),
               "ctas_per_sm": q(ctas), "start_us": q(start), "first_loop_end_us": q(loop_end), "end_us": q(end),
               "sm_end_us": q(sm_end), "sm_end_by_ctas": {int(c): q(sm_end[ctas == c]) for c in ctas.unique()},
               "segments": q(tr[:, 8])}
        out[f"{n}x{k} {name}"] = row
        out[f"{n}x{k} {name} raw"] = tr.tolist()
        print(f"{n}x{k} {name}: " + json.dumps(row), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "trace.json"), "w"))
