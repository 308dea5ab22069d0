"""Alternative decode-only Triton paged-attention kernels, timed against the production kernel.

Why: on the H200 the production kernel (kvserve.kernels.triton_attention) reads bf16 pages at about
copy bandwidth but fp8 (e4m3) pages at only 63-71% of it, i.e. fp8 decode is bound by per-element
work, not bytes. This script tries decode formulations that may cut that work:

  swapped  S^T = K . Q^T (the fp8->fp16 converted K tile is the mma A operand, which mma takes from
           registers), the query group padded only to GP (8 or 16) columns; softmax along axis 0;
           P.V either as acc [GP, D] += P^T . V or as acc^T [D, GP] += V^T . P^T (V in A position).
  cuda     no tl.dot: s[g, n] = sum_d q[g, d] k[n, d] and acc[g, d] += sum_n p[g, n] v[n, d] by 3-D
           broadcasting in fp32, G padded only to next_power_of_2(G).
  dot      the production formulation (Q [BLOCK_M=16, D] . K^T, P . V) with the fp8 conversion to
           fp16 (query rescaled by a power of two, as production does) or to bf16, and a sweep of
           TILE_N / num_warps / num_stages.

All keep the production numerics: fp32 online softmax in base 2, k_scale folded into the score
multiplier, v_scale applied to the output, masking of the last partial tile, optional split-KV
(same split policy as production, ``choose_num_splits``) with a merge kernel.

GPU (times every variant and the production kernel for bf16 and fp8_e4m3 pages, after checking each
against kvserve.kernels.reference.paged_attention; writes a JSON with every row):

    PYTHONPATH=. python3 benchmarks/fp8_decode_variants.py --out fp8_variants.json [--quick]

CPU (every variant once under the Triton interpreter on tiny shapes, against the reference):

    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/fp8_decode_variants.py --cpu-check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

if "--cpu-check" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvserve.kernels import reference as R  # noqa: E402
from kvserve.kernels.triton_attention import _merge_splits_kernel, choose_num_splits, paged_attention  # noqa: E402

MAX_REL_ERR = 2e-2
# Compute dtype codes (constexpr COMPUTE): what K/V tiles (and the query) are converted to.
FP16, BF16, FP32 = 0, 1, 2

# --------------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------------


@triton.jit
def _prep_q(q, k_mul, FP8: tl.constexpr, COMPUTE: tl.constexpr):
    """The query in the compute dtype and the (possibly adjusted) score multiplier.

    fp8 pages converted to fp16: the query is brought into fp16 range by an exact power of two
    2^(14 - e), e = floor(log2 max|q|) (production's trick); the score multiplier undoes it."""
    if COMPUTE == 2:
        q = q.to(tl.float32)
    elif COMPUTE == 1:
        q = q.to(tl.bfloat16)
    else:
        if FP8:
            qf = q.to(tl.float32)
            q_max = tl.max(tl.max(tl.abs(qf), axis=1), axis=0)
            e = ((q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            e = tl.minimum(tl.maximum(e, -100), 100)
            q_mul = ((127 + 14 - e) << 23).to(tl.float32, bitcast=True)
            q = (qf * q_mul).to(tl.float16)
            k_mul = k_mul / q_mul
        else:
            q = q.to(tl.float16)
    return q, k_mul


@triton.jit
def _to_compute(x, FP8: tl.constexpr, COMPUTE: tl.constexpr):
    """A loaded K/V tile (uint8 fp8 bytes or float) in the compute dtype."""
    if FP8:
        x = x.to(tl.float8e4nv, bitcast=True)
    if COMPUTE == 2:
        x = x.to(tl.float32)
    elif COMPUTE == 1:
        x = x.to(tl.bfloat16)
    else:
        x = x.to(tl.float16)
    return x


@triton.jit
def _split_range(seq_len, split, num_splits, TILE_N: tl.constexpr):
    """Tiles [lo, hi) of this split (hi <= lo: an empty split)."""
    num_tiles = tl.cdiv(seq_len, TILE_N)
    per = tl.cdiv(num_tiles, num_splits)
    lo = split * per
    hi = tl.minimum(lo + per, num_tiles)
    return lo, hi


@triton.jit
def _tile_offsets(table, t, seq_len, kv_head, stride_cb, stride_cs, stride_ch,
                  PAGE: tl.constexpr, TILE_N: tl.constexpr):
    """Key-valid mask and cache element offsets of the K rows of tile t (a tile may span pages)."""
    n = t * TILE_N + tl.arange(0, TILE_N)
    n_ok = n < seq_len
    page = tl.load(table + n // PAGE, mask=n_ok, other=0)
    off = page.to(tl.int64) * stride_cb + (n % PAGE) * stride_cs + kv_head * stride_ch
    return n_ok, off


@triton.jit
def _finish(acc, m_i, l_i, v_mul, out_ptr, part_acc_ptr, part_ml_ptr, seq, head, g_ok, d, d_ok,
            split, num_splits, stride_ot, stride_oh,
            G: tl.constexpr, HEAD_PAD: tl.constexpr, SPLIT: tl.constexpr):
    """acc [GP, HEAD_PAD]: write the normalized output, or this split's partials for the merge."""
    if SPLIT:
        part = (seq * (G * tl.num_programs(1)) + head) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc * v_mul, mask=g_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_ok)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None] * v_mul
        tl.store(out_ptr + seq * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


# split-KV partials use the production layout, so the production merge kernel combines them
_merge_kernel = _merge_splits_kernel


# --------------------------------------------------------------------------------------------------
# Variant kernels. Grid: (num_seqs, num_kv_heads, num_splits); one program = one sequence's decode
# token x the G query heads of one KV head, over one split of its keys.
# --------------------------------------------------------------------------------------------------

_DNS = ["num_splits", "stride_qt", "stride_ot", "stride_bt"]


@triton.jit(do_not_specialize=_DNS)
def _dot_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt,
    G: tl.constexpr, GP: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    PAGE: tl.constexpr, TILE_N: tl.constexpr, FP8: tl.constexpr, COMPUTE: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Production formulation: S = Q [GP, D] . K^T, acc [GP, D] += P . V (GP rows, G real)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GP)
    g_ok = g < G
    head = kv_head * G + g
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    v_mul = tl.load(v_scale_ptr)
    q, k_mul = _prep_q(q, qk_scale * tl.load(k_scale_ptr), FP8, COMPUTE)
    k_mul = k_mul * 1.4426950408889634  # log2 domain
    lo, hi = _split_range(seq_len, split, num_splits, TILE_N)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for t in range(lo, hi):
        n_ok, off = _tile_offsets(table, t, seq_len, kv_head, stride_cb, stride_cs, stride_ch, PAGE, TILE_N)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _to_compute(tl.load(cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0), FP8, COMPUTE)
        v = _to_compute(tl.load(cache_ptr + stride_ckv + off[:, None] + d[None, :], mask=kv_mask, other=0),
                        FP8, COMPUTE)
        s = tl.dot(q, tl.trans(k)) * k_mul
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    _finish(acc, m_i, l_i, v_mul, out_ptr, part_acc_ptr, part_ml_ptr, seq, head, g_ok, d, d_ok,
            split, num_splits, stride_ot, stride_oh, G, HEAD_PAD, SPLIT)


@triton.jit(do_not_specialize=_DNS)
def _swapped_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt,
    G: tl.constexpr, GP: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    PAGE: tl.constexpr, TILE_N: tl.constexpr, FP8: tl.constexpr, COMPUTE: tl.constexpr,
    SPLIT: tl.constexpr, ACC_T: tl.constexpr,
):
    """S^T [TILE_N, GP] = K [TILE_N, D] . Q^T [D, GP]; softmax over axis 0.
    ACC_T: acc^T [D, GP] += V^T . P^T (V in A position); else acc [GP, D] += P^T^T . V."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GP)
    g_ok = g < G
    head = kv_head * G + g
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD
    q_t = tl.load(q_ptr + seq * stride_qt + head[None, :] * stride_qh + d[:, None],
                  mask=d_ok[:, None] & g_ok[None, :], other=0.0)  # [HEAD_PAD, GP]
    v_mul = tl.load(v_scale_ptr)
    q_t, k_mul = _prep_q(q_t, qk_scale * tl.load(k_scale_ptr), FP8, COMPUTE)
    k_mul = k_mul * 1.4426950408889634
    lo, hi = _split_range(seq_len, split, num_splits, TILE_N)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    if ACC_T:
        acc = tl.zeros([HEAD_PAD, GP], tl.float32)
    else:
        acc = tl.zeros([GP, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for t in range(lo, hi):
        n_ok, off = _tile_offsets(table, t, seq_len, kv_head, stride_cb, stride_cs, stride_ch, PAGE, TILE_N)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _to_compute(tl.load(cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0), FP8, COMPUTE)
        v = _to_compute(tl.load(cache_ptr + stride_ckv + off[:, None] + d[None, :], mask=kv_mask, other=0),
                        FP8, COMPUTE)
        s_t = tl.dot(k, q_t) * k_mul  # [TILE_N, GP]
        s_t = tl.where(n_ok[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p_t = tl.exp2(s_t - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p_t, axis=0)
        if ACC_T:
            acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p_t.to(v.dtype))
        else:
            acc = acc * alpha[:, None] + tl.dot(tl.trans(p_t.to(v.dtype)), v)
        m_i = m_new
    if ACC_T:
        acc = tl.trans(acc)
    _finish(acc, m_i, l_i, v_mul, out_ptr, part_acc_ptr, part_ml_ptr, seq, head, g_ok, d, d_ok,
            split, num_splits, stride_ot, stride_oh, G, HEAD_PAD, SPLIT)


@triton.jit(do_not_specialize=_DNS)
def _cuda_core_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt,
    G: tl.constexpr, GP: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    PAGE: tl.constexpr, TILE_N: tl.constexpr, FP8: tl.constexpr, COMPUTE: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """No tl.dot: s [GP, TILE_N] = sum_d q[:, None, :] k[None, :, :]; acc [GP, D] += sum_n p v; fp32."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GP)
    g_ok = g < G
    head = kv_head * G + g
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    v_mul = tl.load(v_scale_ptr)
    q = q * (qk_scale * tl.load(k_scale_ptr) * 1.4426950408889634)  # scores come out in log2 domain
    lo, hi = _split_range(seq_len, split, num_splits, TILE_N)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for t in range(lo, hi):
        n_ok, off = _tile_offsets(table, t, seq_len, kv_head, stride_cb, stride_cs, stride_ch, PAGE, TILE_N)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _to_compute(tl.load(cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0), FP8, COMPUTE)
        v = _to_compute(tl.load(cache_ptr + stride_ckv + off[:, None] + d[None, :], mask=kv_mask, other=0),
                        FP8, COMPUTE)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GP, TILE_N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    _finish(acc, m_i, l_i, v_mul, out_ptr, part_acc_ptr, part_ml_ptr, seq, head, g_ok, d, d_ok,
            split, num_splits, stride_ot, stride_oh, G, HEAD_PAD, SPLIT)


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    kind: str  # "swapped" | "cuda" | "dot"
    tile_n: int
    warps: int
    stages: int
    gp: int = 16  # swapped: N of S^T = K.Q^T; dot: BLOCK_M (rows); cuda: ignored (next_pow2(G))
    acc_t: bool = False  # swapped: accumulate acc^T = V^T . P^T
    cvt: str = "fp16"  # fp8 pages: tiles converted to "fp16" (query rescaled) or "bf16"
    maxnreg: int | None = None  # register cap per thread (more programs per SM), None: compiler's choice

    @property
    def name(self) -> str:
        if self.kind == "swapped":
            head = f"swapped gp{self.gp} {'accT' if self.acc_t else 'acc '}"
        elif self.kind == "cuda":
            head = "cuda-core"
        else:
            head = f"dot {self.cvt} m{self.gp}"
        cap = f" r{self.maxnreg}" if self.maxnreg else ""
        return f"{head} tn{self.tile_n} w{self.warps} s{self.stages}{cap}"

    def bf16_key(self) -> tuple:
        """Identity for bf16 pages, where ``cvt`` does not matter (no conversion)."""
        return (self.kind, self.tile_n, self.warps, self.stages, self.gp, self.acc_t, self.maxnreg)


def _v(kind, tile_n, warps, stages, **kw) -> Variant:
    return Variant(kind, tile_n, warps, stages, **kw)


FULL_VARIANTS = [
    # (a) swapped: converted K as the A operand
    _v("swapped", 64, 4, 3),
    _v("swapped", 128, 4, 3),
    _v("swapped", 64, 4, 3, acc_t=True),
    _v("swapped", 128, 4, 3, acc_t=True),
    _v("swapped", 128, 4, 3, gp=8),
    _v("swapped", 128, 4, 3, gp=8, acc_t=True),
    _v("swapped", 64, 2, 4, gp=8, acc_t=True),
    _v("swapped", 128, 4, 3, gp=8, acc_t=True, maxnreg=168),
    # (b) CUDA cores, fp32, G padded to a power of two only (the 3-D product lives in registers:
    # large tiles spill, hence the small ones)
    _v("cuda", 16, 2, 3),
    _v("cuda", 16, 4, 3),
    _v("cuda", 32, 2, 4),
    _v("cuda", 32, 8, 3),
    _v("cuda", 64, 8, 3),
    # (c) production formulation: fp16 vs bf16 conversion, tiles / warps / stages
    _v("dot", 128, 4, 3),  # = production's fp8 decode default
    _v("dot", 128, 4, 3, cvt="bf16"),
    _v("dot", 64, 4, 3),  # = production's bf16 decode default
    _v("dot", 64, 4, 3, cvt="bf16"),
    _v("dot", 128, 4, 2),
    _v("dot", 128, 4, 4),
    _v("dot", 128, 8, 3),
    _v("dot", 128, 2, 3),
    _v("dot", 256, 8, 3),
    _v("dot", 256, 8, 3, cvt="bf16"),
    _v("dot", 256, 4, 2),
    _v("dot", 128, 4, 3, gp=4),  # BLOCK_M = 4: let triton pad the mma (M >= 1 allowed since 3.x)
    _v("dot", 128, 4, 3, maxnreg=168),  # fp16 conversion needs ~207 regs: 2 -> 3 programs per SM
]

QUICK_VARIANTS = [
    _v("swapped", 128, 4, 3),
    _v("swapped", 128, 4, 3, acc_t=True),
    _v("swapped", 128, 4, 3, gp=8, acc_t=True),
    _v("cuda", 16, 4, 3),
    _v("dot", 128, 4, 3),
    _v("dot", 128, 4, 3, maxnreg=168),
]

SHAPES = [(32, 4096), (64, 4096), (256, 4096), (32, 16384), (8, 32768)]
QUICK_SHAPES = [(32, 4096), (8, 32768)]


@dataclass
class Inputs:
    q: torch.Tensor  # [B, Hq, D]
    cache: torch.Tensor  # [NB, 2, BS, Hk, D]
    tables: torch.Tensor  # [B, M] int32
    seq_lens: torch.Tensor  # [B] int32
    lens: list[int]
    quant: R.CacheQuant | None
    k_scale_t: torch.Tensor
    v_scale_t: torch.Tensor
    scale: float

    @property
    def kv_bytes(self) -> int:
        hk, d = self.cache.shape[3], self.cache.shape[4]
        return sum(self.lens) * hk * d * 2 * self.cache.element_size()


def make_inputs(lens: list[int], hq: int, hk: int, d: int, bs: int, fp8: bool, device: str,
                k_scale: float = 0.05, v_scale: float = 0.07) -> Inputs:
    batch = len(lens)
    max_blocks = triton.cdiv(max(lens), bs)
    nblk = batch * max_blocks
    cache = torch.empty((nblk, 2, bs, hk, d), dtype=torch.uint8 if fp8 else torch.bfloat16, device=device)
    if fp8:
        cache.view(torch.float8_e4m3fn).copy_(torch.randn(cache.shape, device=device).to(torch.float8_e4m3fn))
        quant = R.CacheQuant(torch.float8_e4m3fn, 448.0, k_scale, v_scale, device)
        k_scale_t, v_scale_t = quant.k_scale_t, quant.v_scale_t
    else:
        cache.normal_()
        quant = None
        k_scale_t = v_scale_t = torch.ones((), dtype=torch.float32, device=device)
    tables = torch.randperm(nblk, device=device).to(torch.int32).view(batch, max_blocks)
    q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return Inputs(q, cache, tables, seq_lens, list(lens), quant, k_scale_t, v_scale_t, d**-0.5)


def variant_fn(v: Variant, x: Inputs, num_splits: int):
    """A closure that runs variant ``v`` on ``x`` (plus the merge when split) and returns ``out``."""
    q, cache = x.q, x.cache
    batch, hq, head = q.shape
    page, hk = cache.shape[2], cache.shape[3]
    group = hq // hk
    head_pad = triton.next_power_of_2(head)
    fp8 = x.quant is not None
    if fp8:
        assert x.quant.fp8_dtype == torch.float8_e4m3fn, "variants handle e4m3 only"
    else:
        assert cache.dtype == q.dtype, "float pages must match the query dtype"
    if v.kind == "cuda":
        compute, gp, kernel = FP32, triton.next_power_of_2(group), _cuda_core_kernel
    else:
        if fp8:
            compute = BF16 if v.cvt == "bf16" else FP16
        else:
            compute = BF16 if q.dtype == torch.bfloat16 else FP16
        gp = max(v.gp, triton.next_power_of_2(group))
        kernel = _swapped_kernel if v.kind == "swapped" else _dot_kernel
    extra = {"ACC_T": v.acc_t} if v.kind == "swapped" else {}
    out = torch.empty_like(q)
    split = num_splits > 1
    if split:
        part_acc = torch.empty((batch, hq, num_splits, head_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((batch, hq, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    grid = (batch, hk, num_splits)
    args = (
        out, part_acc, part_ml, q, cache, x.tables, x.seq_lens, x.k_scale_t, x.v_scale_t, float(x.scale),
        num_splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), x.tables.stride(0),
    )
    meta = dict(G=group, GP=gp, HEAD=head, HEAD_PAD=head_pad, PAGE=page, TILE_N=v.tile_n, FP8=fp8,
                COMPUTE=compute, SPLIT=split, num_warps=v.warps, num_stages=v.stages, **extra)
    if v.maxnreg:
        meta["maxnreg"] = v.maxnreg
    merge_meta = dict(HEAD=head, HEAD_PAD=head_pad, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
                      num_warps=4 if head_pad >= 128 else 2)

    def fn() -> torch.Tensor:
        fn.compiled = kernel[grid](*args, **meta)  # the CompiledKernel (for its resource usage)
        if split:
            _merge_kernel[(batch, hq)](out, part_acc, part_ml, out.stride(0), out.stride(1), hq, num_splits,
                                       **merge_meta)
        return out

    fn.compiled = None
    return fn


def kernel_resources(fn) -> dict:
    """Registers / spills / shared memory of a variant's compiled kernel, where triton exposes them."""
    k = getattr(fn, "compiled", None)
    res = {}
    for key, get in (("n_regs", lambda: k.n_regs), ("n_spills", lambda: k.n_spills),
                     ("shared_bytes", lambda: k.metadata.shared)):
        try:
            res[key] = int(get())
        except Exception:
            pass
    return res


def production_resources(fn) -> dict:
    """Run the production closure once with its kernel launch recorded; that kernel's resources."""
    from kvserve.kernels import triton_attention as TA

    jit_fn = TA._attention_kernel
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            launch = jit_fn[grid]

            def run(*a, **kw):
                seen.append(launch(*a, **kw))
                return seen[-1]

            return run

    TA._attention_kernel = Recorder()
    try:
        fn()
    finally:
        TA._attention_kernel = jit_fn
    holder = type("H", (), {})()
    holder.compiled = seen[-1] if seen else None
    return kernel_resources(holder)


def existing_fn(x: Inputs, num_splits: int | None = None):
    """The production kernel with its automatic choices (or forced splits)."""
    batch = x.q.shape[0]
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=x.q.device)

    def fn() -> torch.Tensor:
        return paged_attention(x.q, x.cache, x.tables, qsl, x.seq_lens, x.scale, 1, max(x.lens), x.quant,
                               num_splits=num_splits)

    return fn


def reference(x: Inputs, n: int) -> torch.Tensor:
    """Ground truth for the first n sequences."""
    return R.paged_attention(x.q[:n], x.cache, x.tables[:n].long(), [1] * n, x.lens[:n], x.scale, quant=x.quant)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    err = ((out - ref).norm() / ref.norm()).item()
    return err if math.isfinite(err) else float("inf")


def _short(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:400]}"


# --------------------------------------------------------------------------------------------------
# GPU benchmark
# --------------------------------------------------------------------------------------------------


def copy_bandwidth() -> float:
    x = torch.randn(1 << 29, device="cuda", dtype=torch.float32)  # 2 GiB
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    x = y = None  # free the 4 GiB before the benchmark
    torch.cuda.empty_cache()
    return 2 * (1 << 29) * 4 / ms / 1e6  # GB/s, bytes read + written


def gpu_bench(args) -> None:
    variants = QUICK_VARIANTS if args.quick else FULL_VARIANTS
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.only:
        variants = [v for v in variants if args.only in v.name]
    hq, hk, d, bs = 32, 8, 128, 16
    t_start = time.time()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_GBps=bw, hq=hq, hk=hk, head=d, block=bs, quick=bool(args.quick),
                variants=[dict(name=v.name, **asdict(v)) for v in variants])
    print(f"{info['device']}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy bandwidth {bw:.0f} GB/s", flush=True)
    hdr = f"{'batch':>5} {'ctx':>6} {'cache':8} {'variant':36} {'spl':>3} {'us':>9} {'GB/s':>6} {'%copy':>6} " \
          f"{'xbf16':>6} {'xprod':>6} {'err':>8} {'1st s':>6}  status"
    print(hdr, flush=True)
    rows: list[dict] = []
    for batch, ctx in shapes:
        bf16_existing_us = None
        for fp8 in (False, True):
            cache_name = "fp8_e4m3" if fp8 else "bf16"
            x = make_inputs([ctx] * batch, hq, hk, d, bs, fp8, "cuda")
            n_check = min(2, batch)
            ref = reference(x, n_check)
            existing_us = None
            seen_bf16: set = set()
            todo: list[tuple[str, Variant | None]] = [("production (auto)", None)]
            for v in variants:
                if not fp8:
                    if v.bf16_key() in seen_bf16:
                        continue  # identical kernel on bf16 pages
                    seen_bf16.add(v.bf16_key())
                todo.append((v.name, v))
            todo.append(("production (repeat)", None))  # drift check (clocks / thermals) over the group
            for name, v in todo:
                row = dict(batch=batch, ctx=ctx, cache=cache_name, variant=name,
                           config=None if v is None else asdict(v), kv_bytes=x.kv_bytes)
                try:
                    if v is None:
                        splits = choose_num_splits(batch, hk, ctx, x.q.device,
                                                   128 if fp8 else 64)  # what production picks (its tile_n)
                        fn = existing_fn(x, args.splits)
                        if args.splits:
                            splits = args.splits
                    else:
                        splits = args.splits or choose_num_splits(batch, hk, ctx, x.q.device, v.tile_n)
                        fn = variant_fn(v, x, splits)
                    row["num_splits"] = splits
                    t0 = time.time()
                    out = fn()
                    torch.cuda.synchronize()
                    row["first_call_s"] = time.time() - t0
                    row.update(kernel_resources(fn) if v is not None else production_resources(fn))
                    err = rel_err(out[:n_check], ref)
                    row["err"] = err
                    if not err < MAX_REL_ERR:
                        row["status"] = "wrong"
                    else:
                        ms = triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
                        us = ms * 1e3
                        gbs = x.kv_bytes / ms / 1e6
                        row.update(status="ok", us=us, GBps=gbs, pct_copy=100 * gbs / bw)
                        if v is None and existing_us is None:
                            existing_us = us
                            if not fp8:
                                bf16_existing_us = us
                        if bf16_existing_us:
                            row["x_bf16_production"] = bf16_existing_us / us
                        if existing_us:
                            row["x_production_same_cache"] = existing_us / us
                except Exception as e:  # compile error, unsupported op, launch failure
                    row["status"] = "failed"
                    row["error"] = _short(e)
                rows.append(row)
                _print_row(row)
            del x, ref
            torch.cuda.empty_cache()
    info["elapsed_s"] = time.time() - t_start
    info["rows"] = rows
    with open(args.out, "w") as f:
        json.dump(info, f, indent=1)
    _print_summary(rows)
    print(f"wrote {args.out} ({len(rows)} rows, {info['elapsed_s']:.0f} s)", flush=True)


def _fmt(val, spec: str, width: int) -> str:
    return format(val, spec) if isinstance(val, (int, float)) else "-".rjust(width)


def _print_row(r: dict) -> None:
    status = r["status"] + (f" {r['error'][:120]}" if "error" in r else "")
    if "n_regs" in r:
        status += f"  regs {r['n_regs']} spills {r.get('n_spills', '?')} smem {r.get('shared_bytes', 0) // 1024} KB"
    print(f"{r['batch']:5d} {r['ctx']:6d} {r['cache']:8} {r['variant']:36} {r.get('num_splits', 0):3d} "
          f"{_fmt(r.get('us'), '9.1f', 9)} {_fmt(r.get('GBps'), '6.0f', 6)} {_fmt(r.get('pct_copy'), '6.1f', 6)} "
          f"{_fmt(r.get('x_bf16_production'), '6.2f', 6)} {_fmt(r.get('x_production_same_cache'), '6.2f', 6)} "
          f"{_fmt(r.get('err'), '8.1e', 8)} {_fmt(r.get('first_call_s'), '6.1f', 6)}  {status}", flush=True)


def _print_summary(rows: list[dict]) -> None:
    """Best variant per (shape, cache) vs production."""
    print("\nbest per shape (fp8 and bf16):", flush=True)
    keys = sorted({(r["batch"], r["ctx"], r["cache"]) for r in rows})
    for key in keys:
        group = [r for r in rows if (r["batch"], r["ctx"], r["cache"]) == key and r["status"] == "ok"]
        prod = [r for r in group if r["config"] is None]
        var = [r for r in group if r["config"] is not None]
        if not var:
            continue
        best = min(var, key=lambda r: r["us"])
        p = f"{prod[0]['us']:.1f} us ({prod[0]['pct_copy']:.0f}%)" if prod else "-"
        print(f"  b={key[0]:3d} ctx={key[1]:5d} {key[2]:8}  production {p:>20}  best {best['variant']:36} "
              f"{best['us']:.1f} us ({best['pct_copy']:.0f}% copy)", flush=True)


# --------------------------------------------------------------------------------------------------
# CPU check (Triton interpreter)
# --------------------------------------------------------------------------------------------------


def cpu_check(args) -> int:
    from tests.triton_support import interpreter_active, patch_interpreter_dot, patch_interpreter_downcast

    if not interpreter_active():
        print("--cpu-check needs TRITON_INTERPRET=1 before triton is imported", flush=True)
        return 2
    patch_interpreter_downcast()
    patch_interpreter_dot()
    torch.manual_seed(0)
    lens, d, bs = [37, 50, 64, 300], 64, 16  # 300: several tiles (online softmax) even at TILE_N 128
    cases = []
    for hq, hk in ((8, 2), (8, 4)):
        for fp8 in (False, True):
            # larger k_scale than the GPU run so the softmax is far from uniform
            x = make_inputs(lens, hq, hk, d, bs, fp8, "cpu", k_scale=0.25, v_scale=0.07)
            cases.append((f"Hq{hq}/Hk{hk} {'fp8' if fp8 else 'bf16'}", x, reference(x, len(lens))))
    variants = FULL_VARIANTS
    if args.only:
        variants = [v for v in variants if args.only in v.name]
    todo: list[tuple[str, Variant | None]] = [("production", None)] + [(v.name, v) for v in variants]
    n_fail = 0
    t_all = time.time()
    for name, v in todo:
        t0 = time.time()
        worst, status, detail = 0.0, "pass", ""
        for case_name, x, ref in cases:
            for splits in (1, 3):
                try:
                    fn = existing_fn(x, splits) if v is None else variant_fn(v, x, splits)
                    err = rel_err(fn(), ref)
                except Exception as e:
                    status, detail = "interpreter-error", f"{case_name} splits={splits}: {_short(e)}"
                    break
                worst = max(worst, err)
                if not err < MAX_REL_ERR and status == "pass":
                    status, detail = "FAIL", f"{case_name} splits={splits}: err {err:.2e}"
            if status == "interpreter-error":
                break
        n_fail += status != "pass"
        print(f"{name:36} {status:17} max err {worst:.1e}  {time.time() - t0:5.1f} s  {detail}", flush=True)
    print(f"{len(todo)} kernels, {n_fail} not passing, {time.time() - t_all:.0f} s", flush=True)
    return 1 if n_fail else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON output file (GPU benchmark)")
    ap.add_argument("--quick", action="store_true", help="~6 variant configs on 2 shapes")
    ap.add_argument("--cpu-check", action="store_true", help="check every variant under the Triton interpreter")
    ap.add_argument("--only", default=None, help="only variants whose name contains this")
    ap.add_argument("--splits", type=int, default=None, help="force num_splits (default: production's policy)")
    ap.add_argument("--warmup", type=int, default=20, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=int, default=80, help="do_bench rep (ms)")
    args = ap.parse_args()
    if args.cpu_check:
        return cpu_check(args)
    if not torch.cuda.is_available():
        ap.error("no CUDA device: use --cpu-check (under TRITON_INTERPRET=1)")
    if not args.out:
        ap.error("--out FILE.json is required")
    gpu_bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
