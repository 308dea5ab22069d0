#!/usr/bin/env python
"""Gated DeltaNet kernels against fla-core on one GPU (part of the hybrid family of the suite).

The Qwen3.6-27B GDN head shape (``benchmarks/configs/qwen3.6-27b``: 16 key heads, 48 value heads,
K = V = 128), bf16 operands, fp32 states, every sequence continuing from a state:

- prefill delta rule at 1x1024, 4x1024, 16x1024 and 1x8192 tokens: kvserve's chunk-parallel rule
  (``kernels/triton_gdn_chunk.py``: raw gates in, q/k normalised, states read and written in their
  slots) against fla-core's ``chunk_gated_delta_rule`` on the same inputs (gates precomputed,
  contiguous q/k/v, dense initial states, ``use_qk_l2norm_in_kernel``), and both against the fp32
  torch reference (max |error| / max |reference|) where the reference is cheap enough;
- the causal conv1d of a prefill step (kvserve's token-parallel kernel, and its token-walking one
  for decodes) against ``torch.nn.functional.conv1d``;
- the decode step (one token per sequence) at batch 1, 32, 256: kvserve's recurrent kernel (raw
  gates in) against fla-core's ``fused_recurrent_gated_delta_rule`` (gates precomputed).

Times are CUDA-event medians over ``--reps`` calls after warm-up calls (fla autotunes per shape on
its first calls). fla-core is optional: without it only kvserve's figures are written.

    python3 benchmarks/gdn_bench.py --out gdn.json          # H200 (bash benchmarks/gpu.sh gdn)
    python3 benchmarks/gdn_bench.py --smoke --out /tmp/g.json  # CPU, Triton interpreter: tiny heads, every path
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # before any kvserve.kernels.triton_* import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from kvserve.kernels import gdn_reference as ref  # noqa: E402

CONFIG = common.CONFIGS / "qwen3.6-27b"


DEV = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on the GPU; the CPU smoke run takes fp32 (the interpreter's bf16 tl.dot is wrong, see tests/triton_support.py)
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32


def _time_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` (CUDA events; wall clock on the CPU smoke run)."""
    return common.median_ms(fn, reps, warmup, DEV == "cuda")


def _fla():
    if DEV != "cuda":
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    import fla

    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, getattr(fla, "__version__", "?")


