"""Probe: decode attention with the products swapped (S^T = K Q^T, O^T = V^T P^T) so that the keys are
the MMA's 64-row side: fp8 wgmma on K as stored (dims contiguous = K-major), the query the 16-wide side."""
import triton
import triton.language as tl


@triton.jit
def _tile(t, m_i, l_i, acc, qT, seq_len, scale2, cache_ptr, table, kv_head,
          stride_cb, stride_ckv, stride_cs, stride_ch, vt_ptr, stride_vb, stride_vh,
          HEAD: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr, P_SHIFT: tl.constexpr,
          PV_MODE: tl.constexpr, MASKED: tl.constexpr):
    n = t * TILE_N + tl.arange(0, TILE_N)
    d = tl.arange(0, HEAD)
    if MASKED:
        n_ok = n < seq_len
        page = tl.load(table + n // PAGE, mask=n_ok, other=0)
    else:
        page = tl.load(table + n // PAGE)
    off = page.to(tl.int64) * stride_cb + (n % PAGE) * stride_cs + kv_head * stride_ch
    if MASKED:
        k = tl.load(cache_ptr + off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(cache_ptr + stride_ckv + off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
    else:
        k = tl.load(cache_ptr + off[:, None] + d[None, :])
        v = tl.load(cache_ptr + stride_ckv + off[:, None] + d[None, :])
    if PV_MODE == 3:  # V^T pages [NB, Hk, D, PAGE]: keys contiguous within a page
        voff = page.to(tl.int64) * stride_vb + kv_head * stride_vh + (n % PAGE)
        if MASKED:
            vt = tl.load(vt_ptr + voff[None, :] + d[:, None] * PAGE, mask=n_ok[None, :], other=0.0)
        else:
            vt = tl.load(vt_ptr + voff[None, :] + d[:, None] * PAGE)
    s = tl.dot(k, qT)  # [TILE_N, GP] fp32: keys on the MMA's M side
    if MASKED:
        s = tl.where(n_ok[:, None], s * scale2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - (m_safe - P_SHIFT)[None, :])
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=0) * scale2)
        m_safe = m_new
        p = tl.exp2(s * scale2 - (m_safe - P_SHIFT)[None, :])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    p8 = p.to(tl.float8e4nv)
    if PV_MODE == 3:
        pv = tl.dot(vt, p8)
    elif PV_MODE == 0:  # fp8 V^T P^T
        pv = tl.dot(tl.trans(v), p8)
    elif PV_MODE == 1:  # fp16 on the same values
        pv = tl.dot(tl.trans(v.to(tl.float16)), p8.to(tl.float16))
    else:  # P V unswapped (16 rows, mma.sync) in fp16, transposed back
        pv = tl.trans(tl.dot(tl.trans(p8.to(tl.float16)), v.to(tl.float16)))
    acc = acc * alpha[None, :] + pv
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_qt", "stride_ot"])
def decode_swap_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, order_ptr,
    k_scale_ptr, v_scale_ptr, q_scale_ptr, inv_q_scale_ptr, qk_scale, vt_ptr, stride_vb, stride_vh,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt, num_splits,
    G: tl.constexpr, GP: tl.constexpr, HEAD: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr,
    P_SHIFT: tl.constexpr, PV_MODE: tl.constexpr, SPLIT: tl.constexpr, ORDERED: tl.constexpr, HK: tl.constexpr,
):
    rank = tl.program_id(0) // HK
    kv_head = tl.program_id(0) % HK
    split = tl.program_id(2)
    if ORDERED:
        seq = tl.load(order_ptr + rank)
    else:
        seq = rank
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GP)
    head = kv_head * G + g
    g_ok = g < G
    d = tl.arange(0, HEAD)
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    q8 = tl.minimum(tl.maximum(q.to(tl.float32) * tl.load(inv_q_scale_ptr), -448.0), 448.0).to(tl.float8e4nv)
    qT = tl.trans(q8)  # [HEAD, GP]
    scale2 = (qk_scale * 1.4426950408889634) * (tl.load(q_scale_ptr) * tl.load(k_scale_ptr))
    num_tiles = tl.cdiv(seq_len, TILE_N)
    per = tl.cdiv(num_tiles, num_splits)
    lo = split * per
    hi = tl.minimum(lo + per, num_tiles)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([HEAD, GP], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    full_end = tl.minimum(tl.maximum(seq_len // TILE_N, lo), hi)
    for t in range(lo, full_end):
        m_i, l_i, acc = _tile(t, m_i, l_i, acc, qT, seq_len, scale2, cache_ptr, table, kv_head,
                              stride_cb, stride_ckv, stride_cs, stride_ch, vt_ptr, stride_vb, stride_vh, HEAD, PAGE, TILE_N, P_SHIFT, PV_MODE, False)
    for t in range(full_end, hi):
        m_i, l_i, acc = _tile(t, m_i, l_i, acc, qT, seq_len, scale2, cache_ptr, table, kv_head,
                              stride_cb, stride_ckv, stride_cs, stride_ch, vt_ptr, stride_vb, stride_vh, HEAD, PAGE, TILE_N, P_SHIFT, PV_MODE, True)
    v_mul = tl.load(v_scale_ptr)
    if not SPLIT:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc * ((1.0 / l_safe) * v_mul)[None, :]  # [HEAD, GP]
        tl.store(out_ptr + seq * stride_ot + head[None, :] * stride_oh + d[:, None],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[None, :])
    else:
        part = (seq * (G * HK) + head) * num_splits + split
        tl.store(part_acc_ptr + part[None, :] * HEAD + d[:, None], acc * v_mul, mask=g_ok[None, :])
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_ok)
