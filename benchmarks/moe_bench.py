#!/usr/bin/env python
"""The routed-experts layer on one GPU (the moe family of the suite, issue 18): the Qwen3.6-35B-A3B's
sparse MoE block (hybrid-gdn-models.md 1.9: 256 SwiGLU experts 2048 -> 512, top-8 with renormalised
weights, a shared expert of width 512 behind a sigmoid gate) in bf16, on random top-k routing from
random logits, at decode batches and prefill chunks (``--tokens``, default 1 to 8192).

Per token count T (k = 8 routed rows a token):

1. The two grouped GEMMs alone (``kernels/triton_moe.grouped_matmul``: gate | up with
   ``rows_per_x = k``, then down, over ``moe_align``'s blocks). Their floor is the bytes of the
   experts the batch routes to (unique experts x the gate | up and down rows, in the run's dtype)
   over the copy bandwidth measured in the same run (``measure_copy_bandwidth``, eager copies);
   ``copy_bw_fraction`` = floor / time (issue 18's decode bar: >= 0.6 at batch 8-64).
2. Their FLOPs, 2 T k (2 I H + H I), over the time, against torch's dense GEMMs of the same total
   shape ([T k, H] x [H, 2I] and [T k, I] x [I, H], cuBLAS), timed the same way:
   ``fraction_of_dense`` (the prefill bar: >= 0.5 at 8192 tokens).
3. The whole ``SparseMoeBlock`` forward on the device path (``Experts.fused``: the router kernel,
   ``moe_align``, the grouped GEMMs with the shared expert as expert E; as a second graph the shared
   expert apart, its GEMMs and the gated add, ``block_device_graph_shared_apart_ms``) as a CUDA graph, and eagerly,
   against the same block on the torch reference path (the loop over experts, which reads counts on
   the host and cannot be captured: eager), outputs compared.
4. The grouped GEMMs' own output (the down GEMM weighting its rows, summed over the top-k) against the
   torch loop of ``Experts`` (``fused = False``) on the same weights and routing.
5. ``moe_align`` alone: its one Triton launch against its torch twin (~10 launches), ``align_ms`` /
   ``align_torch_ms``.

Times 1-3 on CUDA are GPU times of CUDA-graph replays over expert-weight copies that together pass
3x the L2 even at one token (quant_bench's ``_time_ms``); the reference loop's is the median of eager
calls (``common.median_ms``). Errors are max |got - want| / max |want|.

    python3 benchmarks/moe_bench.py --out m.json               # GPU (bash benchmarks/gpu.sh moe)
    python3 benchmarks/moe_bench.py --smoke --out /tmp/m.json  # CPU, Triton interpreter: tiny shapes, fp32

``--sweep [N]`` also times the two GEMMs under the first N launches of ``sweep_grid`` (row block,
column and K tiles, warps, stages; each output checked); ``--write-config DIR`` then writes the
fastest launch per token count as the device's table (``kvserve/kernels/moe_configs``: vLLM's
per-device fused-MoE config files), which the engine's routed experts and point 1 above then take.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

if "--smoke" in sys.argv:  # before any kvserve.kernels.triton_* import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from quant_bench import _copies, _time_ms  # noqa: E402  (CUDA-graph timing over rotated weight copies)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on the GPU; the CPU smoke run takes fp32 (the interpreter's bf16 tl.dot is wrong, see tests/triton_support.py)
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
# the Qwen3.6-35B-A3B's MoE block (hybrid-gdn-models.md 1.9; quant_bench's MOE)
MOE = {"experts": 256, "hidden": 2048, "intermediate": 512, "top_k": 8, "shared_intermediate": 512}
SMOKE_MOE = {"experts": 8, "hidden": 64, "intermediate": 32, "top_k": 2, "shared_intermediate": 32}
TOKENS = [1, 8, 32, 64, 256, 1024, 8192]
SMOKE_TOKENS = [1, 5, 40]
MAX_COPY_BYTES = 10 << 30  # expert-weight copies together at most this (1.6 GB each at the 35B-A3B shape)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _block(cfg: SimpleNamespace, gate_up: torch.Tensor, down: torch.Tensor, small: nn.Module | None, gen):
    """A ``SparseMoeBlock`` on ``DEV`` in ``DTYPE`` whose experts hold ``gate_up`` / ``down`` (no copy):
    built on the meta device (no fp32 expert tensors on the way); the router, the shared expert and its
    gate are ``small``'s, cloned, or random (1 / sqrt(fan-in)) without it."""
    from kvserve.models.qwen3_next import SparseMoeBlock

    with torch.device("meta"):
        blk = SparseMoeBlock(cfg, norm_topk_prob=True)  # Qwen3.5 / 3.6-MoE renormalise
    blk.experts.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
    blk.experts.down_proj = nn.Parameter(down, requires_grad=False)
    for name in ("gate", "shared_expert", "shared_expert_gate"):
        if small is not None:
            setattr(blk, name, copy.deepcopy(getattr(small, name)))
            continue
        mod = getattr(blk, name).to_empty(device=DEV).to(DTYPE)
        for p in mod.parameters():
            p.requires_grad_(False)
            p.copy_((torch.randn(p.shape, generator=gen, device=DEV) / p.shape[-1] ** 0.5).to(DTYPE))
    return blk


