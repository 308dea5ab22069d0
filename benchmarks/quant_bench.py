#!/usr/bin/env python
"""Quantized-weight GEMMs on one GPU (the quant family of the suite, issue 15): kvserve's W4A16 NVFP4
GEMM (``kernels/triton_w4a16.py``) against torch's bf16 GEMM (cuBLAS) on the Qwen3.6-27B MLP shapes
(gate or up 17408 x 5120, the fused gate | up 34816 x 5120, down 5120 x 17408) at batch 1-256 and
prefill chunks of 1024 and 4096 rows; from 128 rows both of ``w4a16_matmul``'s paths are timed (the
fused kernel, and the weight dequantized for cuBLAS), which is what ``DENSE_FROM_M`` is set from.
First the 27B's FP8 layers (``FP8Linear``, W8A8 per tensor) against the bf16 GEMM, with the
fp8 GEMM's error over the sum of |products| (the accumulation it keeps).

Random bf16 weights quantized by the reference codec (``quant/nvfp4.py``); every point's output is
checked against x @ dequantize_nvfp4(W)^T (max |error| / max |reference|). Times are GPU times
of CUDA-graph replays (``_time_ms``) over weight copies that together pass 3x the L2, for both
engines; eager ``do_bench`` times of these ~40 us kernels carried the host's launch cost (the same
launch measured 45 or 100 us from one call to the next on the H200, 2026-12-01). ``--sweep``
also times a grid of launch tiles per point and records every one (the tuning
run behind ``default_tiles``); without it only the default tiles run.

    python3 benchmarks/quant_bench.py --out q.json               # H200 (bash benchmarks/gpu.sh quant)
    python3 benchmarks/quant_bench.py --smoke --out /tmp/q.json  # CPU, Triton interpreter: tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # before any kvserve.kernels.triton_* import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from kvserve.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on the GPU; the CPU smoke run takes fp32 (the interpreter's bf16 tl.dot is wrong, see tests/triton_support.py)
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
SHAPES = {"gate_or_up": (17408, 5120), "gate_up_fused": (34816, 5120), "down": (5120, 17408)}  # (N, K)
# the 27B's FP8 layers (MIXED_PRECISION): GDN in_proj q|k|v|z, GDN out_proj (= attention o_proj's shape)
FP8_SHAPES = {"gdn_in_qkvz": (16384, 5120), "gdn_out": (5120, 6144)}
FP8_BATCHES = [1, 32, 256, 4096]
BATCHES = [1, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]  # decode batches, then prefill chunks
# the Qwen3.6-35B-A3B's routed experts (hybrid-gdn-models.md 1.9): 256 SwiGLU experts 2048 -> 512, 8 a token
MOE = {"experts": 256, "hidden": 2048, "intermediate": 512, "top_k": 8}
MOE_TOKENS = [1, 32, 256, 1024]


def _time_ms(fns: list) -> float:
    """GPU milliseconds of one call, ``fns`` being the same call over rotating weight copies (together
    over 3x the L2, so every call reads its weight from DRAM): on CUDA the median over 5 replays of
    a CUDA graph of >= 20 calls (launched as the engine's decode graphs launch them; timing eager
    calls would add the host's launch cost, which at ~40 us is the size of these kernels)."""
    if DEV != "cuda":
        fns[0]()
        t = time.perf_counter()
        fns[0]()
        return (time.perf_counter() - t) * 1e3
    for fn in fns:  # compiles, occupancy lookups and buffers outside the capture
        fn()
    torch.cuda.synchronize()
    calls = -(-20 // len(fns)) * len(fns)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[2]


def _copies(nbytes: int) -> int:
    """Weight copies to rotate through so that their bytes pass 3x the L2 (1 on the CPU)."""
    if DEV != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(DEV), "L2_cache_size", 50 << 20)
    return max(2, -(-3 * l2 // nbytes))


def sweep_tiles(m: int) -> list:
    """The tiles a sweep tries at batch ``m``, fewest compiles first (``programs_per_sm`` is a launch
    argument, no extra compile: None = one wave at the compiled kernel's occupancy, 0 = one program
    a tile; ``maxnreg`` 128 lets 4 programs of 4 warps share an SM; first the tiles with a chunk as
    one K = 64 dot, ``one_dot``). ``pdl`` tiles overlap each call with the one before (programmatic
    dependent launch): between back-to-back calls of this kernel that is the most they can overlap;
    after the engine's other kernels (not launched with it) less. The default with the weights'
    other eviction policies follows, then the ``mma_overlap`` tiles."""
    from kvserve.kernels import gluon_w4a16 as g
    from kvserve.kernels.triton_w4a16 import W4A16Tiles

    T = g.GluonTiles
    on_sm90 = g.wgmma_available(torch.device(DEV))
    first = []  # the default tiles without and (sm_90) with programmatic dependent launch
    if m <= g.max_rows(torch.device(DEV), torch.bfloat16):  # (the dtype of the GPU runs)
        d = g.default_tiles(m, on_sm90)
        first = [dataclasses.replace(d, pdl=False)] + ([dataclasses.replace(d, pdl=True)] if on_sm90 else [])
        # then the default with the weights' other eviction policies
        first += [dataclasses.replace(d, w_eviction_policy=p) for p in ("", "evict_first", "evict_last")
                  if p != d.w_eviction_policy]
    wgmma = []  # the warpgroup-MMA path (sm_90), x also gathered into MMA order by the kernel up to 64 rows
    if m > 8 and on_sm90:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
        gathers = (True, False) if bm <= 64 else (False,)
        wgmma = ([T(64, bm, 4, None, pf, False, sp, wgmma=True, x_stages=st, x_gather=ga) for ga in gathers
                  for pf in (1, 2) for st in (3, 4) for sp in (None, 0)]
                 + [T(128, bm, 8, None, pf, False, sp, wgmma=True, x_stages=3) for pf in (1, 2) for sp in (None, 0)]
                 + [T(64, bm, 4, None, 1, False, 1, wgmma=True, x_stages=3)])
        overlap = [dataclasses.replace(t, mma_overlap=True, x_stages=st) for t in (T(128, bm, 8, None, 2, wgmma=True),
                   T(64, bm, 4, None, 2, wgmma=True)) for st in (3, 4) if bm >= 4 * t.num_warps]  # (first)
        wgmma = [t for t in overlap + wgmma if t not in first]
    if m <= g.MAX_M and g.available(torch.device(DEV)):  # the Gluon kernel's grid: stream-K, then split-K
        bm = 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64
        grid = [T(bn, bm, w, None, pf, xs, s, x_stages=pf + 1) for bn, w in ((64, 4), (16, 1), (32, 2), (128, 4))
                for pf in (1, 2, 3) for xs in (True, False) for s in (None, 0) if not (xs and 2 * w > bm)]
        return first + wgmma + [t for t in grid if t not in first]
    gluon = []  # x through shared memory lets the Gluon kernel take 64-row batch tiles without spilling
    if m <= 128 and g.available(torch.device(DEV)):
        gluon = [g.GluonTiles(64, 64, 2, None, 2, True), g.GluonTiles(128, 64, 4, None, 2, True),
                 g.GluonTiles(64, 64, 4, None, 2, True)]
    gluon = first + wgmma + gluon
    bm = next(b for b in (16, 32, 64, 128) if m <= b or b == 128)
    one = [W4A16Tiles(128, bm, ch, 4 if bm <= 64 else 8, st, one_dot=True) for ch in (1, 2) for st in (3, 4)]
    one = gluon + one
    if m <= 16:
        return one + ([W4A16Tiles(bn, 16, ch, 4, st, None, 0, reg) for reg in (None, 128) for bn in (128, 64)
                       for ch in (2, 1, 4) for st in (3, 4)]
                      + [W4A16Tiles(128, 16, 2, 4, 3, 0), W4A16Tiles(256, 16, 2, 8, 3), W4A16Tiles(128, 16, 2, 8, 3)])
    if m <= 64:
        return one + [W4A16Tiles(128, bm, ch, w, 3, None, 0, reg) for bm in (64, 32) for ch in (2, 1)
                      for w, reg in ((4, None), (4, 128), (8, None))]
    return one + ([W4A16Tiles(bn, bm, ch, 8, 3) for bm, bn in ((128, 128), (64, 128), (64, 256)) for ch in (1, 2)]
                  + [W4A16Tiles(64, 256, 1, 4, 3), W4A16Tiles(128, 256, 1, 8, 3)])


def bench(shapes: dict, batches: list[int], sweep: int, budget_s: float, doc: dict, save) -> None:
    """Time every (shape, batch) point; ``sweep`` > 0 also tries up to that many of ``sweep_tiles``."""
    from kvserve.kernels import gluon_w4a16 as g
    from kvserve.kernels.triton_w4a16 import default_tiles, pack_w4a16, use_dense_path, w4a16_matmul

    t_end = time.perf_counter() + budget_s
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, generator=gen) * 0.02).to(DTYPE)
        packed, block_scale, s2 = (t.to(DEV) for t in quantize_nvfp4(w))
        wd = dequantize_nvfp4(packed, block_scale, s2, DTYPE)
        wq = pack_w4a16(packed, block_scale, s2)  # the kernel layout, once (as NVFP4Linear.finalize)
        q_bytes = sum(t.numel() * t.element_size() for t in (wq.codes, wq.scales, wq.row_scale))
        wds = [wd] + [wd.clone() for _ in range(_copies(wd.numel() * wd.element_size()) - 1)]
        wqs = [wq] + [pack_w4a16(packed, block_scale, s2) for _ in range(_copies(q_bytes) - 1)]
        for m in batches:
            if time.perf_counter() > t_end:
                doc["cut_short"] = True
                return
            x = torch.randn(m, k, generator=gen).to(DTYPE).to(DEV)
            want = F.linear(x, wd)
            y = torch.empty(m, n, dtype=DTYPE, device=DEV)
            dense_ms = _time_ms([lambda c=c: torch.matmul(x, c.t(), out=y) for c in wds])

            def call(c, out=None, tiles=None, path=None):
                if isinstance(tiles, g.GluonTiles):
                    return g.w4a16_mma_matmul(x, c, out if out is not None else torch.empty_like(y), tiles)
                if tiles is None and path is None:  # what NVFP4Linear runs
                    return g.w4a16_linear(x, c, out=out)
                return w4a16_matmul(x, c, out=out, tiles=tiles, dense=path)

            def run(tiles=None, path=None):
                out = call(wq, tiles=tiles, path=path)
                err = float((out.float() - want.float()).abs().max() / want.float().abs().max())
                return _time_ms([lambda c=c: call(c, y, tiles, path) for c in wqs]), err

            ms, err = run()
            gluon = m <= g.max_rows(x.device, x.dtype)
            row = {"shape": name, "n": n, "k": k, "m": m, "dense_ms": dense_ms, "w4a16_ms": ms,
                   "speedup": dense_ms / ms, "rel_err": err,
                   "tiles": vars(g.default_tiles(m, g.wgmma_available(x.device)) if gluon else default_tiles(m, n, k)),
                   "path": "gluon" if gluon else "dequantize + cuBLAS" if use_dense_path(m, n, k) else "fused",
                   "weight_copies": [len(wds), len(wqs)]}
            if gluon and m < 128:  # the Triton kernel beside it (from 128 rows: fused_ms)
                row["triton_ms"] = run(path=False)[0]
            if m >= 128:  # both paths of w4a16_matmul where the choice is made
                row["fused_ms"] = run(path=False)[0]
                row["dequant_cublas_ms"] = run(path=True)[0]
            if sweep and m <= 256:  # (larger batches: the two paths above)
                tried = []
                for t in sweep_tiles(m)[:sweep]:
                    if time.perf_counter() > t_end:
                        doc["cut_short"] = True
                        break
                    try:
                        t_ms, t_err = run(t)
                        tried.append({"tiles": vars(t), "ms": t_ms, "rel_err": t_err})
                    except Exception as e:  # noqa: BLE001 (out of shared memory / registers: recorded)
                        tried.append({"tiles": vars(t), "error": f"{type(e).__name__}: {str(e)[:120]}"})
                ok = [r for r in tried if "ms" in r]
                row["sweep"] = tried
                if ok:
                    best = min(ok, key=lambda r: r["ms"])
                    row.update(best_ms=best["ms"], best_tiles=best["tiles"], best_speedup=dense_ms / best["ms"])
            doc["rows"].append(row)
            print(f"{name:14s} m {m:4d}: bf16 {dense_ms * 1e3:8.1f} us, w4a16 {ms * 1e3:8.1f} us ({dense_ms / ms:.2f}x, "
                  f"{row['path']})" + (f", triton {row['triton_ms'] * 1e3:.1f} us" if "triton_ms" in row else "")
                  + (f", fused {row['fused_ms'] * 1e3:.1f} / dequant+cuBLAS "
                                       f"{row['dequant_cublas_ms'] * 1e3:.1f} us" if "fused_ms" in row else "")
                  + (f", best {row['best_ms'] * 1e3:8.1f} us ({row['best_speedup']:.2f}x) {row['best_tiles']}"
                     if "best_ms" in row else "") + f", rel err {err:.1e}", flush=True)
            save()


def bench_fp8(shapes: dict, batches: list[int], doc: dict, save) -> None:
    """The FP8 layers (``FP8Linear``: the static activation quantiser, then ``torch._scaled_mm``)
    against the bf16 GEMM of their dequantized weights, timed as above; and the GEMM's error against
    float64 of the same fp8 operands, run in fp32 (x and out), over the sum of |products|: what the
    accumulation keeps (fp32 accumulation: <= K 2^-24; fewer accumulator bits show as more)."""
    from kvserve.layers.quant_linear import FP8Linear
    from kvserve.quant.nvfp4 import quantize_fp8_per_tensor, quantize_fp8_static

    gen = torch.Generator().manual_seed(1)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=gen) * 0.02
        wq, s = quantize_fp8_per_tensor(w)
        s_in = torch.tensor(4.0 / 448.0)  # activations within +-4 (randn)

        def layer() -> FP8Linear:
            f = FP8Linear(k, n, False, device=DEV)
            with torch.no_grad():
                f.weight.copy_(wq.to(DEV))
                f.weight_scale.fill_(float(s))
                f.input_scale.fill_(float(s_in))
            f.finalize()
            return f

        layers = [layer() for _ in range(_copies(n * k))]
        wd = (wq.float() * s).to(DTYPE).to(DEV)
        wds = [wd] + [wd.clone() for _ in range(_copies(2 * n * k) - 1)]
        for m in batches:
            x = torch.randn(m, k, generator=gen).to(DTYPE).to(DEV)
            y = torch.empty(m, n, dtype=DTYPE, device=DEV)
            dense_ms = _time_ms([lambda c=c: torch.matmul(x, c.t(), out=y) for c in wds])
            fp8_ms = _time_ms([lambda f=f: f(x) for f in layers])
            x32 = x.float()
            xq = quantize_fp8_static(x32, layers[0].inv_input_scale).cpu().double() * float(layers[0].input_scale)
            w64 = wq.double() * float(s)
            got = layers[0](x32).cpu().double()
            err = float(((got - xq @ w64.T).abs() / (xq.abs() @ w64.abs().T).clamp_min(1e-30)).max())
            row = {"shape": name, "n": n, "k": k, "m": m, "dense_ms": dense_ms, "fp8_ms": fp8_ms,
                   "speedup": dense_ms / fp8_ms, "err_over_abs_sum": err, "fp32_bound": k * 2.0**-24}
            doc["fp8_rows"].append(row)
            print(f"fp8 {name:12s} m {m:4d}: bf16 {dense_ms * 1e3:8.1f} us, FP8Linear {fp8_ms * 1e3:8.1f} us "
                  f"({dense_ms / fp8_ms:.2f}x); fp32-run error / sum|products| {err:.2e} "
                  f"(fp32 bound {k * 2.0**-24:.1e})",
                  flush=True)
            save()


