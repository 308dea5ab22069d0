"""A/B of the Triton decode attention on the GPU: the kernel of another file (``--baseline``, e.g.
the previous commit's ``kvserve/kernels/triton_attention.py`` copied aside) against the current
one, in one run, on the benchmark shape (32 query / 8 KV heads) and the Qwen3-0.6B shape
(16 / 8 heads, the e2e workload's short contexts), bf16 and fp8 e4m3 pages, each checked against
the reference. Optional ``--tiles`` adds the current kernel with forced (BLOCK_M, TILE_N, warps,
stages).

    python3 benchmarks/attn_ab.py --baseline /tmp/old_attention.py --out ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_probe import copy_bw, setup  # noqa: E402

from kvserve.kernels import reference as R  # noqa: E402
from kvserve.kernels import triton_attention as cur  # noqa: E402

SHAPES = [(32, 8, 32, 4096), (32, 8, 256, 4096), (32, 8, 8, 32768), (16, 8, 256, 512), (16, 8, 256, 1024),
          (16, 8, 256, 2048), (16, 8, 64, 1024)]


def load(path: str):
    spec = importlib.util.spec_from_file_location("baseline_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiles", default="16,64,4,3;16,128,4,2", help="';'-separated forced tiles for the current kernel")
    a = ap.parse_args()
    base = load(a.baseline)
    bw = copy_bw()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    forced = [tuple(int(v) for v in t.split(",")) for t in a.tiles.split(";") if t]
    rows = []
    for hq, hk, batch, ctx in SHAPES:
        for fp8 in (False, True):
            d = 128
            q, cache, tables, qsl, seq, quant, kv_bytes = setup(batch, ctx, fp8, hq=hq, hk=hk, d=d)
            nc = min(2, batch)
            ref = R.paged_attention(q[:nc], cache, tables[:nc].long(), [1] * nc, [ctx] * nc, d**-0.5, quant=quant).float()
            cands = [("baseline", base.paged_attention, None, {}), ("current", cur.paged_attention, None, {})]
            cands += [(f"current tiles={t}", cur.paged_attention, t, {}) for t in forced]
            for name, fn, tiles, kw in cands:
                try:
                    out = fn(q[:nc], cache, tables[:nc], qsl[: nc + 1], seq[:nc], d**-0.5, 1, ctx, quant, tiles=tiles, **kw).float()
                    err = float((out - ref).norm() / ref.norm())
                    f = lambda: fn(q, cache, tables, qsl, seq, d**-0.5, 1, ctx, quant, tiles=tiles, **kw)  # noqa: E731
                    us = 1e3 * triton.testing.do_bench(f, warmup=20, rep=100, return_mode="median")
                except Exception as e:  # noqa: BLE001
                    print(f"{name} failed: {type(e).__name__}: {str(e)[:150]}", flush=True)
                    continue
                pct = 100 * kv_bytes / us / 1e3 / bw
                rows.append(dict(hq=hq, hk=hk, batch=batch, ctx=ctx, cache="fp8_e4m3" if fp8 else "bf16", kernel=name,
                                 us=us, pct_copy=pct, err=err))
                print(f"h{hq}/{hk} b={batch:3d} ctx={ctx:5d} {'fp8 ' if fp8 else 'bf16'} {name:28s} {us:8.1f} us "
                      f"{pct:5.1f}% err={err:.1e}", flush=True)
            del cache, q, tables
            torch.cuda.empty_cache()
    if a.out:
        json.dump({"copy_GBps": bw, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
