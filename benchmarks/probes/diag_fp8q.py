"""Why the quantized-query read misses the twin on the GPU: per case, kernel vs twin (fp32 sums)
and vs the float64 twin, default tiles vs BLOCK_M 16 (mma.sync) vs pv16, split by decode / prefill rows."""
import sys, math, json, os
from pathlib import Path
sys.path.insert(0, "tests")
import torch
from kvserve.kernels import reference, triton_attention
from kvserve.kernels.reference import CacheQuant
from test_triton_kernels import FLOAT, MIXED_QLENS, MIXED_SEQLENS, _gen, _make_batch, _gpu_batch

def rel(x, r):
    return float((x.double() - r.double()).norm() / r.double().norm())

rows = []
cases = [("mixed-small", 4, 2, 64, "fp32", 8), ("mixed-small", 4, 2, 64, "bf16", 8), ("gpu", 32, 8, 128, "fp32", 8),
         ("gpu", 32, 8, 128, "bf16", 8), ("gpu", 24, 4, 256, "bf16", 8), ("gpu", 16, 16, 64, "fp16", 0),
         ("gpu", 24, 4, 256, "fp32", 0)]
for kind, hq, hk, d, qd, shift in cases:
    gen = _gen("diag", kind, hq, d, qd)
    if kind == "gpu":
        qlens, slens = _gpu_batch(gen)
    else:
        qlens, slens = MIXED_QLENS, MIXED_SEQLENS
    b = _make_batch(qlens, slens, hq, hk, d, 16, FLOAT[qd], "fp8_e4m3", gen)
    quant = CacheQuant(torch.float8_e4m3fn, 448.0, 0.37, 3.1, "cuda", query_fp8=True, q_scale=1.0, p_shift=shift)
    scale = d ** -0.5
    head_pad = triton_attention.triton.next_power_of_2(d)
    cfg = triton_attention._tile_config(max(qlens), hq // hk, head_pad, True, True, False, qd == "fp32")
    dec = torch.cat([torch.full((q,), q == 1) for q in qlens]).cuda()
    for label, tiles, pv, f16 in [("default", None, None, None), ("pv8", None, True, None), ("fp16mma", None, None, True),
                                  ("bm16", (16, cfg[1], 4, 2), None, None)]:
        tn = (tiles or cfg)[1]
        args = (b.query, b.kv_cache, b.block_tables, b.query_lens, b.seq_lens, scale, quant, tn)
        twin = reference.paged_attention_fp8_query(*args)
        twin64 = reference.paged_attention_fp8_query(*args, compute=torch.float64)
        try:
            got = triton_attention.paged_attention(b.query, b.kv_cache, scale=scale, quant=quant, tiles=tiles, pv_fp8=pv, fp16_mma=f16,
                                                   num_splits=1, **b.kernel_args())
        except Exception as e:
            print(kind, hq, hk, d, qd, label, "ERR", e); continue
        r = {"case": f"{kind}-{hq}-{hk}-{d}-{qd}-s{shift}", "variant": label, "cfg": list(cfg),
             "spread": rel(twin, twin64), "err": rel(got, twin), "err64": rel(got, twin64),
             "err_dec": rel(got[dec], twin[dec]) if dec.any() else None,
             "err_pre": rel(got[~dec], twin[~dec]) if (~dec).any() else None,
             "max_abs": float((got.double() - twin.double()).abs().max())}
        rows.append(r)
        print(json.dumps(r), flush=True)
Path(os.environ["OUT"], "diag_fp8q.json").write_text(json.dumps(rows, indent=1))