def _set_device_path(blk: nn.Module, on: bool) -> None:
    """The device path as the runner sets it for bf16 (every ``fused`` flag; fp32 keeps the shared
    expert's torch SiLU-mul, as ``routed_swiglu`` does) or the torch reference path (none)."""
    blk.experts.fused = on
    blk.shared_expert.fused = on and DTYPE != torch.float32


@torch.no_grad()
def bench(moe: dict, tokens: list[int], budget_s: float, doc: dict, save, sweep: int = 0) -> None:
    """Every token count's row (1-4 of the module docstring) into ``doc["rows"]``, ``save()`` after each;
    no new point after ``budget_s``."""
    from kvserve.bench.throughput import measure_copy_bandwidth

    t_end = time.perf_counter() + budget_s
    e, h, i, k = moe["experts"], moe["hidden"], moe["intermediate"], moe["top_k"]
    cfg = SimpleNamespace(num_experts=e, hidden_size=h, moe_intermediate_size=i, num_experts_per_tok=k,
                          shared_expert_intermediate_size=moe["shared_intermediate"])
    gen = torch.Generator(device=DEV).manual_seed(18)
    itemsize = torch.empty((), dtype=DTYPE).element_size()
    per_expert = 3 * i * h * itemsize  # gate | up [2I, H] + down [H, I] of one expert
    # copies of the expert weights: the fewest bytes a point reads (one token: k experts) x copies > 3x the L2
    n_copies = max(1, min(_copies(k * per_expert), MAX_COPY_BYTES // (e * per_expert)))
    gate_ups = [torch.randn(e, 2 * i, h, generator=gen, device=DEV, dtype=DTYPE).mul_(h ** -0.5)]
    downs = [torch.randn(e, h, i, generator=gen, device=DEV, dtype=DTYPE).mul_(i ** -0.5)]
    gate_ups += [gate_ups[0].clone() for _ in range(n_copies - 1)]
    downs += [downs[0].clone() for _ in range(n_copies - 1)]
    blocks = [_block(cfg, gate_ups[0], downs[0], None, gen)]
    blocks += [_block(cfg, gu, dn, blocks[0], gen) for gu, dn in zip(gate_ups[1:], downs[1:])]
    # the dense GEMMs' weights (one expert's shape), rotated the same way
    wgu = torch.randn(2 * i, h, generator=gen, device=DEV, dtype=DTYPE).mul_(h ** -0.5)
    wdn = torch.randn(h, i, generator=gen, device=DEV, dtype=DTYPE).mul_(i ** -0.5)
    n_dense = _copies(per_expert)
    wgus = [wgu] + [wgu.clone() for _ in range(n_dense - 1)]
    wdns = [wdn] + [wdn.clone() for _ in range(n_dense - 1)]

    # eager copies (a graph-captured copy_ is a copy-engine memcpy: 2.7 TB/s on the H200, RESULTS.md 12-03);
    # the CPU smoke run measures a small buffer so that its fields are numbers
    copy_bw = measure_copy_bandwidth(DEV) if DEV == "cuda" else measure_copy_bandwidth(DEV, nbytes=32 << 20)
    bytes_per_s = copy_bw["bytes_per_s"]
    l2 = getattr(torch.cuda.get_device_properties(DEV), "L2_cache_size", None) if DEV == "cuda" else None
    doc.update(copy_bandwidth=copy_bw, l2_bytes=l2, weight_bytes_per_expert=per_expert, expert_weight_copies=n_copies,
               dense_weight_copies=n_dense)
    save()

    for t in tokens:
        if time.perf_counter() > t_end:
            doc["cut_short"] = True
            print(f"time budget ({budget_s:.0f} s) spent: {t} tokens and after not run", flush=True)
            return
        t0 = time.perf_counter()
        logits = torch.randn(t, e, generator=gen, device=DEV)  # random routing: top-k of softmax(random logits)
        top_w, top_idx = torch.softmax(logits, -1).topk(k, dim=-1)
        top_w = (top_w / top_w.sum(-1, keepdim=True)).to(DTYPE)
        x = torch.randn(t, h, generator=gen, device=DEV, dtype=DTYPE)
        row = {"tokens": t, "routed_rows": t * k, **_gemms(blocks, x, top_idx, top_w, sweep)}
        row["bytes_touched"] = row["experts_touched"] * per_expert
        row["floor_ms"] = row["bytes_touched"] / bytes_per_s * 1e3
        row["dense_ms"] = _dense(t * k, wgus, wdns, gen)
        flops = 2 * t * k * (2 * i * h + h * i)
        gemm_ms, floor_ms, dense_ms = row["grouped_gemms_ms"], row["floor_ms"], row["dense_ms"]
        row.update(gemms_over_floor=gemm_ms / floor_ms, copy_bw_fraction=floor_ms / gemm_ms,
                   gemms_GBps=row["bytes_touched"] / gemm_ms / 1e6, gemm_flops=flops,
                   dense_tflops=flops / dense_ms / 1e9, grouped_tflops=flops / gemm_ms / 1e9,
                   fraction_of_dense=dense_ms / gemm_ms)
        row.update(_block_forward(blocks, torch.randn(t, h, generator=gen, device=DEV, dtype=DTYPE)))
        row["block_reference_over_device_graph"] = row["block_reference_eager_ms"] / row["block_device_graph_ms"]
        row["point_s"] = time.perf_counter() - t0
        if DEV == "cuda":
            row["max_memory_allocated_GB"] = torch.cuda.max_memory_allocated() / 1e9
            torch.cuda.empty_cache()
        doc["rows"].append(row)
        print(f"moe {t:5d} tokens ({row['experts_touched']:3d} experts, {row['bytes_touched'] / 1e6:7.1f} MB): "
              f"grouped GEMMs {gemm_ms * 1e3:8.1f} us = {row['copy_bw_fraction']:.2f} of copy bw "
              f"({floor_ms * 1e3:.1f} us floor), {row['grouped_tflops']:.1f} TFLOP/s = "
              f"{row['fraction_of_dense']:.2f} of dense ({row['dense_tflops']:.1f}, {dense_ms * 1e3:.1f} us); "
              f"block graph {row['block_device_graph_ms'] * 1e3:.1f} us"
              + (f" (shared expert apart {row['block_device_graph_shared_apart_ms'] * 1e3:.1f})"
                 if row["block_device_graph_shared_apart_ms"] else "") + ", eager "
              f"{row['block_device_eager_ms'] * 1e3:.1f} us, torch loop {row['block_reference_eager_ms'] * 1e3:.1f} "
              f"us; align {row['align_ms'] * 1e3:.1f} us (torch {row['align_torch_ms'] * 1e3:.1f}); rel err GEMMs {row['gemms_rel_err']:.1e}, block {row['block_rel_err']:.1e} "
              f"({row['block_routing_mismatch_tokens']} tokens routed apart)", flush=True)
        save()


def _gemms(blocks: list, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, sweep: int = 0) -> dict:
    """1 and 4: the two grouped GEMMs over the blocks' expert weights (rotated), and their output
    (the timed buffers, weighted and summed over the top-k) against the torch loop on copy 0."""
    from kvserve.kernels.moe_configs import config_dtype, tuned_launch
    from kvserve.kernels.triton_moe import grouped_matmul
    from kvserve.layers.moe import expert_block_rows, moe_align

    experts = [b.experts for b in blocks]
    e, i = experts[0].num_experts, experts[0].intermediate
    t, h = x.shape
    k = top_idx.shape[1]
    launch = tuned_launch(e, i, t, x.device, config_dtype(DTYPE))  # (as Experts.forward: the device's table)
    block_m = launch.block_m if launch else expert_block_rows(t * k, e)  # (as routed_swiglu)
    tiles = launch.tiles if launch else None
    ids, block_expert = moe_align(top_idx, e, block_m)
    hb = torch.empty(t * k, 2 * i, dtype=DTYPE, device=DEV)
    db = torch.empty(t * k, h, dtype=DTYPE, device=DEV)
    grouped_matmul(x, experts[0].gate_up_proj, ids, block_expert, block_m, k, hb, tiles=tiles)
    if DTYPE in (torch.bfloat16, torch.float16):  # (as routed_swiglu)
        from kvserve.kernels.triton_layers import silu_and_mul

        a = silu_and_mul(hb)
    else:
        gate, up = hb.chunk(2, dim=-1)
        a = F.silu(gate) * up
    rw = top_w.reshape(-1).contiguous()  # the routing weights, applied in the down GEMM (as routed_swiglu)
    grouped_matmul(a, experts[0].down_proj, ids, block_expert, block_m, 1, db, rw, tiles=tiles)
    got = db.view(t, k, h).sum(dim=1)
    experts[0].fused = False
    want = experts[0](x, top_idx, top_w)

    def call(ex) -> None:
        grouped_matmul(x, ex.gate_up_proj, ids, block_expert, block_m, k, hb, tiles=tiles)
        grouped_matmul(a, ex.down_proj, ids, block_expert, block_m, 1, db, rw, tiles=tiles)

    from kvserve.kernels.triton_moe_align import moe_align_triton
    from kvserve.layers.moe import moe_align_torch

    row = {"experts_touched": int(top_idx.unique().numel()), "block_m": block_m,
           "launch": launch.to_json() if launch else "default",
           # the row alignment alone: one Triton launch (what the engine runs on CUDA) vs its torch twin
           "align_ms": _time_ms([lambda: moe_align_triton(top_idx, e, block_m)]),
           "align_torch_ms": _time_ms([lambda: moe_align_torch(top_idx, e, block_m)]),
           "grouped_gemms_ms": _time_ms([lambda ex=ex: call(ex) for ex in experts]),
           "gemms_rel_err": _rel_err(got, want)}
    if sweep:
        row["sweep"] = _sweep(experts, x, a, top_idx, top_w, want, sweep)
        best = min(row["sweep"], key=lambda r: r["ms"])
        row["sweep_best"] = best
        row["sweep_best_over_default"] = best["ms"] / row["grouped_gemms_ms"]
    return row


def sweep_grid(rows_per_expert: float = 1.0) -> list[tuple[int, "object"]]:
    """(block_m, MoETiles) to try, the defaults' neighbours first. Decode-sized batches (at most 16
    routed rows an expert on average): row blocks 16 / 32 / 64, column tiles 64 / 128, K tiles 64 /
    128, 4 / 8 warps, 3 / 4 stages. Prefill chunks: row blocks 64 / 128, column tiles 128 / 256 / 64,
    K tiles 64 / 128, 4 / 8 warps, 3 / 4 stages (vLLM's tuned H200 files pick blocks this size there)."""
    from kvserve.kernels.triton_moe import MoETiles

    if rows_per_expert <= 16:
        return [(bm, MoETiles(bn, bk, w, st)) for bm in (16, 64, 32) for bn in (128, 64) for bk in (64, 128)
                for w in (4, 8) for st in (3, 4)]
    return [(bm, MoETiles(bn, bk, w, st)) for bm in (64, 128) for bn in (128, 256, 64) for bk in (64, 128)
            for w in (8, 4) for st in (3, 4)]


def _sweep(experts: list, x: torch.Tensor, a: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor,
           want: torch.Tensor, limit: int) -> list[dict]:
    """The two GEMMs under each of the first ``limit`` launches of ``sweep_grid`` (the same launch for
    both GEMMs): time and the output's error against the torch loop (the tuning run behind a table of
    launches per shape)."""
    from kvserve.kernels.triton_moe import grouped_matmul
    from kvserve.layers.moe import moe_align

    t, h = x.shape
    k, e = top_idx.shape[1], experts[0].num_experts
    rw = top_w.reshape(-1).contiguous()
    out = []
    for bm, tiles in sweep_grid(t * k / e)[:limit]:
        ids, block_expert = moe_align(top_idx, e, bm)
        hb = torch.empty(t * k, 2 * experts[0].intermediate, dtype=DTYPE, device=DEV)
        db = torch.full((t * k, h), float("nan"), dtype=DTYPE, device=DEV)

        def call(ex, ids=ids, block_expert=block_expert, bm=bm, tiles=tiles, hb=hb, db=db) -> None:
            grouped_matmul(x, ex.gate_up_proj, ids, block_expert, bm, k, hb, tiles=tiles)
            grouped_matmul(a, ex.down_proj, ids, block_expert, bm, 1, db, rw, tiles=tiles)

        try:
            call(experts[0])
            err = _rel_err(db.view(t, k, h).sum(dim=1), want)
            ms = _time_ms([lambda ex=ex: call(ex) for ex in experts])
        except Exception as exc:  # a launch the GPU cannot take (shared memory, registers)
            out.append({"block_m": bm, **dataclasses.asdict(tiles), "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        out.append({"block_m": bm, **dataclasses.asdict(tiles), "ms": ms, "rel_err": err})
    return [r for r in out if "ms" in r] or out


def write_config(doc: dict, folder: Path) -> Path | None:
    """The sweep's fastest launch per token count so far as a table (``kernels/moe_configs``: vLLM's
    file name and keys, plus ``triton_version``) in ``folder``; returns the file (None: nothing swept
    yet). Rewritten after every point, so a run cut short keeps the counts it swept."""
    import triton

    from kvserve.kernels.moe_configs import MoELaunch, config_dtype, config_file_name
    from kvserve.kernels.triton_moe import MoETiles

    moe = doc["moe"]
    table: dict[str, object] = {"triton_version": triton.__version__}
    for row in doc["rows"]:
        best = row.get("sweep_best")
        if best and "ms" in best:
            tiles = MoETiles(best["block_n"], best["block_k"], best["num_warps"], best["num_stages"])
            table[str(row["tokens"])] = MoELaunch(best["block_m"], tiles).to_json()
    if len(table) == 1:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / config_file_name(moe["experts"], moe["intermediate"], doc["device"], config_dtype(DTYPE))
    path.write_text(json.dumps(table, indent=4) + "\n")
    doc["config_file"] = str(path)
    return path


def _dense(rows: int, wgus: list, wdns: list, gen) -> float:
    """2: torch's dense GEMMs of the grouped GEMMs' total shape, [rows, H] x [H, 2I] then
    [rows, I] x [I, H], over rotated weight copies: milliseconds."""
    (n2, h), i = wgus[0].shape, wdns[0].shape[1]
    xr = torch.randn(rows, h, generator=gen, device=DEV, dtype=DTYPE)
    ar = torch.randn(rows, i, generator=gen, device=DEV, dtype=DTYPE)
    yh = torch.empty(rows, n2, dtype=DTYPE, device=DEV)
    yd = torch.empty(rows, h, dtype=DTYPE, device=DEV)

    def call(wgu: torch.Tensor, wdn: torch.Tensor) -> None:
        torch.matmul(xr, wgu.t(), out=yh)
        torch.matmul(ar, wdn.t(), out=yd)

    return _time_ms([lambda c=c: call(*c) for c in zip(wgus, wdns)])


def _block_forward(blocks: list, x: torch.Tensor) -> dict:
    """3: the SparseMoeBlock forward on the device path (graph over the copies, and eager) and on the
    torch reference path (eager), their outputs compared, and how many tokens the two routers send
    to different expert sets (a tie decided apart shows here)."""
    from kvserve.kernels.triton_router import softmax_topk

    for b in blocks:
        _set_device_path(b, True)
        b.shared_expert_join_max_tokens = 1 << 30  # the A/B below times both ways at every size
    graph_ms = _time_ms([lambda b=b: b(x) for b in blocks])
    joined = blocks[0].shared_expert_in_grouped_gemms
    apart_ms = None
    if joined:  # at every size: joined (above) and beside the grouped GEMMs (its GEMMs, SiLU-mul, gated add)
        for b in blocks:
            b.shared_expert_join_max_tokens = 0
        apart_ms = _time_ms([lambda b=b: b(x) for b in blocks])
        for b in blocks:
            b.shared_expert_join_max_tokens = 1 << 30
    blk = blocks[0]
    eager_ms = common.median_ms(lambda: blk(x), 5, 1, DEV == "cuda")
    out_dev = blk(x)
    _set_device_path(blk, False)
    ref_ms = common.median_ms(lambda: blk(x), 5, 1, DEV == "cuda")
    out_ref = blk(x)
    logits = blk.gate(x)
    k = blk.top_k
    dev_idx = softmax_topk(logits, k, True)[1].sort(-1).values
    ref_idx = torch.softmax(logits, -1, dtype=torch.float32).topk(k, -1)[1].sort(-1).values
    apart = (dev_idx != ref_idx).any(-1)
    same = ~apart  # (the error over the tokens both routers send to the same experts: rounding only)
    return {"block_device_graph_ms": graph_ms, "block_shared_in_grouped_gemms": joined,
            "block_device_graph_shared_apart_ms": apart_ms,
            "block_device_eager_ms": eager_ms, "block_reference_eager_ms": ref_ms,
            "block_rel_err": _rel_err(out_dev, out_ref), "block_routing_mismatch_tokens": int(apart.sum()),
            "block_rel_err_same_routing": _rel_err(out_dev[same], out_ref[same]) if bool(same.any()) else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                    help="token counts (decode batches, prefill chunks)")
    ap.add_argument("--time-budget-s", type=float, default=200.0, help="stop starting new points after this")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes (8 experts, hidden 64, top-2), fp32")
    ap.add_argument("--sweep", nargs="?", type=int, const=10**6, default=0, metavar="N",
                    help="also time the grouped GEMMs under the first N launches of sweep_grid (all without N)")
    ap.add_argument("--write-config", default=None, metavar="DIR",
                    help="with --sweep: write the fastest launch per token count as the device's table in DIR "
                         "(kvserve/kernels/configs/moe to ship it; vLLM's file name and format)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.write_config and not a.sweep:
        ap.error("--write-config needs --sweep (the table is the sweep's fastest launch per token count)")
    argv = list(sys.argv[1:] if argv is None else argv)
    moe, tokens = MOE, [int(t) for t in a.tokens.split(",") if t]
    if a.smoke:
        moe, tokens = SMOKE_MOE, SMOKE_TOKENS
    if not tokens or min(tokens) < 1:
        ap.error(f"--tokens {a.tokens!r}: positive token counts, comma-separated")
    doc = {"run": common.run_info("moe_bench", argv, a.smoke),
           "benchmark": "routed experts: grouped GEMMs vs copy bandwidth and dense GEMMs; SparseMoeBlock device path "
                        "vs torch loop", "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
           "dtype": str(DTYPE), "moe": moe, "tokens": tokens,
           "timing": "CUDA: GPU time of CUDA-graph replays over rotated weight copies (median of 5), the torch loop's "
                     "the median of 5 eager calls; CPU (smoke): one wall-clock call each, interpreter kernels",
           "rows": []}
    out = a.out or common.default_out("moe")

    def save() -> None:
        if a.write_config:
            write_config(doc, Path(a.write_config))
        common.write_json(out, doc)

    bench(moe, tokens, a.time_budget_s, doc, save, a.sweep)
    save()
    if a.write_config:
        print(f"wrote {doc.get('config_file', 'no table: no token count swept')}")
    print(f"wrote {out}")
    parts = [f"{r['tokens']} tok {r['copy_bw_fraction']:.2f} / {r['fraction_of_dense']:.2f}" for r in doc["rows"]]
    common.print_summary("moe grouped GEMMs: fraction of copy bw / of dense GEMM FLOP/s: " + ", ".join(parts)
                         + (" (cut short)" if doc.get("cut_short") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
