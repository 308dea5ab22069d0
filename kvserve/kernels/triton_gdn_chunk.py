"""Chunk-parallel Gated DeltaNet prefill on tensor cores (the WY form, fla's decomposition).

A step's sequences are cut into chunks of ``BT = 64`` tokens (``triton_gdn.plan_chunks``; the last
chunk of a sequence may be shorter). Four launches, each over every chunk of every sequence except the third:

1. ``_prep_kernel`` (chunk, value head): the gates from the raw projections (``g = -exp(A_log) *
   softplus(a + dt_bias)``, ``beta = sigmoid(b)``), their cumulative sum inside the chunk (kept in
   log2 units, as every later ``exp2``), k L2-normalised, ``beta * (k k^T) * decay`` strictly lower
   in four 16 x 16 row blocks, and its unit-lower-triangular inverse ``T = (I + A)^-1``: forward
   substitution inside each diagonal block, then the off-diagonal blocks by block products.
2. ``_wu_kernel`` (chunk, value head): ``w = T (beta exp(g) k)`` and ``u = T (beta v)``.
3. ``_state_kernel`` (sequence, value head, block of V columns): the only sequential pass. It reads
   the sequence's [K, V] fp32 state from its slot (zeros for a fresh sequence), walks the chunks:
   stores the state entering each chunk, ``v_new = u - w S``, ``S = exp(g_last) S + k^T (exp(g_last -
   g) v_new)``, and writes the final state back into the slot in place.
4. ``_output_kernel`` (chunk, value head, block of V columns): q L2-normalised and ``o = scale
   (exp(g) q S_chunk + (q k^T * decay, causal) v_new)``.

Operands of the products are in the model dtype (bf16/fp16 on tensor cores, fp32 accumulation; the
block merges of the inverse in IEEE fp32, where fla takes tf32); a float32 model runs the same
kernels with IEEE fp32 products (the exactness tests). Value head ``hv`` reads key head ``hv // (HV / H)``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_gdn import CHUNK, ChunkPlan, gdn_gates

_BC = 16


@dataclass
class LaunchConfig:
    """Warps, pipeline stages and V-column blocks of the four kernels (None: Triton's default);
    the defaults are the fastest of a sweep on the H200 at the 27B's heads (benchmarks/RESULTS.md)."""

    prep_warps: int = 1
    wu_warps: int = 4
    state_warps: int = 4
    state_stages: int | None = None
    state_block_v: int = 64
    output_warps: int = 4
    output_stages: int | None = 2
    output_block_v: int = 128
    # float32 models (IEEE products on CUDA cores, the exactness path): 32 V columns for the state
    # and output kernels; at K = V = 128 the wide tiles took ~100 s of compile a head layout on the H200
    ieee_block_v: int = 32


LAUNCH = LaunchConfig()


def _stages(n: int | None) -> dict:
    return {} if n is None else {"num_stages": n}


@triton.jit
def _inverse_diag(A, o_i, BC: tl.constexpr):
    """(I + A)^-1 of a strictly lower [BC, BC] block by forward substitution (fp32, in registers)."""
    Ai = -A
    for i in range(2, BC):
        row = tl.sum(tl.where((o_i == i)[:, None], -A, 0.0), 0)
        row = tl.where(o_i < i, row, 0.0)
        row = row + tl.sum(row[:, None] * Ai, 0)
        Ai = tl.where((o_i == i)[:, None], row[None, :], Ai)
    return Ai + tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)


@triton.jit
def _block_gates(a_ptr, b_ptr, stride_a, stride_b, hv, rows, ok, A_log, dt_bias, offset):
    """One 16-row block's gates: (cumulative g in log2 units continuing from ``offset``, beta)."""
    g, beta = gdn_gates(tl.load(a_ptr + rows * stride_a + hv, mask=ok, other=0.0),
                        tl.load(b_ptr + rows * stride_b + hv, mask=ok, other=0.0), tl.exp(A_log), dt_bias)
    g = tl.where(ok, g, 0.0)  # padded rows: no decay
    return offset + tl.cumsum(g, 0) * 1.4426950408889634, tl.where(ok, beta, 0.0)


@triton.jit
def _unit_keys(k_ptr, stride_k, h, rows, ok, kk, k_ok, K: tl.constexpr):
    """A block of k rows of key head ``h``, L2-normalised in fp32, in the model dtype."""
    k = tl.load(k_ptr + rows[:, None] * stride_k + h * K + kk[None, :], mask=ok[:, None] & k_ok[None, :],
                other=0.0)
    kf = k.to(tl.float32)
    return (kf * tl.rsqrt(tl.sum(kf * kf, 1) + 1e-6)[:, None]).to(k.dtype)


