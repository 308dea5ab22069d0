"""Quick GPU probe of the Triton decode attention: copy bandwidth, then bf16 vs fp8 decode at a few
shapes and tile configurations (BLOCK_M, TILE_N, warps, stages, splits), with a correctness check.

    python3 benchmarks/decode_probe.py [--out probe.json]
Used to pick the kernel's tile defaults; benchmarks/kernel_bench.py is the full grid."""

from __future__ import annotations

import argparse
import json

import torch
import triton

from kvserve.kernels import reference as R
from kvserve.kernels.triton_attention import choose_num_splits, paged_attention


def copy_bw() -> float:
    x = torch.randn(1 << 29, device="cuda", dtype=torch.float32)  # 2 GiB
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() * 4 / ms / 1e6  # GB/s


def setup(batch: int, ctx: int, fp8: bool, hq=32, hk=8, d=128, bs=16):
    nblk = batch * (ctx // bs)
    cache = torch.empty((nblk, 2, bs, hk, d), dtype=torch.uint8 if fp8 else torch.bfloat16, device="cuda")
    quant = None
    if fp8:
        cache.view(torch.float8_e4m3fn).copy_(torch.randn(cache.shape, device="cuda").to(torch.float8_e4m3fn))
        quant = R.CacheQuant(torch.float8_e4m3fn, 448.0, 0.05, 0.07, "cuda")
    else:
        cache.normal_()
    tables = torch.randperm(nblk, device="cuda", dtype=torch.int32).view(batch, ctx // bs)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    kv_bytes = batch * ctx * hk * d * 2 * cache.element_size()
    return q, cache, tables, qsl, seq, quant, kv_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bw()
    print(f"copy bandwidth {bw:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    rows = []
    variants = [None, (16, 32, 4, 3), (16, 64, 4, 4), (16, 128, 4, 3), (16, 128, 8, 3)]
    for batch, ctx in [(1, 32768), (8, 8192), (32, 4096), (128, 4096), (256, 2048)]:
        for fp8 in (False, True):
            q, cache, tables, qsl, seq, quant, kv_bytes = setup(batch, ctx, fp8)
            # correctness on the first two sequences
            nc = min(2, batch)
            ref = R.paged_attention(q[:nc], cache, tables[:nc].long(), [1] * nc, [ctx] * nc, 128**-0.5, quant=quant)
            out = paged_attention(q[:nc], cache, tables[:nc], qsl[: nc + 1], seq[:nc], 128**-0.5, 1, ctx, quant)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            auto_splits = choose_num_splits(batch, 8, ctx, q.device)
            for tiles in variants:
                for splits in sorted({auto_splits, 1, 2 * auto_splits} if tiles is None else {auto_splits}):
                    fn = lambda: paged_attention(q, cache, tables, qsl, seq, 128**-0.5, 1, ctx, quant,
                                                 num_splits=splits, tiles=tiles)
                    try:
                        ms = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
                    except Exception as e:  # a config that does not compile
                        print("fail", tiles, splits, type(e).__name__, str(e)[:200])
                        continue
                    gbs = (kv_bytes + 2 * q.numel() * 2) / ms / 1e6
                    r = dict(batch=batch, ctx=ctx, fp8=fp8, tiles=tiles, splits=splits, ms=ms, GBps=gbs,
                             pct_copy=100 * gbs / bw, err=err)
                    rows.append(r)
                    print(f"b={batch:3d} ctx={ctx:5d} {'fp8 ' if fp8 else 'bf16'} tiles={tiles} splits={splits:2d} "
                          f"{ms*1e3:8.1f} us {gbs:6.0f} GB/s {100*gbs/bw:5.1f}% err={err:.1e}", flush=True)
            del q, cache, tables
            torch.cuda.empty_cache()
    if args.out:
        json.dump({"copy_GBps": bw, "gpu": torch.cuda.get_device_name(), "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
