"""Probe (H200): fp8 decode attention with the V half of each page laid out [Hk, D, PAGE] (tokens
contiguous, so the P @ V operand is K-major and reaches the MMA by ldmatrix instead of byte loads)
against the production kernel, same data (the V half transposed in a copy of the cache), several
tiles. ``--ncu`` runs one launch of each for Nsight Compute.

    python3 benchmarks/probes/fp8_v_layout_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import importlib.util
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
from kvserve.kernels import triton_attention as cur  # noqa: E402

spec = importlib.util.spec_from_file_location("vt_attention", Path(__file__).with_name("vt_attention.py"))
vt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vt)

SHAPES = [(32, 8, 32, 4096), (32, 8, 256, 4096), (16, 8, 256, 1024), (16, 8, 256, 2048), (16, 8, 64, 1024)]


def transposed_v(cache: torch.Tensor) -> torch.Tensor:
    nb, _, bs, hk, d = cache.shape
    c2 = cache.clone()
    c2[:, 1] = cache[:, 1].permute(0, 2, 3, 1).contiguous().view(nb, bs, hk, d)
    return c2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--ncu", action="store_true", help="one launch per kernel on the Qwen shape, no timing")
    ap.add_argument("--tiles", default="16,64,4,3;16,128,4,3;16,128,8,2;16,256,8,2")
    a = ap.parse_args()
    forced = [None] + [tuple(int(v) for v in t.split(",")) for t in a.tiles.split(";") if t]
    if a.ncu:
        q, cache, tables, qsl, seq, quant, _ = setup(256, 1024, True, hq=16, hk=8)
        c2 = transposed_v(cache)
        for _ in range(2):
            cur.paged_attention(q, cache, tables, qsl, seq, 128**-0.5, 1, 1024, quant)
            vt.paged_attention(q, c2, tables, qsl, seq, 128**-0.5, 1, 1024, quant, v_words=True)
        torch.cuda.synchronize()
        return
    bw = copy_bw()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    rows = []
    for hq, hk, batch, ctx in SHAPES:
        d = 128
        q, cache, tables, qsl, seq, quant, kv_bytes = setup(batch, ctx, True, hq=hq, hk=hk, d=d)
        c2 = transposed_v(cache)
        nc = min(2, batch)
        ref = R.paged_attention(q[:nc], cache, tables[:nc].long(), [1] * nc, [ctx] * nc, d**-0.5, quant=quant).float()
        cands = [("current", cur.paged_attention, cache, None, {})]
        cands += [(f"v_t tiles={t}", vt.paged_attention, c2, t, {"v_words": True}) for t in forced]
        for name, fn, c, tiles, kw in cands:
            try:
                out = fn(q[:nc], c, tables[:nc], qsl[: nc + 1], seq[:nc], d**-0.5, 1, ctx, quant, tiles=tiles, **kw).float()
                err = float((out - ref).norm() / ref.norm())
                f = lambda: fn(q, c, tables, qsl, seq, d**-0.5, 1, ctx, quant, tiles=tiles, **kw)  # noqa: E731
                us = 1e3 * triton.testing.do_bench(f, warmup=20, rep=100, return_mode="median")
            except Exception as e:  # noqa: BLE001
                print(f"{name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            pct = 100 * kv_bytes / us / 1e3 / bw
            rows.append(dict(hq=hq, hk=hk, batch=batch, ctx=ctx, kernel=name, us=us, pct_copy=pct, err=err))
            print(f"h{hq}/{hk} b={batch:3d} ctx={ctx:5d} fp8 {name:32s} {us:8.1f} us {pct:5.1f}% err={err:.1e}", flush=True)
        del cache, c2, q, tables
        torch.cuda.empty_cache()
    if a.out:
        json.dump({"copy_GBps": bw, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
