"""The quantized-query read of e4m3 pages (vLLM's FLASH_ATTN = FlashAttention 3, and its TRITON_ATTN
on CUDA): ``triton_attention.paged_attention`` with ``CacheQuant(query_fp8=True)`` against its torch
twin ``reference.paged_attention_fp8_query`` (the same math: e4m3 query, fp8 products, P scaled by
2^p_shift and rounded to e4m3 tile by tile).

Tolerance: the twin's own spread, measured two equivalent ways on the same batch (its sums in float32
and in float64; each then rounds P to e4m3 and the output to the query's dtype), times 4; for bf16 /
fp16 outputs at least 2^-8, about one output ulp in every element. On the CPU the interpreter sums in
float32 like the twin. Each case also shows that the check can fail: the dequantizing read (kvserve's
``triton``) is much farther from the twin, and for float32 outputs so is the other P shift.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvserve.kernels import reference, triton_attention
from kvserve.kernels.reference import CacheQuant
from test_triton_kernels import DEV, FLOAT, MIXED_QLENS, MIXED_SEQLENS, ON_GPU, Batch, _gen, _make_batch
from triton_support import skip_without_triton_device

pytestmark = [skip_without_triton_device(), pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def _tile_n(b: Batch, num_splits: int) -> int:
    """The kernel's key tile for this batch (the twin's P rounding follows it)."""
    return triton_attention.fp8_query_key_tile(b.query, b.kv_cache, max(b.query_lens), ON_GPU, num_splits > 1)


def _check(b: Batch, quant: CacheQuant, num_splits: int = 1, pv_fp8: bool | None = None,
           paired: bool | None = None) -> dict:
    """Kernel vs twin within the twin's own spread; returns the measured figures.

    The kernel runs with fp16 MMAs on the e4m3 values on a GPU (exact products, fp32 sums, like the
    twin; the interpreter's fp8 dots are exact too, so there it runs as by default) and must match
    within 4x the twin's fp32-vs-float64 spread. On a GPU it also runs as it does by default,
    whose wgmma tiles multiply on fp8 tensor cores: their fast accumulation keeps fewer bits than
    fp32, which the e4m3 rounding of P then amplifies (measured on the H100, 2026-12-06: 6e-4 to 4e-3
    from the twin, against 2e-5 to 7e-5 for the fp16 MMAs). That run is held to 4x the twin's spread
    under the same hardware (its scores from torch's fp8 GEMM with fast accumulation)."""
    scale = b.query.shape[-1] ** -0.5
    args = (b.query, b.kv_cache, b.block_tables, b.query_lens, b.seq_lens, scale, quant, _tile_n(b, num_splits))
    twin = reference.paged_attention_fp8_query(*args, num_splits=num_splits)
    spread = _rel(twin, reference.paged_attention_fp8_query(*args, compute=torch.float64, num_splits=num_splits))

    def run(**kw) -> torch.Tensor:
        out = torch.full(b.query.shape, math.nan, dtype=b.query.dtype, device=DEV)
        got = triton_attention.paged_attention(b.query, b.kv_cache, scale=scale, quant=quant, out=out,
                                               num_splits=num_splits, pv_fp8=pv_fp8, paired=paired, **kw,
                                               **b.kernel_args())
        assert bool(torch.isfinite(got).all()), "rows left unwritten or poisoned pages read"
        return got

    floor = 0.0 if b.query.dtype == torch.float32 else 2.0 ** -8
    tol = max(4 * spread, floor)
    err = _rel(run(fp16_mma=True if ON_GPU else None), twin)  # the interpreter's fp8 dots are exact: the default
    assert err <= tol, f"kernel vs twin {err:.2e} > {tol:.2e} (twin spread {spread:.2e})"
    dequantized = triton_attention.paged_attention(b.query, b.kv_cache, scale=scale, num_splits=num_splits,
                                                   quant=dataclasses.replace(quant, query_fp8=False), **b.kernel_args())
    assert _rel(dequantized, twin) > 2 * tol, "the dequantizing read passes too: the check cannot fail"
    if b.query.dtype == torch.float32:
        other = reference.paged_attention_fp8_query(*args[:6], dataclasses.replace(quant, p_shift=8 - quant.p_shift),
                                                    args[7], num_splits=num_splits)
        assert _rel(other, twin) > tol, "the other P shift passes too"
    figures = {"err": err, "spread": spread, "tol": tol}
    if ON_GPU:  # the default: fp8 tensor cores in wgmma tiles
        hw_spread = _rel(reference.paged_attention_fp8_query(*args, num_splits=num_splits, fp8_gemm_scores=True),
                         twin)
        hw_tol = max(tol, 4 * hw_spread)
        hw_err = _rel(run(), twin)
        assert hw_err <= hw_tol, f"kernel (fp8 MMAs) vs twin {hw_err:.2e} > {hw_tol:.2e} (fp8 GEMM spread {hw_spread:.2e})"
        figures.update(hw_err=hw_err, hw_spread=hw_spread, hw_tol=hw_tol)
    return figures


def _quant(p_shift: int, q_scale: float = 1.0) -> CacheQuant:
    return CacheQuant(torch.float8_e4m3fn, 448.0, 0.37, 3.1, DEV, query_fp8=True, q_scale=q_scale, p_shift=p_shift)


# (Hq, Hk, D, block size, query dtype, P shift, q_scale): GQA 1/2/3/4, D 64/128, both shifts, q_scale != 1
CPU_CASES = [
    (4, 2, 64, 16, "fp32", 8, 1.0),
    (4, 2, 64, 16, "fp32", 0, 0.7),
    (6, 2, 64, 32, "bf16", 8, 1.0),
    (4, 1, 128, 16, "bf16", 0, 1.0),
    (2, 2, 128, 32, "fp16", 8, 2.5),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "h{}-{}-d{}-bs{}-q{}-shift{}-qs{}".format(*c))
def test_mixed_batch_matches_the_twin(case):
    """Decodes, prefill chunks over cached context and fresh prefills in one launch; P @ V as an fp8
    MMA and as an fp16 one on the same values (both cases' kernels)."""
    hq, hk, d, bs, qd, shift, q_scale = case
    b = _make_batch(MIXED_QLENS, MIXED_SEQLENS, hq, hk, d, bs, FLOAT[qd], "fp8_e4m3", _gen("fp8q", case))
    _check(b, _quant(shift, q_scale), pv_fp8=CPU_CASES.index(case) % 2 == 0)


def test_chunks_over_several_query_blocks_match_the_twin():
    """G = 6 (head 256's grouping, here at head 64): a program holds 10 query tokens, so the 45- and
    64-token chunks span several blocks."""
    from test_triton_kernels import SPANNING_QLENS, SPANNING_SEQLENS

    b = _make_batch(SPANNING_QLENS, SPANNING_SEQLENS, 12, 2, 64, 16, torch.bfloat16, "fp8_e4m3", _gen("fp8q-span"))
    _check(b, _quant(8, 0.8))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("qd", ["fp32", "bf16-unpaired", "bf16-paired"])
def test_decode_batch_matches_the_twin(qd, num_splits):
    """Decode-only, one split or three (each split's own running max, then the merge: the twin
    splits the same way); contexts up to 5 of the 64-key tiles; bf16 queries through both decodes
    (the paired one reads the pages in 16-bit words)."""
    seq_lens = [33, 1, 97, 64, 128, 300, 257]
    gen = _gen("fp8q-dec", qd, num_splits)
    b = _make_batch([1] * len(seq_lens), seq_lens, 8, 2, 128, 16, FLOAT[qd.split("-")[0]], "fp8_e4m3", gen)
    _check(b, _quant(8), num_splits, paired=None if qd == "fp32" else qd.endswith("-paired"))


def test_queries_beyond_e4m3_range_saturate():
    """|q| / q_scale above 448 clamps to 448 (vLLM's QuantFP8), in the kernel as in the twin. bf16
    queries: with float32 ones the saturated scores are so large that
    the tensor cores' own fp32 sums (which truncate) moved the output 5.8e-6 from the twin on the
    H100, beyond 4x the twin's fp32 / float64 spread (2.4e-6) that holds for unsaturated batches."""
    b = _make_batch(MIXED_QLENS, MIXED_SEQLENS, 4, 2, 64, 16, torch.bfloat16, "fp8_e4m3", _gen("fp8q-sat"))
    b.query.mul_(300.0)
    assert float(b.query.abs().max()) > 448
    _check(b, _quant(8))


def test_the_read_refuses_e5m2_pages():
    with pytest.raises(ValueError, match="the quantized-query read needs e4m3 pages"):
        CacheQuant(torch.float8_e5m2, 57344.0, query_fp8=True)


# ---- GPU grid ----------------------------------------------------------------------------------
GPU_CASES = [(hq, hk, d, qd, shift) for (hq, hk), d, qd, shift in [
    ((32, 8), 128, "bf16", 8), ((32, 8), 128, "fp32", 8), ((24, 4), 256, "bf16", 8), ((16, 16), 64, "fp16", 0),
    ((9, 3), 128, "bf16", 0), ((24, 4), 256, "fp32", 0),
]]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("hq,hk,d,qd,shift", GPU_CASES)
def test_gpu_batches_match_the_twin(hq, hk, d, qd, shift, record_property):
    """A mixed batch (long prefills, chunks over context, ~40 decodes) and a decode-only batch with
    the automatic split-KV choice, on fp8 tensor cores."""
    from test_triton_kernels import _gpu_batch

    gen = _gen("fp8q-gpu", hq, hk, d, qd, shift)
    qlens, slens = _gpu_batch(gen)
    b = _make_batch(qlens, slens, hq, hk, d, 16, FLOAT[qd], "fp8_e4m3", gen)
    record_property("mixed", _check(b, _quant(shift, 1.0)))
    record_property("mixed_pv_fp16", _check(b, _quant(shift, 1.0), pv_fp8=False))
    seq_lens = torch.randint(1, 3000, (16,), generator=gen).tolist()  # 16 x Hk programs: too few, so it splits
    b = _make_batch([1] * 16, seq_lens, hq, hk, d, 16, FLOAT[qd], "fp8_e4m3", gen)
    splits = triton_attention.choose_num_splits(16, hk, max(seq_lens), b.query.device)
    assert splits > 1
    record_property("decode", _check(b, _quant(shift, 1.0), num_splits=splits))  # bf16: the paired decode
    if qd != "fp32":  # and the unpaired one (fp32 queries always take it: the IEEE path)
        record_property("decode_unpaired", _check(b, _quant(shift, 1.0), num_splits=splits, paired=False))