def _inputs(n: int, length: int, H: int, HV: int, K: int, V: int, seed: int):
    """The conv output's q | k | v views, raw gate projections, gate parameters, a state pool."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T = n * length
    y = torch.randn(T, 2 * H * K + HV * V, device=DEV, generator=gen).to(DTYPE)
    a = torch.randn(T, HV, device=DEV, generator=gen).to(DTYPE)
    b = torch.randn(T, HV, device=DEV, generator=gen).to(DTYPE)
    A_log = (torch.rand(HV, device=DEV, generator=gen) * 2).to(DTYPE)
    dt_bias = torch.randn(HV, device=DEV, generator=gen).to(DTYPE)
    pool = torch.randn(n + 1, HV, K, V, device=DEV, generator=gen) * 0.1
    q, k, v = y[:, : H * K].view(T, H, K), y[:, H * K: 2 * H * K].view(T, H, K), y[:, 2 * H * K:].view(T, HV, V)
    return q, k, v, a, b, A_log, dt_bias, pool


def bench_prefill(H: int, HV: int, K: int, V: int, cases: list[tuple[int, int]], reps: int, fla,
                  check_tokens: int) -> list:
    from kvserve.kernels.triton_gdn import plan_chunks
    from kvserve.kernels.triton_gdn_chunk import chunk_gated_delta_rule

    rows = []
    for n, length in cases:
        q, k, v, a, b, A_log, dt_bias, pool = _inputs(n, length, H, HV, K, V, seed=n * 7919 + length)
        T = n * length
        qsl = torch.arange(0, T + 1, length, dtype=torch.int32, device=DEV)
        slots = torch.arange(1, n + 1, dtype=torch.int32, device=DEV)  # row 0 untouched
        has = torch.ones(n, dtype=torch.int32, device=DEV)
        plan = plan_chunks([length] * n, torch.device(DEV))
        pool0 = pool.clone()
        g, beta = ref.gdn_gates(A_log, a, dt_bias, b)
        row = {"sequences": n, "tokens_each": length, "tokens": T}

        def ours():
            return chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, pool, qsl, slots, has, plan)

        pool.copy_(pool0)
        o_ours = ours()
        state_ours = pool[1:].clone()
        row["kvserve_ms"] = _time_ms(ours, reps)
        o_fla = state_fla = None
        if fla is not None:
            chunk_rule = fla[0]
            qc, kc, vc = q.contiguous()[None], k.contiguous()[None], v.contiguous()[None]
            cu = qsl.long()
            h0 = pool0[1:].clone()

            def peer():
                return chunk_rule(qc, kc, vc, g[None], beta[None], initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu)

            o_fla, state_fla = peer()
            o_fla = o_fla[0]
            row["fla_ms"] = _time_ms(peer, reps)
            row["kvserve_over_fla"] = row["kvserve_ms"] / row["fla_ms"]
        if T <= check_tokens:  # the fp32 torch reference, sequence by sequence
            want_o, want_s = [], []
            for i in range(n):
                s, e = i * length, (i + 1) * length
                o, st = ref.chunk_gated_delta_rule(q[s:e].float(), k[s:e].float(), v[s:e].float(), g[s:e], beta[s:e],
                                                   initial_state=pool0[i + 1], use_qk_l2norm=True)
                want_o.append(o.float())
                want_s.append(st)
            want_o, want_s = torch.cat(want_o), torch.stack(want_s)

            def rel(x, want):
                return float((x.float() - want).abs().max() / want.abs().max())

            row["kvserve_output_rel_err"], row["kvserve_state_rel_err"] = rel(o_ours, want_o), rel(state_ours, want_s)
            if o_fla is not None:
                row["fla_output_rel_err"], row["fla_state_rel_err"] = rel(o_fla, want_o), rel(state_fla, want_s)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, pool, pool0
        torch.cuda.empty_cache()
    return rows


def bench_conv(C: int, W: int, cases: list[tuple[int, int]], reps: int) -> list:
    from kvserve.kernels.triton_gdn import causal_conv1d_varlen
    from kvserve.kernels.triton_gdn import plan_chunks

    rows = []
    for n, length in cases:
        T = n * length
        x = torch.randn(T, C, device=DEV).to(DTYPE)
        w = torch.randn(C, W, device=DEV).to(DTYPE)
        state = torch.randn(n + 1, C, W - 1, device=DEV).to(DTYPE)
        qsl = torch.arange(0, T + 1, length, dtype=torch.int32, device=DEV)
        slots = torch.arange(1, n + 1, dtype=torch.int32, device=DEV)
        has = torch.ones(n, dtype=torch.int32, device=DEV)
        xb = x.view(n, length, C).transpose(1, 2)
        bytes_moved = 2 * T * C * 2
        plan = plan_chunks([length] * n, torch.device(DEV))
        row = {"sequences": n, "tokens_each": length, "channels": C,
               "kvserve_ms": _time_ms(lambda: causal_conv1d_varlen(x, w, state, qsl, slots, has, plan), reps),
               "kvserve_token_walk_ms": _time_ms(lambda: causal_conv1d_varlen(x, w, state, qsl, slots, has), reps),
               "torch_conv1d_ms": _time_ms(lambda: F.silu(F.conv1d(xb, w[:, None, :], padding=W - 1, groups=C)), reps)}
        row["bytes_time_ms_at_4TBps"] = bytes_moved / 4e12 * 1e3
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def bench_decode(H: int, HV: int, K: int, V: int, batches: list[int], reps: int, fla) -> list:
    from kvserve.kernels.triton_gdn import gated_delta_rule_varlen

    rows = []
    for n in batches:
        q, k, v, a, b, A_log, dt_bias, pool = _inputs(n, 1, H, HV, K, V, seed=n)
        g, beta = ref.gdn_gates(A_log, a, dt_bias, b)
        qsl = torch.arange(n + 1, dtype=torch.int32, device=DEV)
        slots = torch.arange(1, n + 1, dtype=torch.int32, device=DEV)
        has = torch.ones(n, dtype=torch.int32, device=DEV)
        row = {"batch": n, "state_bytes": 2 * n * HV * K * V * 4,
               "kvserve_ms": _time_ms(lambda: gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, pool, qsl, slots,
                                                                      has), reps)}
        if fla is not None:
            recurrent = fla[1]
            qc, kc, vc = q.contiguous()[None], k.contiguous()[None], v.contiguous()[None]
            h0 = pool[1:].clone()
            cu = qsl.long()
            row["fla_ms"] = _time_ms(lambda: recurrent(qc, kc, vc, g=g[None], beta=beta[None], initial_state=h0,
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                       cu_seqlens=cu), reps)
            row["kvserve_over_fla"] = row["kvserve_ms"] / row["fla_ms"]
        row["kvserve_state_TBps"] = row["state_bytes"] / row["kvserve_ms"] / 1e9
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--cases", default="1x1024,4x1024,16x1024,1x8192", help="prefill: SEQUENCESxTOKENS,...")
    ap.add_argument("--decode-batches", default="1,32,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--check-tokens", type=int, default=4096,
                    help="compare with the fp32 reference up to this many tokens")
    ap.add_argument("--smoke", action="store_true", help="CPU (Triton interpreter): tiny heads and lengths")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = json.loads((Path(a.config) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    H, HV = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    K, V, W = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    cases = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",") if c]
    conv_cases, batches = [(4, 1024), (1, 8192)], [int(b) for b in a.decode_batches.split(",") if b]
    if a.smoke:
        H, HV, K, V, cases, conv_cases, batches, a.reps = 2, 4, 32, 32, [(1, 70), (2, 40)], [(2, 8)], [1, 3], 1
    elif DEV != "cuda":
        print("gdn_bench.py needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    fla = _fla()
    res = {"run": common.run_info("gdn_bench", argv, a.smoke), "benchmark": "gdn kernels", "config": a.config,
           "heads": {"H": H, "HV": HV, "K": K, "V": V, "W": W},
           "gpu": torch.cuda.get_device_name() if DEV == "cuda" else None,
           "torch": torch.__version__, "fla_core": fla[2] if fla else None}
    torch.manual_seed(0)
    res["prefill"] = bench_prefill(H, HV, K, V, cases, a.reps, fla, a.check_tokens)
    res["conv1d"] = bench_conv(2 * H * K + HV * V, W, conv_cases, a.reps)
    res["decode"] = bench_decode(H, HV, K, V, batches, a.reps, fla)
    if a.out:
        common.write_json(a.out, res)
        print(f"wrote {a.out}")
    common.print_summary("gdn prefill kvserve/fla " + ", ".join(
        f"{r['sequences']}x{r['tokens_each']} {r.get('kvserve_over_fla', float('nan')):.2f}" for r in res["prefill"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
