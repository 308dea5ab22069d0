"""Probe (2026-12-04, seventh session; kept in git history only): launch variants of the FP8 decode GEMM
(kernels/triton_fp8_linear.py) on the 27B's FP8 shapes: weight rows a program, programs an SM (the K
split), pipeline stages, the fp8 MMAs' partial-sum length; each timed as quant_bench times (CUDA-graph
replays over weight copies past 3x the L2) with its error over the sum of |products| (float64).

    OUT=dir python3 benchmarks/fp8_linear_tiles_probe.py 1,8,32,64
"""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import quant_bench as qb  # noqa: E402

from kvserve.kernels import triton_fp8_linear as f  # noqa: E402
from kvserve.kernels.triton_store import num_sms  # noqa: E402

batches = [int(b) for b in sys.argv[1].split(",")]
dev = torch.device("cuda")
sms = num_sms(dev)
doc = {"run": common.run_info("fp8_linear_tiles_probe", sys.argv[1:], False), "rows": []}
gen = torch.Generator().manual_seed(0)
for name, (n, k) in qb.FP8_SHAPES.items():
    w = (torch.randn(n, k, generator=gen) * 120).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = [w.cuda() for _ in range(qb._copies(n * k))]
    s_x = torch.tensor(4.0 / 448.0)
    inv, sx, sw = (1 / s_x).cuda(), s_x.cuda(), torch.tensor(3e-4 / 448).cuda()
    for m in batches:
        x = (torch.randn(m, k, generator=gen) * 1.5).to(torch.bfloat16).cuda()
        v = (x.double() * float(1 / s_x)).clamp(-448, 448).float().to(torch.float8_e4m3fn).double().cpu()
        want = (v @ w.double().T) * (float(s_x) * 3e-4 / 448)
        abs_sum = (v.abs() @ w.double().abs().T) * (float(s_x) * 3e-4 / 448)
        xq = x.float().mul(float(1 / s_x)).clamp(-448, 448).to(torch.float8_e4m3fn)
        old_ms = qb._time_ms([lambda c=c: torch._scaled_mm(xq, c.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)
                              for c in ws])
        variants = [dict()]
        variants += [dict(imprecise=128), dict(imprecise=64)]
        variants += [dict(block_n=64), dict(block_n=256, num_stages=3), dict(num_stages=3), dict(num_stages=5)]
        tiles = -(-n // 128)
        variants += [dict(split=max(1, round(p * sms / tiles))) for p in (1, 3, 4)]
        for var in variants:
            try:
                ms = qb._time_ms([lambda c=c: f.fp8_linear(x, c, inv, sx, sw, **var) for c in ws])
                got = f.fp8_linear(x, ws[0], inv, sx, sw, **var).double().cpu()
                err = float(((got - want).abs() / abs_sum.clamp_min(1e-30)).max())
                row = {"shape": name, "n": n, "k": k, "m": m, "variant": var, "ms": ms, "err_over_abs_sum": err,
                       "scaled_mm_ms_no_quantiser": old_ms}
            except Exception as e:  # noqa: BLE001 (recorded)
                row = {"shape": name, "m": m, "variant": var, "error": f"{type(e).__name__}: {str(e)[:160]}"}
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
json.dump(doc, open(os.environ.get("OUT", "/tmp") + "/fp8_tiles.json", "w"), indent=1)
