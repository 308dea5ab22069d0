"""Probe (2026-12-04, eighth session; kept in git history only): the FP8 layers' GEMM at decode sizes in the
two operand orders cuBLASLt accepts: ``_scaled_mm(xq, W^T)`` (FP8Linear's, y [M, N]) and ``_scaled_mm(W, xq^T)``
(y^T [N, M], transposed back by a copy), on the 27B's FP8 shapes, with quant_bench's CUDA-graph timing over
weight copies past 3x the L2; and whether both orders give the same bits.

    python3 benchmarks/fp8_operand_order_probe.py --out p.json
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from quant_bench import _copies, _time_ms  # noqa: E402

SHAPES = {"gdn_in_qkvz": (16384, 5120), "gdn_out / o_proj": (5120, 6144), "attn_qkv": (14336, 5120)}

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--batches", default="1,8,16,32,64,128")
a = ap.parse_args()
doc = {"run": common.run_info("fp8_operand_order_probe", sys.argv[1:], False), "rows": []}
gen = torch.Generator().manual_seed(0)
one = torch.ones((), device="cuda")
for name, (n, k) in SHAPES.items():
    ws = [(torch.randn(n, k, generator=gen) * 0.5).to(torch.float8_e4m3fn).cuda() for _ in range(_copies(n * k))]
    for m in [int(b) for b in a.batches.split(",")]:
        xq = (torch.randn(m, k, generator=gen) * 0.5).to(torch.float8_e4m3fn).cuda()
        sa, sb = torch.tensor(0.01, device="cuda"), torch.tensor(0.02, device="cuda")

        def xw(w):
            return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

        def wx(w):
            return torch._scaled_mm(w, xq.t(), scale_a=sb, scale_b=sa, out_dtype=torch.bfloat16).t().contiguous()

        def wx_strided(w):
            return torch._scaled_mm(w, xq.t(), scale_a=sb, scale_b=sa, out_dtype=torch.bfloat16)

        row = {"shape": name, "n": n, "k": k, "m": m}
        for label, fn in (("x_wt", xw), ("w_xt_copy", wx), ("w_xt_no_copy", wx_strided)):
            try:
                row[label + "_us"] = _time_ms([lambda w=w: fn(w) for w in ws]) * 1e3
            except RuntimeError as e:
                row[label + "_error"] = str(e)[:200]
        try:
            y1, y2 = xw(ws[0]), wx(ws[0])
            row["same_bits"] = bool(torch.equal(y1, y2))
            row["max_rel_diff"] = float((y1.float() - y2.float()).abs().max() / y1.float().abs().max())
        except RuntimeError as e:
            row["compare_error"] = str(e)[:200]
        row["gbps_x_wt"] = n * k / (row.get("x_wt_us", float("nan")) * 1e3)
        doc["rows"].append(row)
        print({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
        common.write_json(a.out, doc)
    del ws
