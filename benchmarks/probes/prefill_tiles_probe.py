"""Probe (H200): the prefill attention kernel's launch tiles, bf16 pages / fp8 pages dequantized / fp8
pages with the quantized query, against torch SDPA, one sequence of T tokens, no cached context.

    python3 benchmarks/prefill_tiles_probe.py --out prefill_tiles.json

Each (shape, T, read) times the default tiles and a grid of (BLOCK_M, TILE_N, warps, stages) with
triton.testing.do_bench (median), checks each against the reference read (the twin for the quantized
query) and writes one JSON. A finding goes to benchmarks/RESULTS.md, the probe to git history.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvserve.kernels import reference, triton_attention  # noqa: E402

SHAPES = {"h256": (24, 4, 256), "h128": (32, 8, 128)}
GRID = {
    "h128": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 2)],
    "h256": [(128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 4, 2)],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--shapes", default="h256,h128")
    ap.add_argument("--reads", default="bf16,fp8,fp8q")
    a = ap.parse_args()
    t_end = time.time() + a.budget_s
    dev = torch.device("cuda")
    rows = []
    for shape in a.shapes.split(","):
        hq, hk, d = SHAPES[shape]
        for T in map(int, a.tokens.split(",")):
            gen = torch.Generator(device=dev).manual_seed(T + d)
            q, k, v = (torch.randn(T, h, d, device=dev, generator=gen, dtype=torch.bfloat16) for h in (hq, hk, hk))
            bs = 16
            nblk = math.ceil(T / bs)
            bt = (torch.randperm(nblk * 2, device=dev)[:nblk] + 1).to(torch.int32).view(1, nblk)
            pos = torch.arange(T, device=dev)
            slots = bt[0, pos // bs].long() * bs + pos % bs
            qsl = torch.tensor([0, T], dtype=torch.int32, device=dev)
            sl = torch.tensor([T], dtype=torch.int32, device=dev)
            scale = d ** -0.5
            qs, ks, vs = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
            flops = 2 * 2 * T * T / 2 * hq * d
            sdpa_ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True))
            rows.append({"shape": shape, "tokens": T, "read": "sdpa", "ms": sdpa_ms, "tflops": flops / sdpa_ms / 1e9})
            print(f"[{shape} T={T}] sdpa {sdpa_ms * 1e3:.1f} us", flush=True)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            kx, vx = (x.repeat_interleave(hq // hk, dim=1) for x in (ks, vs))
            for bn in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
                try:
                    def f(bn=bn):
                        with sdpa_kernel(getattr(SDPBackend, bn)):
                            return torch.nn.functional.scaled_dot_product_attention(qs, kx, vx, is_causal=True, scale=scale)
                    ms = triton.testing.do_bench(f)
                    rows.append({"shape": shape, "tokens": T, "read": "sdpa_" + bn, "ms": ms, "tflops": flops / ms / 1e9})
                    print(f"[{shape} T={T}] sdpa {bn} {ms * 1e3:.1f} us", flush=True)
                except Exception as e:
                    print(f"[{shape} T={T}] sdpa {bn}: {type(e).__name__} {str(e)[:100]}", flush=True)
            for read in (a.reads.split(",") if a.reads else []):
                quant = None
                if read != "bf16":
                    quant = reference.CacheQuant(torch.float8_e4m3fn, 448.0, 0.02, 0.015, dev,
                                                 query_fp8=read.startswith("fp8q"))
                cache = torch.zeros((nblk * 2 + 2, 2, bs, hk, d), device=dev,
                                    dtype=torch.uint8 if quant else torch.bfloat16)
                mag = (0.02 * 50, 0.015 * 50) if quant else (1, 1)  # fp8 pages: ~N(0, 50) codes
                reference.store_kv(k * mag[0], v * mag[1], cache, slots, quant)
                default = triton_attention._tile_config(T, hq // hk, d, True, quant is not None, False, False)[:4]
                for tiles, heavy in [(None, False), (None, True)] + [(t, False) for t in GRID[shape] if t != tuple(default)]:
                    if time.time() > t_end:
                        break
                    name = ("default" + str(tuple(default)) if tiles is None else str(tiles)) + (" heavy" if heavy else "")
                    try:
                        def run(tiles=tiles, heavy=heavy):
                            return triton_attention.paged_attention(q, cache, bt, qsl, sl, scale, T, T, quant=quant,
                                                                    tiles=tiles, pv_fp8=read == "fp8q_pv8",
                                                                    heavy_first=heavy)
                        got = run()
                        if read.startswith("fp8q"):
                            tile_n = (tiles or default)[1]
                            want = reference.paged_attention_fp8_query(q, cache, bt, [T], [T], scale, quant, tile_n)
                        else:
                            want = reference.paged_attention(q, cache, bt, [T], [T], scale, quant=quant)
                        err = float((got.double() - want.double()).norm() / want.double().norm())
                        ms = triton.testing.do_bench(run)
                        rows.append({"shape": shape, "tokens": T, "read": read, "tiles": name, "ms": ms,
                                     "tflops": flops / ms / 1e9, "vs_sdpa": sdpa_ms / ms, "rel_err": err})
                        print(f"[{shape} T={T}] {read:4s} {name:24s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.1f} TF/s"
                              f"  x sdpa {sdpa_ms / ms:.2f}  err {err:.1e}", flush=True)
                    except Exception as e:  # a tile that does not compile or fit
                        rows.append({"shape": shape, "tokens": T, "read": read, "tiles": name,
                                     "error": f"{type(e).__name__}: {str(e)[:300]}"})
                        print(f"[{shape} T={T}] {read} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
