"""Triton unified paged attention over bf16/fp16/fp32 or fp8 pages.

One kernel serves a mixed batch: prefill chunks over their cached context and decode tokens. A
program owns ``BLOCK_Q = BLOCK_M // G`` query tokens of one sequence times the ``G = Hq / Hk`` query
heads that share one KV head (``BLOCK_Q * G`` of its ``BLOCK_M`` rows), and walks that sequence's
pages in tiles of ``TILE_N`` tokens (a tile may span several pages; each token's page comes from
the block table). fp8 pages are read through an fp8 view of their bytes (so the K tile's loads feed
the MMA's shared memory directly; bytes bitcast after the load took a register round trip), converted
exactly to the query dtype, and the per-tensor scales are applied to the fp32 scores (``k_scale``)
and to the fp32 output (``v_scale``); or, with
``CacheQuant.query_fp8`` (vLLM's FLASH_ATTN / TRITON_ATTN on CUDA, e4m3 pages), the query is
rounded to e4m3 with ``q_scale`` as vLLM's QuantFP8 does, both products are fp8 dots, and P is scaled
by 2^p_shift (FlashAttention 3's Max_offset, 8) and rounded to e4m3 for P @ V, as FA3 does; its twin
is ``reference.paged_attention_fp8_query``. Softmax and accumulation run in fp32 (online softmax,
base 2).

Split-KV (flash-decoding): the KV range of each program can be cut into ``num_splits`` parts that
run as separate programs; a second kernel merges their partial results. Chosen automatically for
decode-only batches whose (sequences x KV heads) would not fill the GPU. Decode-only batches launch
one program per (sequence, KV head) in a given order (longest first, ``layers.attention.decode_order``).

Same contract as ``reference.paged_attention``: sequence i owns query rows
``query_start_loc[i]:query_start_loc[i+1]`` at positions ``seq_lens[i] - query_len_i ..
seq_lens[i] - 1``, causal over its cached context plus itself. Every launch is CUDA-graph safe:
the grid depends only on the number of tokens, sequences and splits, never on lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels import pdl
from kvserve.kernels.reference import CacheQuant
from kvserve.kernels.triton_store import num_sms

_LOG2E = 1.4426950408889634
# The quantized-query read's P @ V as an fp8 MMA (True) or an fp16 MMA on the same e4m3 values (the
# same products, fp32 sums): fp16, since the fp8 one stages V transposed and was 1.4-2.6x slower in
# every prefill on the H200 (head 128 / 256, 1k / 4k tokens: 1,047 vs 495 us at head 128, 4,096 tokens;
# benchmarks/RESULTS.md, 2026-12-06) and no faster in decode. Pages holding V transposed (keys
# contiguous, the K-major operand the fp8 MMA takes) were slower still in decode, prefill and the
# store on the H200 (benchmarks/HISTORY.md, fifth 2026-12-06 session).
PV_FP8 = False
# Launch the query blocks last-first (a causal prefill's longest blocks first): 3-13% faster prefills
# at 15 of 16 H200 probe points (reads x heads 128 / 256 x 1k / 4k tokens; bf16 head 128 x 1k 2.5%
# slower; 2026-12-06); decode programs carry one token each.
HEAVY_FIRST = True
# The quantized query's Q K^T as an fp16 MMA on the e4m3 values below this many rows a program
# (decode tiles: mma.sync, where an fp8 operand is converted anyway, and its fp8 K tile spilled
# at 128 keys); wgmma tiles (64+ rows) multiply the fp8 operands on fp8 tensor cores.
FP16_MMA_BELOW_ROWS = 64
# fp8 pages' decode (both reads) by ``_paired_decode_kernel``: the pages read as 16-bit words, each
# an even and an odd head column of one token, and both products run on the even and the odd
# columns apart. The words reach an fp16 MMA's registers by ldmatrix and convert with one byte
# permute and two paired conversions per two words, where e4m3 tiles were gathered into that layout
# from shared memory a byte at a time (sm_90 SASS, Triton 3.9, 128-key tile: 544 instructions a warp
# against 899, 21 shared loads against 184). On an H100 (2026-12-07, clean L2) it is 1-5% faster than
# the unpaired decode at every batch 32-256 x context 1k-16k point, both reads (benchmarks/RESULTS.md).
PAIRED_DECODE = True


@triton.jit
def _find_seq(query_start_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest sequence index i with ``query_start[i] // BLOCK_Q + i <= target`` (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        val = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if val <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _shifted(m, P_SHIFT: tl.constexpr):
    """The exponent P is taken against: the row max, less P_SHIFT (P = 2^(s - m + P_SHIFT))."""
    if P_SHIFT == 0:
        return m
    return m - P_SHIFT


@triton.jit
def _decode_program(query_start_ptr, order_ptr, HK: tl.constexpr, ORDERED: tl.constexpr):
    """A decode-only batch's program i: (sequence, KV head, its token's row, its token count) for
    sequence rank i // HK and KV head i % HK, no search; with ORDERED the ranks index ``order``
    (longest sequences first: the GPU starts programs in launch order, so the long ones start first
    and the short ones fill in at the end)."""
    rank = tl.program_id(0) // HK
    kv_head = tl.program_id(0) % HK
    if ORDERED:
        seq = tl.load(order_ptr + rank)
    else:
        seq = rank
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    return seq, kv_head, q_start, q_len


@triton.jit
def _split_tiles(num_keys, split, num_splits, TILE_N: tl.constexpr):
    """The key tiles [lo, hi) of split-KV part ``split`` of ``num_splits``: each part takes
    ``cdiv(tiles, num_splits)`` consecutive tiles of ``TILE_N`` keys (the twin splits the same way)."""
    num_tiles = tl.cdiv(num_keys, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    return tile_lo, tl.minimum(tile_lo + tiles_per_split, num_tiles)


@triton.jit
def _load_kv_tile(
    t, num_keys, cache_ptr, table, kv_head, stride_cb, stride_ckv, stride_cs, stride_ch,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr,
):
    """Key positions ``n`` [TILE_N] of tile ``t`` and its K and V [TILE_N, HEAD_PAD] from the pages
    (each token's page from the block table ``table``). ``MASKED``: keys at or past ``num_keys`` read
    as 0; else every key is in range and only padded head columns are masked."""
    n = t * TILE_N + tl.arange(0, TILE_N)
    d = tl.arange(0, HEAD_PAD)
    if MASKED:
        n_ok = n < num_keys
        page = tl.load(table + n // PAGE, mask=n_ok, other=0)
        kv_mask = n_ok[:, None] & (d < HEAD)[None, :]
    else:
        page = tl.load(table + n // PAGE)
        kv_mask = (n >= 0)[:, None] & (d < HEAD)[None, :]  # only the padded head columns
    off = page.to(tl.int64) * stride_cb + (n % PAGE) * stride_cs + kv_head * stride_ch
    if HEAD_PAD == HEAD and not MASKED:
        k = tl.load(cache_ptr + off[:, None] + d[None, :])
        v = tl.load(cache_ptr + stride_ckv + off[:, None] + d[None, :])
    else:
        k = tl.load(cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + stride_ckv + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return n, k, v


@triton.jit
def _softmax_update(s, m_i, l_i, n, q_pos, num_keys, scale2, MASKED: tl.constexpr, IEEE: tl.constexpr,
                    P_SHIFT: tl.constexpr):
    """Online softmax (base 2) over a tile's raw scores ``s`` [rows, keys at ``n``]: the new running
    max, the new running sum, P and the rescale ``alpha`` of what came before. ``MASKED``: keys past
    ``num_keys`` or after a row's position get -inf; else the score scale folds into one FMA per
    score (``IEEE``: float32 models keep the masked path's roundings)."""
    if MASKED:
        s = s * scale2
        visible = (n[None, :] <= q_pos[:, None]) & (n < num_keys)[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - _shifted(m_safe, P_SHIFT)[:, None])
    elif IEEE:
        s = s * scale2
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = m_new
        p = tl.exp2(s - _shifted(m_safe, P_SHIFT)[:, None])
    else:  # (scale2 > 0, so the max commutes with it)
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale2)
        m_safe = m_new
        p = tl.exp2(s * scale2 - _shifted(m_safe, P_SHIFT)[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(p, axis=1), p, alpha


@triton.jit
def _attend_tile(
    t, m_i, l_i, acc, q, q_pos, num_keys, scale2, cache_ptr, table, kv_head,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr,
    FP8: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr,
    QUERY_FP8: tl.constexpr, P_SHIFT: tl.constexpr, PV_FP8: tl.constexpr, FP16_MMA: tl.constexpr,
):
    """One tile of ``TILE_N`` keys: scores, online-softmax update (base 2), P @ V. ``MASKED``
    False: every key of the tile is in range and visible to every row (no masks, no -inf).
    ``QUERY_FP8``: q is e4m3, K and V stay e4m3 (fp8 MMAs), P is scaled by 2^P_SHIFT and rounded to
    e4m3 for P @ V, l summing P before that rounding (FlashAttention 3's order). ``PV_FP8`` False
    runs P @ V on those values in fp16 (exact: e4m3 values and their products are exact in fp16 and
    fp32), so V needs no transpose for an fp8 MMA (which takes V's keys contiguous); ``FP16_MMA``
    runs Q K^T that way too (q arrives as fp16 copies of its e4m3 values)."""
    n, k, v = _load_kv_tile(t, num_keys, cache_ptr, table, kv_head, stride_cb, stride_ckv, stride_cs, stride_ch,
                            HEAD, HEAD_PAD, PAGE, TILE_N, MASKED)
    if not QUERY_FP8 or FP16_MMA:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if IEEE and not QUERY_FP8:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    m_new, l_i, p, alpha = _softmax_update(s, m_i, l_i, n, q_pos, num_keys, scale2, MASKED, IEEE, P_SHIFT)
    if QUERY_FP8 and PV_FP8:
        pv = tl.dot(p.to(tl.float8e4nv), v)
    elif QUERY_FP8:
        pv = tl.dot(p.to(tl.float8e4nv).to(tl.float16), v.to(tl.float16))
    elif IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


def _pairs_to_f16_ptx(fmt: str) -> str:
    """Two 16-bit words of two ``fmt`` bytes each -> the even bytes' fp16 pair and the odd bytes'."""
    return f"""{{
    .reg .b32 a;
    .reg .b16 lo, hi;
    prmt.b32 a, $2, 0, 0x3120;
    mov.b32 {{lo, hi}}, a;
    cvt.rn.f16x2.{fmt}x2 $0, lo;
    cvt.rn.f16x2.{fmt}x2 $1, hi;
    }}"""


_PAIRS_E4M3 = tl.constexpr(_pairs_to_f16_ptx("e4m3"))
_PAIRS_E5M2 = tl.constexpr(_pairs_to_f16_ptx("e5m2"))


@triton.jit
def _inline_pairs_to_f16(x, PTX: tl.constexpr):
    return tl.inline_asm_elementwise(asm=PTX, constraints="=r,=r,r", args=[x], dtype=(tl.float16, tl.float16),
                                     is_pure=True, pack=2)


@triton.jit
def _fp8_pairs_to_f16(x, ASM: tl.constexpr, E5M2: tl.constexpr):
    """16-bit words of two fp8 bytes (an even and an odd head column) -> (the even bytes, the odd
    bytes) as fp16, exactly. ``ASM`` (sm_89+): one byte permute and two paired conversions per two
    words, taking the words as ldmatrix leaves them; else Triton's casts (the interpreter, sm_80)."""
    if ASM:
        if E5M2:
            return _inline_pairs_to_f16(x, _PAIRS_E5M2)
        return _inline_pairs_to_f16(x, _PAIRS_E4M3)
    fp8: tl.constexpr = tl.float8e5 if E5M2 else tl.float8e4nv
    even = (x & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float16)
    odd = (x >> 8).to(tl.uint8).to(fp8, bitcast=True).to(tl.float16)
    return even, odd


@triton.jit
def _attend_paired_tile(
    t, m_i, l_i, acc_e, acc_o, q_e, q_o, q_pos, num_keys, scale2, cache_ptr, table, kv_head,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr,
    QUERY_FP8: tl.constexpr, P_SHIFT: tl.constexpr, ASM: tl.constexpr, E5M2: tl.constexpr,
):
    """``_attend_tile`` for the paired decode: K and V read as 16-bit words (cache strides in words),
    the even and odd head columns kept apart (``q_e`` / ``q_o``, ``acc_e`` / ``acc_o``); the scores
    sum both halves' products (fp32 MMA sums, the same products as one dot in another order)."""
    # the words of a tile: HEAD // 2 columns of two bytes each
    n, k, v = _load_kv_tile(t, num_keys, cache_ptr, table, kv_head, stride_cb, stride_ckv, stride_cs, stride_ch,
                            HEAD // 2, HEAD_PAD // 2, PAGE, TILE_N, MASKED)
    k_e, k_o = _fp8_pairs_to_f16(k, ASM, E5M2)
    v_e, v_o = _fp8_pairs_to_f16(v, ASM, E5M2)
    s = tl.dot(q_o, tl.trans(k_o), acc=tl.dot(q_e, tl.trans(k_e)))
    m_new, l_i, p, alpha = _softmax_update(s, m_i, l_i, n, q_pos, num_keys, scale2, MASKED, False, P_SHIFT)
    if QUERY_FP8:
        p16 = p.to(tl.float8e4nv).to(tl.float16)  # e4m3-rounded P, exact in fp16
    else:
        p16 = p.to(tl.float16)
    acc_e = acc_e * alpha[:, None] + tl.dot(p16, v_e)
    acc_o = acc_o * alpha[:, None] + tl.dot(p16, v_o)
    return m_new, l_i, acc_e, acc_o


@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "num_splits", "stride_qt", "stride_ot"])
def _paired_decode_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr,
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, order_ptr,
    k_scale_ptr, v_scale_ptr, q_scale_ptr, inv_q_scale_ptr, qk_scale,
    num_seqs,  # (the grid has one program per sequence x KV head: unused, as in ``_attention_kernel``'s decode)
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    stride_bt,
    num_splits,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr, QUERY_FP8: tl.constexpr, P_SHIFT: tl.constexpr,
    ORDERED: tl.constexpr, HK: tl.constexpr, ASM: tl.constexpr, E5M2: tl.constexpr,
):
    """A decode-only batch over fp8 pages (both reads), one program per (sequence, KV head[, split]):
    ``_attention_kernel``'s decode with the pages read in 16-bit words (``PAIRED_DECODE``): the same
    query rounding, scales, online softmax and epilogue, the head columns as even / odd halves."""
    pdl.start(PDL)
    split = tl.program_id(2)
    seq, kv_head, q_start, q_len = _decode_program(query_start_ptr, order_ptr, HK, ORDERED)
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = rows // G
    head = kv_head * G + rows % G
    row_ok = (tok < q_len) & (rows < BLOCK_Q * G)
    q_pos = context + tok
    j = tl.arange(0, HEAD_PAD // 2)
    j_ok = j < HEAD // 2
    q_at = q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + 2 * j[None, :]
    q_e = tl.load(q_at, mask=row_ok[:, None] & j_ok[None, :], other=0.0)
    q_o = tl.load(q_at + 1, mask=row_ok[:, None] & j_ok[None, :], other=0.0)
    if QUERY_FP8:
        inv_q_scale = tl.load(inv_q_scale_ptr)
        q_e = tl.minimum(tl.maximum(q_e.to(tl.float32) * inv_q_scale, -448.0), 448.0).to(tl.float8e4nv)
        q_o = tl.minimum(tl.maximum(q_o.to(tl.float32) * inv_q_scale, -448.0), 448.0).to(tl.float8e4nv)
        q_e = q_e.to(tl.float16)
        q_o = q_o.to(tl.float16)
        scale2 = (qk_scale * 1.4426950408889634) * (tl.load(q_scale_ptr) * tl.load(k_scale_ptr))
    else:
        # the dequantizing read's power-of-two query scaling into fp16 range (``_attention_kernel``)
        qe32 = q_e.to(tl.float32)
        qo32 = q_o.to(tl.float32)
        q_max = tl.maximum(tl.max(tl.max(tl.abs(qe32), axis=1), axis=0), tl.max(tl.max(tl.abs(qo32), axis=1), axis=0))
        e = ((q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.minimum(tl.maximum(e, -100), 100)
        q_mul = ((127 + 14 - e) << 23).to(tl.float32, bitcast=True)
        q_e = (qe32 * q_mul).to(tl.float16)
        q_o = (qo32 * q_mul).to(tl.float16)
        k_mul = qk_scale * tl.load(k_scale_ptr)
        k_mul = k_mul / q_mul
        scale2 = k_mul * 1.4426950408889634
    v_mul = tl.load(v_scale_ptr)

    num_keys = context + tl.minimum(BLOCK_Q, q_len)
    tile_lo, tile_hi = _split_tiles(num_keys, split, num_splits, TILE_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_e = tl.zeros([BLOCK_M, HEAD_PAD // 2], tl.float32)
    acc_o = tl.zeros([BLOCK_M, HEAD_PAD // 2], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    if SPLIT:
        for t in range(tile_lo, tile_hi):
            m_i, l_i, acc_e, acc_o = _attend_paired_tile(
                t, m_i, l_i, acc_e, acc_o, q_e, q_o, q_pos, num_keys, scale2, cache_ptr, table, kv_head,
                stride_cb, stride_ckv, stride_cs, stride_ch, HEAD, HEAD_PAD, PAGE, TILE_N, True,
                QUERY_FP8, P_SHIFT, ASM, E5M2,
            )
    else:
        full_end = tl.minimum(tl.maximum(context // TILE_N, tile_lo), tile_hi)
        for t in range(tile_lo, full_end):
            m_i, l_i, acc_e, acc_o = _attend_paired_tile(
                t, m_i, l_i, acc_e, acc_o, q_e, q_o, q_pos, num_keys, scale2, cache_ptr, table, kv_head,
                stride_cb, stride_ckv, stride_cs, stride_ch, HEAD, HEAD_PAD, PAGE, TILE_N, False,
                QUERY_FP8, P_SHIFT, ASM, E5M2,
            )
        for t in range(full_end, tile_hi):
            m_i, l_i, acc_e, acc_o = _attend_paired_tile(
                t, m_i, l_i, acc_e, acc_o, q_e, q_o, q_pos, num_keys, scale2, cache_ptr, table, kv_head,
                stride_cb, stride_ckv, stride_cs, stride_ch, HEAD, HEAD_PAD, PAGE, TILE_N, True,
                QUERY_FP8, P_SHIFT, ASM, E5M2,
            )

    out_row = q_start + tok
    if not SPLIT:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        if QUERY_FP8:
            w = ((1.0 / l_safe) * v_mul)[:, None]
            o_e = acc_e * w
            o_o = acc_o * w
        else:
            o_e = acc_e / l_safe[:, None] * v_mul
            o_o = acc_o / l_safe[:, None] * v_mul
        at = out_ptr + out_row[:, None] * stride_ot + head[:, None] * stride_oh + 2 * j[None, :]
        mask = row_ok[:, None] & j_ok[None, :]
        tl.store(at, o_e.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(at + 1, o_o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (out_row * (G * HK) + head) * num_splits + split
        at = part_acc_ptr + part[:, None] * HEAD_PAD + 2 * j[None, :]
        tl.store(at, acc_e * v_mul, mask=row_ok[:, None])
        tl.store(at + 1, acc_o * v_mul, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


# Lengths and batch-dependent values are not specialized (Triton would compile a variant per
# divisibility class of each, mid-serving); model-constant strides and sizes are.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "num_splits", "stride_qt", "stride_ot"])
def _attention_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr,
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, order_ptr,
    k_scale_ptr, v_scale_ptr, q_scale_ptr, inv_q_scale_ptr, qk_scale,
    num_seqs,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    stride_bt,
    num_splits,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    PAGE: tl.constexpr, TILE_N: tl.constexpr,
    FP8: tl.constexpr, IEEE: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr, QUERY_FP8: tl.constexpr, P_SHIFT: tl.constexpr, PV_FP8: tl.constexpr,
    HEAVY_FIRST: tl.constexpr, FP16_MMA: tl.constexpr, DECODE: tl.constexpr, ORDERED: tl.constexpr,
    HK: tl.constexpr,
):
    pdl.start(PDL)
    split = tl.program_id(2)
    if DECODE:
        seq, kv_head, q_start, q_len = _decode_program(query_start_ptr, order_ptr, HK, ORDERED)
        q_off = 0
    else:
        # the GPU starts programs in launch order: HEAVY_FIRST launches the longest causal blocks
        # first, the short ones fill in
        if HEAVY_FIRST:
            q_block = tl.num_programs(0) - 1 - tl.program_id(0)
        else:
            q_block = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = _find_seq(query_start_ptr, q_block, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        q_off = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
        if q_off >= q_len:
            return
    # (decode programs go on without waiting for q_len: a sequence without a token masks every row)
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_off + rows // G  # query token of each row, within the sequence's chunk
    head = kv_head * G + rows % G
    row_ok = (tok < q_len) & (rows < BLOCK_Q * G)  # G need not be a power of two
    q_pos = context + tok  # absolute position of each row's token
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD

    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if QUERY_FP8:
        # vLLM's static query quantization (QuantFP8): e4m3(clamp(float32(q) * (1 / q_scale), -448, 448)),
        # round to nearest even; the descales go into the log2-domain score scale as FlashAttention
        # 3 folds them: (scale log2 e)(q_scale k_scale)
        q = tl.minimum(tl.maximum(q.to(tl.float32) * tl.load(inv_q_scale_ptr), -448.0), 448.0).to(tl.float8e4nv)
        if FP16_MMA:
            q = q.to(tl.float16)  # exact: every e4m3 value is an fp16 value
        v_mul = tl.load(v_scale_ptr)
    elif FP8:
        k_mul = qk_scale * tl.load(k_scale_ptr)
        v_mul = tl.load(v_scale_ptr)
        if not IEEE:
            # fp8 pages convert to fp16 in one instruction per pair (to bf16 it takes several), and
            # fp16 holds every fp8 value exactly. The query is brought into fp16 range by a power of
            # two 2^(14 - e), e = floor(log2 max|q|), exact for bf16 values; the scores undo it.
            qf = q.to(tl.float32)
            q_max = tl.max(tl.max(tl.abs(qf), axis=1), axis=0)
            e = ((q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            e = tl.minimum(tl.maximum(e, -100), 100)
            q_mul = ((127 + 14 - e) << 23).to(tl.float32, bitcast=True)
            q = (qf * q_mul).to(tl.float16)
            k_mul = k_mul / q_mul
    else:
        k_mul = qk_scale
        v_mul = 1.0

    # Keys this block can see: its context plus its own chunk up to its last token.
    num_keys = context + tl.minimum(q_off + BLOCK_Q, q_len)
    tile_lo, tile_hi = _split_tiles(num_keys, split, num_splits, TILE_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    if QUERY_FP8:
        scale2 = (qk_scale * 1.4426950408889634) * (tl.load(q_scale_ptr) * tl.load(k_scale_ptr))
    else:
        scale2 = k_mul * 1.4426950408889634  # scores to the log2 domain
    if SPLIT:  # (split-KV parts: one masked loop measured faster, benchmarks/HISTORY.md, attention A/B)
        for t in range(tile_lo, tile_hi):
            m_i, l_i, acc = _attend_tile(
                t, m_i, l_i, acc, q, q_pos, num_keys, scale2, cache_ptr, table, kv_head,
                stride_cb, stride_ckv, stride_cs, stride_ch,
                HEAD, HEAD_PAD, PAGE, TILE_N, FP8, IEEE, True, QUERY_FP8, P_SHIFT, PV_FP8, FP16_MMA,
            )
    else:
        # Tiles wholly before this block's first query token are visible to every row and in
        # range: no masks there (per-element work bounds the fp8 kernel); the rest masked.
        full_end = tl.minimum(tl.maximum((context + q_off) // TILE_N, tile_lo), tile_hi)
        for t in range(tile_lo, full_end):
            m_i, l_i, acc = _attend_tile(
                t, m_i, l_i, acc, q, q_pos, num_keys, scale2, cache_ptr, table, kv_head,
                stride_cb, stride_ckv, stride_cs, stride_ch,
                HEAD, HEAD_PAD, PAGE, TILE_N, FP8, IEEE, False, QUERY_FP8, P_SHIFT, PV_FP8, FP16_MMA,
            )
        for t in range(full_end, tile_hi):
            m_i, l_i, acc = _attend_tile(
                t, m_i, l_i, acc, q, q_pos, num_keys, scale2, cache_ptr, table, kv_head,
                stride_cb, stride_ckv, stride_cs, stride_ch,
                HEAD, HEAD_PAD, PAGE, TILE_N, FP8, IEEE, True, QUERY_FP8, P_SHIFT, PV_FP8, FP16_MMA,
            )

    out_row = q_start + tok
    if not SPLIT:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        if QUERY_FP8:
            o = acc * ((1.0 / l_safe) * v_mul)[:, None]  # (FlashAttention 3's finalize)
        else:
            o = acc / l_safe[:, None] * v_mul
        tl.store(
            out_ptr + out_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # Partials: acc [T, Hq, S, HEAD_PAD] (unnormalized, v-scaled), (m, l) [T, Hq, S, 2].
        part = (out_row * (G * HK) + head) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc * v_mul, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, stride_ot, stride_oh, num_heads, num_splits,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits of one row."""
    pdl.start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    base = (t * num_heads + h) * num_splits
    m = tl.load(part_ml_ptr + (base + s) * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    d = tl.arange(0, HEAD_PAD)
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l * w, axis=0)
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, (num / den).to(out_ptr.dtype.element_ty), mask=d < HEAD)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device, tile_n: int = 64) -> int:
    """Split-KV parts for a decode-only batch: enough programs for ~4 per multiprocessor, each part
    at least 4 tiles of keys; 1 (no split) off CUDA or when the batch already fills the GPU."""
    if device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    target = 4 * num_sms(device)
    if programs >= target:
        return 1
    by_work = max(1, triton.cdiv(max_seq_len, 4 * tile_n))
    return int(max(1, min(triton.cdiv(target, programs), by_work, 32)))


def _tile_config(
    max_query_len: int, group: int, head_pad: int, is_cuda: bool, fp8: bool = False, split: bool = False,
    ieee: bool = False,
) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages, maxnreg; 0 = no cap) for the batch shape (tuned on
    the H200 with probes now in git history, findings in benchmarks/HISTORY.md: decode
    tiles of ~16 KB of K per stage; bf16 split-KV parts read 128-key tiles, 9-35% faster there;
    fp8 two stages, and at most 168 registers per thread: 3 programs per multiprocessor instead
    of 2 at G <= 2 (204 registers uncapped), 10% faster, no spills). The quantized-query read
    decodes in the same tiles: its fp16 MMAs on the e4m3 values fit the cap with no spill (ptxas for
    sm_90, Triton 3.6, docs/GPU.md)."""
    g = triton.next_power_of_2(group)
    if max_query_len == 1:
        block_m = max(16, g)  # one decode token x G heads, padded for tl.dot
        if fp8:
            tile_n = 128 if head_pad <= 128 else 64
            return block_m, tile_n, 4, (2 if is_cuda else 1), (168 if head_pad <= 128 else 0)
        tile_n = (128 if split else 64) if head_pad <= 128 else 32
        return block_m, tile_n, 4, ((2 if split else 3) if is_cuda else 1), 0
    if head_pad > 128 and not ieee:
        # head 256 (Qwen3.5 / 3.6, G = 6): 128 rows x 64 keys, 8 warps; 1.8-2.4x the 32 x 32 tiles
        # (probe at e098b49, benchmarks/HISTORY.md); float32 keeps the small tiles (shared memory)
        return max(128, g), 64, 8, (2 if is_cuda else 1), 0
    block_m = max(64, g) if head_pad <= 128 else max(32, g)
    tile_n = 64 if head_pad <= 128 else 32
    return block_m, tile_n, (4 if block_m <= 64 else 8), (2 if is_cuda else 1), 0


def fp8_query_key_tile(
    query: torch.Tensor, kv_cache: torch.Tensor, max_query_len: int, is_cuda: bool, split: bool = False,
) -> int:
    """The key tile of the quantized-query read for this batch shape, as ``paged_attention`` picks it
    on a CUDA device (``is_cuda``) or off one: the twin (``reference.paged_attention_fp8_query``)
    rounds P per tile, so it takes this tile."""
    group, head_pad = query.shape[1] // kv_cache.shape[3], triton.next_power_of_2(query.shape[2])
    return _tile_config(max_query_len, group, head_pad, is_cuda, True, split, query.dtype == torch.float32)[1]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    quant: CacheQuant | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tiles: tuple[int, ...] | None = None,
    pv_fp8: bool | None = None,
    heavy_first: bool | None = None,
    fp16_mma: bool | None = None,
    order: torch.Tensor | None = None,
    paired: bool | None = None,
) -> torch.Tensor:
    """Causal paged attention of every sequence's new tokens; see the module docstring.

    query [T, Hq, D]; kv_cache [NB, 2, BS, Hk, D] (uint8 for fp8, with ``quant``); block_tables
    [B, M] int32; query_start_loc [B + 1] int32; seq_lens [B] int32. ``num_splits`` None picks
    split-KV automatically for decode-only batches; an int forces it. ``tiles`` overrides the
    (BLOCK_M, TILE_N, num_warps, num_stages[, maxnreg]) choice (for tuning); ``pv_fp8`` the
    quantized-query read's P @ V MMA (fp8, or fp16 on the same values; None: ``PV_FP8``);
    ``fp16_mma`` both of its MMAs in fp16 on the e4m3 values (None: below ``FP16_MMA_BELOW_ROWS``
    rows a program); ``paired`` fp8 pages' decode by ``_paired_decode_kernel`` (None: ``PAIRED_DECODE``);
    ``heavy_first`` the launch order of the query blocks (None: ``HEAVY_FIRST``).
    Decode-only batches (``max_query_len`` 1) run one program per (sequence, KV head), in the
    order of ``order`` [B] int32 where given (a permutation of the sequences, longest first:
    ``layers.attention.decode_order``), else in batch order. Returns ``out`` [T, Hq, D]."""
    num_tokens, num_heads, head = query.shape
    _, _, page, num_kv_heads, head_c = kv_cache.shape
    assert head_c == head and num_heads % num_kv_heads == 0, "query / cache shapes do not match"
    assert kv_cache.stride(-1) == 1 and query.stride(-1) == 1
    if quant is not None:
        assert kv_cache.dtype == torch.uint8, "an fp8 cache is stored as uint8"
    else:
        assert kv_cache.dtype == query.dtype or kv_cache.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    head_pad = triton.next_power_of_2(head)
    is_cuda = query.device.type == "cuda"
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device) if max_query_len == 1 else 1
    block_m, tile_n, num_warps, num_stages, *maxnreg = tiles or _tile_config(
        max_query_len, group, head_pad, is_cuda, quant is not None, num_splits > 1, query.dtype == torch.float32,
    )
    launch_opts = {"maxnreg": maxnreg[0]} if is_cuda and maxnreg and maxnreg[0] else {}
    block_q = block_m // group  # G = 6 (head 256): 21 tokens, 126 of 128 rows busy (G padded to 8: 16 tokens, 96)
    fp8 = quant is not None
    query_fp8 = fp8 and quant.query_fp8
    # the quantized query's products as fp16 MMAs (both of them: V is then fp16 for P @ V too)
    fp16_mma_on = query_fp8 and (block_m < FP16_MMA_BELOW_ROWS if fp16_mma is None else fp16_mma)
    if quant is None:
        cache = kv_cache  # (a float cache of another dtype than the query converts in-kernel)
        k_scale_t = v_scale_t = q_scale_t = inv_q_scale_t = seq_lens  # unused placeholders (never read)
    else:
        # the pages' bytes as fp8 values: loads then feed the MMAs' shared memory directly (cp.async), where
        # bytes bitcast after the load took a register round trip into a second shared buffer (sm_90 TTGIR)
        cache = kv_cache.view(quant.fp8_dtype)
        k_scale_t, v_scale_t = quant.k_scale_t, quant.v_scale_t
        q_scale_t, inv_q_scale_t = quant.q_scale_t, quant.inv_q_scale_t
    if num_splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((num_tokens, num_heads, num_splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused
    decode = max_query_len == 1
    if decode:
        grid = (num_seqs * num_kv_heads, 1, num_splits)
        assert order is None or order.shape == (num_seqs,), "order: one entry per sequence"
    else:
        grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    ordered = decode and order is not None
    paired = decode and fp8 and query.dtype != torch.float32 and head % 2 == 0 and (
        PAIRED_DECODE if paired is None else paired)
    if paired:
        cache = kv_cache.view(torch.uint16)  # two fp8 bytes a word: strides in words
    args = [out, part_acc, part_ml, query, cache, block_tables, seq_lens, query_start_loc,
            order if ordered else seq_lens, k_scale_t, v_scale_t, q_scale_t, inv_q_scale_t, float(scale), num_seqs,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), block_tables.stride(0), num_splits]
    common = dict(G=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD=head, HEAD_PAD=head_pad, PAGE=page, TILE_N=tile_n,
                  SPLIT=num_splits > 1, QUERY_FP8=query_fp8, P_SHIFT=quant.p_shift if query_fp8 else 0,
                  ORDERED=ordered, HK=num_kv_heads, num_warps=num_warps, num_stages=num_stages, **launch_opts,
                  **pdl.launch_options(query.device))
    if paired:
        _paired_decode_kernel[grid](
            *args, ASM=is_cuda and torch.cuda.get_device_capability(query.device) >= (8, 9),
            E5M2=quant.fp8_dtype == torch.float8_e5m2, **common,
        )
    else:
        _attention_kernel[grid](
            *args, FP8=fp8, IEEE=query.dtype == torch.float32,
            PV_FP8=(PV_FP8 if pv_fp8 is None else pv_fp8) and not fp16_mma_on,
            HEAVY_FIRST=HEAVY_FIRST if heavy_first is None else heavy_first,
            FP16_MMA=fp16_mma_on, DECODE=decode, **common,
        )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_ml, out.stride(0), out.stride(1), num_heads, num_splits,
            HEAD=head, HEAD_PAD=head_pad, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4 if head_pad >= 128 else 2, **pdl.launch_options(query.device),
        )
    return out