def bench_moe(cfg: dict, tokens: list[int], doc: dict, save) -> None:
    """Routed experts on NVFP4 weights (``NVFP4Experts``, dummy-loaded: ``moe_align`` on the device, the
    grouped W4A16 GEMMs for gate | up and down) against the same experts dequantized to bf16 in the
    dense ``Experts`` (one GEMM pair an expert, counts read on the host), on random top-k routing.
    Timed: the two grouped GEMMs alone (CUDA graph, as ``_time_ms``), the whole NVFP4 forward and the
    dense forward (eager: the dense loop cannot be captured), and the floor: the bytes of the experts
    the batch routes to (codes, block and row scales) over the copy bandwidth measured here."""
    from kvserve.bench.throughput import measure_copy_bandwidth
    from kvserve.kernels.triton_w4a16 import w4a16_grouped_matmul
    from kvserve.layers.moe import expert_block_rows, moe_align
    from kvserve.layers.quant_experts import NVFP4Experts
    from kvserve.models.qwen3_next import Experts

    e, h, i, k = cfg["experts"], cfg["hidden"], cfg["intermediate"], cfg["top_k"]
    gen = torch.Generator(device=DEV).manual_seed(3)

    def nvfp4() -> NVFP4Experts:
        q = NVFP4Experts(e, h, i, DEV)
        q.init_dummy(gen)
        return q

    q0 = nvfp4()
    dense = Experts(e, h, i).to(DEV)
    with torch.no_grad():  # the twin: the reference dequantisation (dummy loading gives an expert's rows one s2)
        for name in ("gate_up_proj", "down_proj"):
            s2 = getattr(q0, f"{name}_scale_2")
            assert bool((s2 == s2[:, :1]).all())
            codes, block_scale = getattr(q0, name), getattr(q0, f"{name}_scale")
            getattr(dense, name).data = dequantize_nvfp4(codes, block_scale, s2[:, 0], DTYPE)
    q0.finalize()
    per_expert = sum(t[0].numel() * t.element_size() for n in ("gate_up_proj", "down_proj")
                     for t in (q0.packed[n].codes, q0.packed[n].scales, q0.packed[n].row_scale))  # one expert's bytes
    copies = [q0] + [nvfp4() for _ in range(_copies(per_expert * e) - 1)]
    for q in copies[1:]:
        q.finalize()
    copy_bw = measure_copy_bandwidth(DEV) if DEV == "cuda" else {"GBps": float("nan")}
    gbps = copy_bw["GBps"]  # (eager copies: a graph-captured copy_ is a copy-engine memcpy, 2.7 TB/s on the H200)
    doc["moe_copy_bandwidth"] = copy_bw
    for t in tokens:
        x = (torch.randn(t, h, generator=gen, device=DEV) * 0.5).to(DTYPE)
        logits = torch.randn(t, e, generator=gen, device=DEV)
        top_w, top_idx = torch.softmax(logits, -1).topk(k, dim=-1)
        top_w = top_w.to(DTYPE)
        with torch.no_grad():
            want = dense(x, top_idx, top_w)
            got = q0(x, top_idx, top_w)
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        block_m = expert_block_rows(t * k, e)  # (as NVFP4Experts.forward)
        ids, block_expert = moe_align(top_idx, e, block_m)
        hb = torch.empty(t * k, 2 * i, dtype=DTYPE, device=DEV)
        a = torch.randn(t * k, i, generator=gen, device=DEV).to(DTYPE)
        db = torch.empty(t * k, h, dtype=DTYPE, device=DEV)

        def gemms(q):
            w4a16_grouped_matmul(x, q.packed["gate_up_proj"], ids, block_expert, block_m, k, hb)
            w4a16_grouped_matmul(a, q.packed["down_proj"], ids, block_expert, block_m, 1, db)

        gemm_ms = _time_ms([lambda q=q: gemms(q) for q in copies])

        with torch.no_grad():
            nvfp4_ms = common.median_ms(lambda: q0(x, top_idx, top_w), 5, 1, DEV == "cuda")
            dense_ms = common.median_ms(lambda: dense(x, top_idx, top_w), 5, 1, DEV == "cuda")
        touched = int(top_idx.unique().numel())
        floor_ms = touched * per_expert / gbps / 1e6
        row = {"tokens": t, "experts_touched": touched, "bytes_touched": touched * per_expert,
               "grouped_gemms_ms": gemm_ms, "nvfp4_forward_eager_ms": nvfp4_ms, "bf16_loop_eager_ms": dense_ms,
               "floor_ms": floor_ms, "gemms_over_floor": gemm_ms / floor_ms, "block_m": block_m, "rel_err": err,
               "weight_copies": len(copies)}
        doc["moe_rows"].append(row)
        print(f"moe {t:5d} tokens ({touched} experts): grouped W4A16 GEMMs {gemm_ms * 1e3:8.1f} us "
              f"({gemm_ms / floor_ms:.2f}x the {floor_ms * 1e3:.1f} us floor), NVFP4 forward {nvfp4_ms * 1e3:.1f} us, "
              f"bf16 loop {dense_ms * 1e3:.1f} us (eager), rel err {err:.1e}", flush=True)
        save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--sweep", nargs="?", type=int, const=10**6, default=0, metavar="N",
                    help="also time a grid of launch tiles per point (the first N of it, all without N)")
    ap.add_argument("--fp8-batches", default=",".join(map(str, FP8_BATCHES)),
                    help="the FP8 layers' batches ('' = none)")
    ap.add_argument("--moe-tokens", default=",".join(map(str, MOE_TOKENS)),
                    help="the 35B-A3B routed experts' token counts ('' = none)")
    ap.add_argument("--time-budget-s", type=float, default=240.0, help="stop starting new points after this")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, batch 1, 20 and 256, a short sweep")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    unknown = set(a.shapes.split(",")) - set(SHAPES)
    if unknown:
        ap.error(f"unknown shape(s) {sorted(unknown)}; accepted: {', '.join(SHAPES)}")
    shapes = {s: SHAPES[s] for s in a.shapes.split(",")}
    batches = [int(b) for b in a.batches.split(",") if b]
    fp8_shapes, fp8_batches = FP8_SHAPES, [int(b) for b in a.fp8_batches.split(",") if b]
    moe, moe_tokens = MOE, [int(b) for b in a.moe_tokens.split(",") if b]
    if a.smoke:
        shapes, batches = {"tiny": (96, 128), "tiny_down": (64, 256)}, [1, 20, 256]
        fp8_shapes, fp8_batches = {"tiny_fp8": (48, 64)}, [1, 20]
        moe, moe_tokens = {"experts": 8, "hidden": 64, "intermediate": 32, "top_k": 2}, [1, 5]
    doc = {"run": common.run_info("quant_bench", argv, a.smoke), "benchmark": "W4A16 NVFP4 GEMM vs bf16 GEMM",
           "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "dtype": str(DTYPE), "rows": [],
           "fp8_rows": [], "moe": moe, "moe_rows": []}
    out = a.out or common.default_out("quant")

    def save() -> None:
        common.write_json(out, doc)

    bench_fp8(fp8_shapes, fp8_batches, doc, save)
    bench_moe(moe, moe_tokens, doc, save)
    bench(shapes, batches, 3 if a.smoke else a.sweep, a.time_budget_s, doc, save)
    save()
    parts = [f"{r['shape']} m{r['m']} {r['speedup']:.2f}x" for r in doc["rows"]]
    fp8 = [f"{r['shape']} m{r['m']} {r['speedup']:.2f}x" for r in doc["fp8_rows"]]
    print(f"wrote {out}")
    moe_parts = [f"{r['tokens']} tokens {r['gemms_over_floor']:.2f}x" for r in doc["moe_rows"]]
    print("summary: w4a16 / bf16 GEMM speed " + ", ".join(parts) + "; FP8Linear / bf16 " + ", ".join(fp8)
          + "; grouped W4A16 expert GEMMs / their bytes' floor " + ", ".join(moe_parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