@triton.jit
def _decayed(A, beta_i, g_i, g_j, mask):
    return tl.where(mask, A * beta_i[:, None] * tl.exp2(g_i[:, None] - g_j[None, :]), 0.0)


@triton.jit
def _prep_kernel(
    k_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, qsl_ptr, chunks_ptr,
    kn_ptr, T_ptr, g_ptr, beta_ptr,
    stride_k, stride_a, stride_b,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, MERGE_PREC: tl.constexpr,
):
    i_c = tl.program_id(0)
    hv = tl.program_id(1)
    h = hv // GROUP
    seq = tl.load(chunks_ptr + 2 * i_c)
    bos = tl.load(qsl_ptr + seq).to(tl.int64)
    eos = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    t0 = bos + tl.load(chunks_ptr + 2 * i_c + 1).to(tl.int64) * BT
    o_i = tl.arange(0, BC)
    kk = tl.arange(0, K_PAD)
    k_ok = kk < K
    r0, r1, r2, r3 = t0 + o_i, t0 + BC + o_i, t0 + 2 * BC + o_i, t0 + 3 * BC + o_i
    m0, m1, m2, m3 = r0 < eos, r1 < eos, r2 < eos, r3 < eos
    A_log = tl.load(A_log_ptr + hv).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    g0, b0 = _block_gates(a_ptr, b_ptr, stride_a, stride_b, hv, r0, m0, A_log, dt_bias, 0.0)
    g1, b1 = _block_gates(a_ptr, b_ptr, stride_a, stride_b, hv, r1, m1, A_log, dt_bias, tl.min(g0, 0))
    g2, b2 = _block_gates(a_ptr, b_ptr, stride_a, stride_b, hv, r2, m2, A_log, dt_bias, tl.min(g1, 0))
    g3, b3 = _block_gates(a_ptr, b_ptr, stride_a, stride_b, hv, r3, m3, A_log, dt_bias, tl.min(g2, 0))
    tl.store(g_ptr + r0 * HV + hv, g0, mask=m0)
    tl.store(g_ptr + r1 * HV + hv, g1, mask=m1)
    tl.store(g_ptr + r2 * HV + hv, g2, mask=m2)
    tl.store(g_ptr + r3 * HV + hv, g3, mask=m3)
    tl.store(beta_ptr + r0 * HV + hv, b0, mask=m0)
    tl.store(beta_ptr + r1 * HV + hv, b1, mask=m1)
    tl.store(beta_ptr + r2 * HV + hv, b2, mask=m2)
    tl.store(beta_ptr + r3 * HV + hv, b3, mask=m3)

    k0 = _unit_keys(k_ptr, stride_k, h, r0, m0, kk, k_ok, K)
    k1 = _unit_keys(k_ptr, stride_k, h, r1, m1, kk, k_ok, K)
    k2 = _unit_keys(k_ptr, stride_k, h, r2, m2, kk, k_ok, K)
    k3 = _unit_keys(k_ptr, stride_k, h, r3, m3, kk, k_ok, K)
    if hv % GROUP == 0:  # one program per key head stores the normalised keys
        kn = kn_ptr + h * K + kk[None, :]
        tl.store(kn + r0[:, None] * (HV // GROUP * K), k0, mask=m0[:, None] & k_ok[None, :])
        tl.store(kn + r1[:, None] * (HV // GROUP * K), k1, mask=m1[:, None] & k_ok[None, :])
        tl.store(kn + r2[:, None] * (HV // GROUP * K), k2, mask=m2[:, None] & k_ok[None, :])
        tl.store(kn + r3[:, None] * (HV // GROUP * K), k3, mask=m3[:, None] & k_ok[None, :])

    # the ten lower blocks of beta * (k k^T) * decay; diagonal blocks strictly lower
    strict = o_i[:, None] > o_i[None, :]
    full = o_i[:, None] >= 0
    A00 = _decayed(tl.dot(k0, tl.trans(k0), input_precision=PREC), b0, g0, g0, strict)
    A11 = _decayed(tl.dot(k1, tl.trans(k1), input_precision=PREC), b1, g1, g1, strict)
    A22 = _decayed(tl.dot(k2, tl.trans(k2), input_precision=PREC), b2, g2, g2, strict)
    A33 = _decayed(tl.dot(k3, tl.trans(k3), input_precision=PREC), b3, g3, g3, strict)
    A10 = _decayed(tl.dot(k1, tl.trans(k0), input_precision=PREC), b1, g1, g0, full)
    A20 = _decayed(tl.dot(k2, tl.trans(k0), input_precision=PREC), b2, g2, g0, full)
    A21 = _decayed(tl.dot(k2, tl.trans(k1), input_precision=PREC), b2, g2, g1, full)
    A30 = _decayed(tl.dot(k3, tl.trans(k0), input_precision=PREC), b3, g3, g0, full)
    A31 = _decayed(tl.dot(k3, tl.trans(k1), input_precision=PREC), b3, g3, g1, full)
    A32 = _decayed(tl.dot(k3, tl.trans(k2), input_precision=PREC), b3, g3, g2, full)

    T00 = _inverse_diag(A00, o_i, BC)
    T11 = _inverse_diag(A11, o_i, BC)
    T22 = _inverse_diag(A22, o_i, BC)
    T33 = _inverse_diag(A33, o_i, BC)
    # block row i of (I + A) T = I: T_ij = -T_ii sum_{j <= m < i} A_im T_mj
    T10 = -tl.dot(tl.dot(T11, A10, input_precision=MERGE_PREC), T00, input_precision=MERGE_PREC)
    T21 = -tl.dot(tl.dot(T22, A21, input_precision=MERGE_PREC), T11, input_precision=MERGE_PREC)
    T32 = -tl.dot(tl.dot(T33, A32, input_precision=MERGE_PREC), T22, input_precision=MERGE_PREC)
    T20 = -tl.dot(T22, tl.dot(A20, T00, input_precision=MERGE_PREC) + tl.dot(A21, T10, input_precision=MERGE_PREC),
                  input_precision=MERGE_PREC)
    T31 = -tl.dot(T33, tl.dot(A31, T11, input_precision=MERGE_PREC) + tl.dot(A32, T21, input_precision=MERGE_PREC),
                  input_precision=MERGE_PREC)
    T30 = -tl.dot(T33, tl.dot(A30, T00, input_precision=MERGE_PREC) + tl.dot(A31, T10, input_precision=MERGE_PREC)
                  + tl.dot(A32, T20, input_precision=MERGE_PREC), input_precision=MERGE_PREC)

    dt = T_ptr.dtype.element_ty
    base = T_ptr + hv * BT + o_i[None, :]
    tl.store(base + r0[:, None] * (HV * BT), T00.to(dt), mask=m0[:, None])
    tl.store(base + r1[:, None] * (HV * BT), T10.to(dt), mask=m1[:, None])
    tl.store(base + r1[:, None] * (HV * BT) + BC, T11.to(dt), mask=m1[:, None])
    tl.store(base + r2[:, None] * (HV * BT), T20.to(dt), mask=m2[:, None])
    tl.store(base + r2[:, None] * (HV * BT) + BC, T21.to(dt), mask=m2[:, None])
    tl.store(base + r2[:, None] * (HV * BT) + 2 * BC, T22.to(dt), mask=m2[:, None])
    tl.store(base + r3[:, None] * (HV * BT), T30.to(dt), mask=m3[:, None])
    tl.store(base + r3[:, None] * (HV * BT) + BC, T31.to(dt), mask=m3[:, None])
    tl.store(base + r3[:, None] * (HV * BT) + 2 * BC, T32.to(dt), mask=m3[:, None])
    tl.store(base + r3[:, None] * (HV * BT) + 3 * BC, T33.to(dt), mask=m3[:, None])


@triton.jit
def _chunk_rows(qsl_ptr, chunks_ptr, i_c, BT: tl.constexpr):
    """Chunk ``i_c``'s token rows (int64) and which of them are in its sequence."""
    seq = tl.load(chunks_ptr + 2 * i_c)
    eos = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    rows = tl.load(qsl_ptr + seq).to(tl.int64) + tl.load(chunks_ptr + 2 * i_c + 1).to(tl.int64) * BT + tl.arange(0, BT)
    return rows, rows < eos


@triton.jit
def _wu_kernel(
    kn_ptr, v_ptr, T_ptr, g_ptr, beta_ptr, qsl_ptr, chunks_ptr, w_ptr, u_ptr, stride_v,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, K_PAD: tl.constexpr,
    V_PAD: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
):
    i_c = tl.program_id(0)
    hv = tl.program_id(1)
    h = hv // GROUP
    rows, ok = _chunk_rows(qsl_ptr, chunks_ptr, i_c, BT)
    o_t = tl.arange(0, BT)
    kk = tl.arange(0, K_PAD)
    vv = tl.arange(0, V_PAD)
    # T is block lower triangular; the blocks above the diagonal were never written
    in_T = ok[:, None] & (o_t[None, :] < (o_t[:, None] // BC + 1) * BC)
    Tm = tl.load(T_ptr + rows[:, None] * (HV * BT) + hv * BT + o_t[None, :], mask=in_T, other=0.0)
    g = tl.load(g_ptr + rows * HV + hv, mask=ok, other=0.0)
    beta = tl.load(beta_ptr + rows * HV + hv, mask=ok, other=0.0)
    k = tl.load(kn_ptr + rows[:, None] * (HV // GROUP * K) + h * K + kk[None, :], mask=ok[:, None] & (kk < K)[None, :],
                other=0.0)
    kb = (k.to(tl.float32) * (beta * tl.exp2(g))[:, None]).to(Tm.dtype)
    w = tl.dot(Tm, kb, input_precision=PREC)
    tl.store(w_ptr + rows[:, None] * (HV * K) + hv * K + kk[None, :], w.to(w_ptr.dtype.element_ty),
             mask=ok[:, None] & (kk < K)[None, :])
    v = tl.load(v_ptr + rows[:, None] * stride_v + hv * V + vv[None, :], mask=ok[:, None] & (vv < V)[None, :],
                other=0.0)
    vb = (v.to(tl.float32) * beta[:, None]).to(Tm.dtype)
    u = tl.dot(Tm, vb, input_precision=PREC)
    tl.store(u_ptr + rows[:, None] * (HV * V) + hv * V + vv[None, :], u.to(u_ptr.dtype.element_ty),
             mask=ok[:, None] & (vv < V)[None, :])


@triton.jit
def _state_kernel(
    kn_ptr, w_ptr, u_ptr, g_ptr, qsl_ptr, offsets_ptr, slots_ptr, has_state_ptr, state_ptr, h_ptr, vnew_ptr,
    stride_ss, stride_sh, stride_sk,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, TWO_K: tl.constexpr,
    BV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
):
    """The state [K, BV] is held as one or two [BK, BV] row blocks (K <= 2 * BK)."""
    i_v = tl.program_id(0)
    seq = tl.program_id(1)
    hv = tl.program_id(2)
    h = hv // GROUP
    bos = tl.load(qsl_ptr + seq).to(tl.int64)
    eos = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    first = tl.load(offsets_ptr + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    vcol = i_v * BV + tl.arange(0, BV)
    v_ok = vcol < V
    k1 = tl.arange(0, BK)
    k2 = BK + k1
    o_t = tl.arange(0, BT)
    keep = (tl.zeros([BK, BV], tl.int32) + tl.load(has_state_ptr + seq)) != 0
    s_ptr = state_ptr + slot * stride_ss + hv * stride_sh + vcol[None, :]
    S1 = tl.load(s_ptr + k1[:, None] * stride_sk, mask=keep & (k1 < K)[:, None] & v_ok[None, :], other=0.0)
    if TWO_K:
        S2 = tl.load(s_ptr + k2[:, None] * stride_sk, mask=keep & (k2 < K)[:, None] & v_ok[None, :], other=0.0)
    dt = h_ptr.dtype.element_ty
    for c in range(0, tl.cdiv(eos - bos, BT)):
        rows = bos + c * BT + o_t
        ok = rows < eos
        hc = h_ptr + ((first + c) * HV + hv) * (K * V) + vcol[None, :]
        tl.store(hc + k1[:, None] * V, S1.to(dt), mask=(k1 < K)[:, None] & v_ok[None, :])
        w = tl.load(w_ptr + rows[:, None] * (HV * K) + hv * K + k1[None, :], mask=ok[:, None] & (k1 < K)[None, :],
                    other=0.0)
        vn = tl.dot(w, S1.to(dt), input_precision=PREC)
        if TWO_K:
            tl.store(hc + k2[:, None] * V, S2.to(dt), mask=(k2 < K)[:, None] & v_ok[None, :])
            w = tl.load(w_ptr + rows[:, None] * (HV * K) + hv * K + k2[None, :],
                        mask=ok[:, None] & (k2 < K)[None, :], other=0.0)
            vn = tl.dot(w, S2.to(dt), vn, input_precision=PREC)
        m = ok[:, None] & v_ok[None, :]
        vn = tl.load(u_ptr + rows[:, None] * (HV * V) + hv * V + vcol[None, :], mask=m, other=0.0).to(tl.float32) - vn
        tl.store(vnew_ptr + rows[:, None] * (HV * V) + hv * V + vcol[None, :], vn.to(dt), mask=m)
        g_last = tl.load(g_ptr + (tl.minimum(bos + c * BT + BT, eos) - 1) * HV + hv)
        g = tl.load(g_ptr + rows * HV + hv, mask=ok, other=0.0)
        vd = (vn * tl.where(ok, tl.exp2(g_last - g), 0.0)[:, None]).to(dt)
        decay = tl.exp2(g_last)
        kt = tl.load(kn_ptr + rows[None, :] * (HV // GROUP * K) + h * K + k1[:, None],
                     mask=ok[None, :] & (k1 < K)[:, None], other=0.0)  # [BK, BT]
        S1 = tl.dot(kt, vd, S1 * decay, input_precision=PREC)
        if TWO_K:
            kt = tl.load(kn_ptr + rows[None, :] * (HV // GROUP * K) + h * K + k2[:, None],
                         mask=ok[None, :] & (k2 < K)[:, None], other=0.0)
            S2 = tl.dot(kt, vd, S2 * decay, input_precision=PREC)
    tl.store(s_ptr + k1[:, None] * stride_sk, S1, mask=(k1 < K)[:, None] & v_ok[None, :])
    if TWO_K:
        tl.store(s_ptr + k2[:, None] * stride_sk, S2, mask=(k2 < K)[:, None] & v_ok[None, :])


@triton.jit
def _output_kernel(
    q_ptr, kn_ptr, h_ptr, vnew_ptr, g_ptr, qsl_ptr, chunks_ptr, o_ptr, stride_q, scale,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, K_PAD: tl.constexpr,
    BV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
):
    i_c = tl.program_id(0)
    hv = tl.program_id(1)
    i_v = tl.program_id(2)
    h = hv // GROUP
    rows, ok = _chunk_rows(qsl_ptr, chunks_ptr, i_c, BT)
    o_t = tl.arange(0, BT)
    kk = tl.arange(0, K_PAD)
    k_ok = kk < K
    vcol = i_v * BV + tl.arange(0, BV)
    v_ok = vcol < V
    q = tl.load(q_ptr + rows[:, None] * stride_q + h * K + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
    qf = q.to(tl.float32)
    q = (qf * tl.rsqrt(tl.sum(qf * qf, 1) + 1e-6)[:, None]).to(q.dtype)
    k = tl.load(kn_ptr + rows[:, None] * (HV // GROUP * K) + h * K + kk[None, :], mask=ok[:, None] & k_ok[None, :],
                other=0.0)
    S = tl.load(h_ptr + (i_c * HV + hv).to(tl.int64) * (K * V) + kk[:, None] * V + vcol[None, :],
                mask=k_ok[:, None] & v_ok[None, :], other=0.0)
    g = tl.load(g_ptr + rows * HV + hv, mask=ok, other=0.0)
    o = tl.dot(q, S, input_precision=PREC) * tl.exp2(g)[:, None]
    causal = (o_t[:, None] >= o_t[None, :]) & ok[None, :]
    qk = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PREC) * tl.exp2(g[:, None] - g[None, :]), 0.0)
    vn = tl.load(vnew_ptr + rows[:, None] * (HV * V) + hv * V + vcol[None, :], mask=ok[:, None] & v_ok[None, :],
                 other=0.0)
    o = (o + tl.dot(qk.to(vn.dtype), vn, input_precision=PREC)) * scale
    tl.store(o_ptr + rows[:, None] * (HV * V) + hv * V + vcol[None, :], o.to(o_ptr.dtype.element_ty),
             mask=ok[:, None] & v_ok[None, :])


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, ssm_state: torch.Tensor, query_start_loc: torch.Tensor, slots: torch.Tensor,
    has_state: torch.Tensor, plan: ChunkPlan, scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The step's GDN delta rule from the conv outputs and the raw gate projections.

    q, k [T, H, K] and v [T, HV, V] (row strides free: views of the conv output); a, b [T, HV] the raw
    ``in_proj_a`` / ``in_proj_b`` outputs; ssm_state [slots, HV, K, V] fp32, updated in place;
    query_start_loc [B + 1], slots [B], has_state [B] int32; ``plan`` from ``plan_chunks``. q and k
    are L2-normalised here (the output scaled by ``scale``, default K^-0.5). Returns o [T, HV, V]
    (written into ``out`` when given)."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    assert HV % H == 0 and K <= 128 and ssm_state.shape[1:] == (HV, K, V) and ssm_state.dtype == torch.float32
    assert q.stride(1) == k.stride(1) == K and v.stride(1) == V and q.stride(2) == k.stride(2) == v.stride(2) == 1
    assert a.shape == b.shape == (T, HV) and a.stride(1) == b.stride(1) == 1 and ssm_state.stride(-1) == 1
    dtype, dev = q.dtype, q.device
    o = torch.empty((T, HV, V), dtype=dtype, device=dev) if out is None else out
    assert o.shape == (T, HV, V) and o.dtype == dtype and o.is_contiguous()
    B, NT = slots.shape[0], plan.num_chunks
    if B == 0 or T == 0:
        return o
    # fp32 operands: IEEE products; bf16/fp16 operands run on tensor cores whatever the flag says.
    # The block merges of T (fp32 operands, 16 x 16 x 16, a few percent of the work) stay IEEE
    # for every dtype: in tf32 they lost 10 bits where (I + A) is ill-conditioned
    ieee = dtype == torch.float32
    dot_prec = "ieee" if ieee else "tf32"
    group = HV // H
    # V tiles of at least 32 columns: bf16 products with 16 V columns and K >= 32 came out wrong
    # on the H200 (Triton 3.6), fp32 ones right; wider tiles are masked instead
    k_pad, v_pad = max(16, triton.next_power_of_2(K)), max(32, triton.next_power_of_2(V))
    kn = torch.empty((T, H, K), dtype=dtype, device=dev)
    tri = torch.empty((T, HV, CHUNK), dtype=dtype, device=dev)
    g = torch.empty((T, HV), dtype=torch.float32, device=dev)
    beta = torch.empty((T, HV), dtype=torch.float32, device=dev)
    _prep_kernel[(NT, HV)](
        k, a, b, A_log, dt_bias, query_start_loc, plan.chunks, kn, tri, g, beta, k.stride(0), a.stride(0), b.stride(0),
        HV=HV, GROUP=group, K=K, K_PAD=k_pad, BT=CHUNK, BC=_BC, PREC=dot_prec, MERGE_PREC="ieee",
        num_warps=LAUNCH.prep_warps,
    )
    w = torch.empty((T, HV, K), dtype=dtype, device=dev)
    u = torch.empty((T, HV, V), dtype=dtype, device=dev)
    _wu_kernel[(NT, HV)](
        kn, v, tri, g, beta, query_start_loc, plan.chunks, w, u, v.stride(0),
        HV=HV, GROUP=group, K=K, V=V, K_PAD=k_pad, V_PAD=v_pad, BT=CHUNK, BC=_BC, PREC=dot_prec,
        num_warps=LAUNCH.wu_warps,
    )
    states = torch.empty((NT, HV, K, V), dtype=dtype, device=dev)  # the state entering each chunk
    v_new = torch.empty((T, HV, V), dtype=dtype, device=dev)
    bk = min(64, k_pad)
    bv = min(LAUNCH.ieee_block_v if ieee else LAUNCH.state_block_v, v_pad)
    _state_kernel[(triton.cdiv(V, bv), B, HV)](
        kn, w, u, g, query_start_loc, plan.offsets, slots, has_state, ssm_state, states, v_new,
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        HV=HV, GROUP=group, K=K, V=V, BK=bk, TWO_K=K > bk, BV=bv, BT=CHUNK, PREC=dot_prec,
        num_warps=LAUNCH.state_warps, **_stages(LAUNCH.state_stages),
    )
    bv_o = min(LAUNCH.ieee_block_v if ieee else LAUNCH.output_block_v, v_pad)
    _output_kernel[(NT, HV, triton.cdiv(V, bv_o))](
        q, kn, states, v_new, g, query_start_loc, plan.chunks, o, q.stride(0),
        float(K**-0.5 if scale is None else scale),
        HV=HV, GROUP=group, K=K, V=V, K_PAD=k_pad, BV=bv_o, BT=CHUNK, PREC=dot_prec,
        num_warps=LAUNCH.output_warps, **_stages(LAUNCH.output_stages),
    )
    return o
