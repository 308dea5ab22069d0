"""Probe (H200): fp8 decode attention tiles x register caps. Nsight Compute showed the default fp8
decode tile (16, 128, 4 warps, 2 stages) at 204 registers per thread: 2 programs (8 warps) per
multiprocessor, 47% of DRAM bandwidth, issue slots 40% busy (latency bound). This sweeps
(BLOCK_M, TILE_N, warps, stages, maxnreg) and prints registers, spills and time per point.

    python3 benchmarks/probes/fp8_occupancy_probe.py --out occ.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from decode_probe import copy_bw, setup  # noqa: E402

from kvserve.kernels import reference as R  # noqa: E402
from kvserve.kernels import triton_attention as ta  # noqa: E402

SHAPES = [(16, 8, 256, 1024), (32, 8, 256, 4096), (32, 8, 32, 4096)]
TILES = ("16,128,4,2;16,128,4,2,168;16,128,4,2,128;16,128,4,3,168;16,64,4,2;16,64,4,3;16,64,4,4;"
         "16,64,4,3,128;16,64,4,4,128;16,64,4,3,96;16,128,8,2;16,128,8,2,128;16,128,8,3,128;16,64,2,3;16,64,2,4;"
         "16,32,2,4;16,128,2,2;16,32,4,4;16,32,4,6,96")

_last = {}
_run = ta._attention_kernel.run


def _capture(*a, **k):
    kern = _run(*a, **k)
    _last["k"] = kern
    return kern


ta._attention_kernel.run = _capture


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiles", default=TILES)
    ap.add_argument("--bf16", action="store_true", help="bf16 pages too (default tiles only)")
    ap.add_argument("--ncu-tiles", default=None, help="only launch these tiles twice each (Qwen shape), for ncu")
    a = ap.parse_args()
    if a.ncu_tiles:
        q, cache, tables, qsl, seq, quant, _ = setup(256, 1024, True, hq=16, hk=8)
        for t in a.ncu_tiles.split(";"):
            tiles = tuple(int(v) for v in t.split(","))
            for _ in range(2):
                ta.paged_attention(q, cache, tables, qsl, seq, 128**-0.5, 1, 1024, quant, tiles=tiles, num_splits=1)
        torch.cuda.synchronize()
        return
    forced = [tuple(int(v) for v in t.split(",")) for t in a.tiles.split(";") if t]
    bw = copy_bw()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    rows = []
    for hq, hk, batch, ctx in SHAPES:
        for fp8 in ((True, False) if a.bf16 else (True,)):
            d = 128
            q, cache, tables, qsl, seq, quant, kv_bytes = setup(batch, ctx, fp8, hq=hq, hk=hk, d=d)
            nc = min(2, batch)
            ref = R.paged_attention(q[:nc], cache, tables[:nc].long(), [1] * nc, [ctx] * nc, d**-0.5, quant=quant).float()
            for tiles in ([None] + forced) if fp8 else [None]:
                try:
                    out = ta.paged_attention(q[:nc], cache, tables[:nc], qsl[: nc + 1], seq[:nc], d**-0.5, 1, ctx, quant,
                                             tiles=tiles, num_splits=1).float()
                    err = float((out - ref).norm() / ref.norm())
                    f = lambda: ta.paged_attention(q, cache, tables, qsl, seq, d**-0.5, 1, ctx, quant, tiles=tiles,  # noqa: E731
                                                   num_splits=1)
                    f()
                    kern = _last.get("k")
                    regs, spills = getattr(kern, "n_regs", -1), getattr(kern, "n_spills", -1)
                    us = 1e3 * triton.testing.do_bench(f, warmup=20, rep=100, return_mode="median")
                except Exception as e:  # noqa: BLE001
                    print(f"{tiles} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                pct = 100 * kv_bytes / us / 1e3 / bw
                name = "default" if tiles is None else str(tiles)
                rows.append(dict(hq=hq, hk=hk, batch=batch, ctx=ctx, fp8=fp8, tiles=name, us=us, pct_copy=pct, err=err,
                                 regs=regs, spills=spills))
                print(f"h{hq}/{hk} b={batch:3d} ctx={ctx:5d} {'fp8 ' if fp8 else 'bf16'} {name:24s} regs {regs:3d} "
                      f"spills {spills:4d} {us:8.1f} us {pct:5.1f}% err={err:.1e}", flush=True)
            del cache, q, tables
            torch.cuda.empty_cache()
    if a.out:
        json.dump({"copy_GBps": bw, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
