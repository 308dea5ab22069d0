"""Probe (2026-12-04, eighth session; kept in git history only): what x's staging costs the W4A16 kernel at
16-32 rows, an upper bound on any redesign that keeps x resident. The default tiles (x copied by cp.async into
shared memory a pair ahead, one CTA barrier a pair) against the same kernel with the copies and the CTA
barriers compiled out (``--no-x-copy``, in a child process: wrong sums, the same loads, decodes and MMAs;
x read from stale shared memory). Batches 1 and 8 (x from global memory, no staging) are the control.

    python3 benchmarks/x_staging_bound_probe.py --out p.json
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from quant_bench import SHAPES, _copies, _time_ms  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--no-x-copy", action="store_true")
ap.add_argument("--child", action="store_true")
a = ap.parse_args()

if not a.child:
    rows = {}
    for variant in ("default", "no_x_copy"):
        cmd = [sys.executable, __file__, "--child", "--out", a.out + f".{variant}"]
        cmd += ["--no-x-copy"] if variant != "default" else []
        subprocess.run(cmd, check=True)
        rows[variant] = json.load(open(a.out + f".{variant}"))
    doc = {"run": common.run_info("x_staging_bound_probe", sys.argv[1:], False), "rows": []}
    for r0, r1 in zip(rows["default"], rows["no_x_copy"]):
        doc["rows"].append({**r0, "no_x_copy_us": r1["us"], "ratio": r1["us"] / r0["us"]})
        print(f"{r0['shape']:14s} m {r0['m']:3d}: default {r0['us']:6.1f} us, no x copy / barrier {r1['us']:6.1f} us "
              f"({r1['us'] / r0['us']:.3f})", flush=True)
    common.write_json(a.out, doc)
    sys.exit(0)

from kvserve.kernels import gluon_w4a16 as g  # noqa: E402
from kvserve.kernels.triton_w4a16 import pack_w4a16  # noqa: E402
from kvserve.quant.nvfp4 import quantize_nvfp4  # noqa: E402

if a.no_x_copy:
    @g.gluon.jit
    def _no_copy(dst, x_from, k0):
        pass

    @g.gluon.jit
    def _no_barrier():
        pass

    g._copy_x = _no_copy
    g._cta_barrier = _no_barrier
out = []
gen = torch.Generator().manual_seed(0)
for name, (n, k) in SHAPES.items():
    wt = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    packed, block_scale, s2 = (t.cuda() for t in quantize_nvfp4(wt))
    wq = pack_w4a16(packed, block_scale, s2)
    q_bytes = sum(t.numel() * t.element_size() for t in (wq.codes, wq.scales, wq.row_scale))
    wqs = [wq] + [pack_w4a16(packed, block_scale, s2) for _ in range(_copies(q_bytes) - 1)]
    for m in (1, 8, 16, 32):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        us = _time_ms([lambda c=c: g.w4a16_linear(x, c, out=y) for c in wqs]) * 1e3
        out.append({"shape": name, "m": m, "us": us, "tiles": vars(g.default_tiles(m, True))})
json.dump(out, open(a.out, "w"))
