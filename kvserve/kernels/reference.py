"""Plain-torch ground truth for the KV cache ops: the paged store and paged attention.

KV cache per layer: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (index 0 = K, 1 = V).
Slot ``s`` lives in block ``s // block_size`` at offset ``s % block_size``; slot -1 is padding.
fp8 caches are ``torch.uint8`` bytes: stored ``fp8(clamp(x_fp32 / scale, -max, max))`` (round to
nearest even, saturating), read back as ``float32(q) * scale`` (vLLM's per-tensor convention).

``paged_attention_fp8_query`` is the twin of the quantized-query read (vLLM's FLASH_ATTN = FlashAttention
3 on Hopper, and its TRITON_ATTN on CUDA): the query rounded to e4m3, both products on fp8 values, P
rounded to e4m3 tile by tile as the Triton kernel's online softmax makes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class CacheQuant:
    """How an fp8 cache maps to values: the fp8 format and the layer's per-tensor scales."""

    fp8_dtype: torch.dtype  # torch.float8_e4m3fn or torch.float8_e5m2
    fp8_max: float  # 448.0 (e4m3) or 57344.0 (e5m2): the store saturates here
    k_scale: float = 1.0
    v_scale: float = 1.0
    device: torch.device | str = "cpu"  # the cache's device
    # The read: False = K / V dequantized to the query's dtype (kvserve's ``triton``); True = the query
    # quantized to e4m3 with ``q_scale`` and both products on fp8 values (vLLM's FLASH_ATTN / TRITON_ATTN
    # on CUDA, e4m3 pages only), P multiplied by 2^p_shift before its e4m3 rounding (FlashAttention 3's
    # Max_offset: 8; vLLM's Triton kernel: 0).
    query_fp8: bool = False
    q_scale: float = 1.0
    p_shift: int = 8
    # the scales as float32 tensors on that device, made once per layer rather than per store
    k_scale_t: torch.Tensor = field(init=False, repr=False, compare=False)
    v_scale_t: torch.Tensor = field(init=False, repr=False, compare=False)
    q_scale_t: torch.Tensor = field(init=False, repr=False, compare=False)
    inv_q_scale_t: torch.Tensor = field(init=False, repr=False, compare=False)  # float32 1 / q_scale (IEEE)

    def __post_init__(self) -> None:
        if self.query_fp8 and self.fp8_dtype != torch.float8_e4m3fn:
            raise ValueError(f"the quantized-query read needs e4m3 pages, got {self.fp8_dtype}")
        for name in ("k_scale", "v_scale", "q_scale"):
            value = torch.tensor(getattr(self, name), dtype=torch.float32, device=self.device)
            object.__setattr__(self, f"{name}_t", value)
        one = torch.ones((), dtype=torch.float32, device=self.device)
        object.__setattr__(self, "inv_q_scale_t", one / self.q_scale_t)


def quantize_fp8(
    x: torch.Tensor, scale: float | torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float
) -> torch.Tensor:
    """``fp8(clamp(float32(x) / scale, -max, max))`` as uint8 bytes (RNE; NaN stays NaN).

    The scale is used as a float32 tensor on ``x``'s device so the division is a true one (CUDA
    turns division by a host scalar into a multiplication by its reciprocal, which rounds
    differently)."""
    divisor = scale if isinstance(scale, torch.Tensor) else torch.tensor(scale, dtype=torch.float32, device=x.device)
    q = (x.float() / divisor).clamp_(-fp8_max, fp8_max)
    return q.to(fp8_dtype).view(torch.uint8)


def dequantize_fp8(q: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """uint8 fp8 bytes -> ``float32(q) * scale``."""
    return q.view(fp8_dtype).float() * scale


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: CacheQuant | None = None,
) -> None:
    """Write ``key``/``value`` ([T, kv_heads, head]) into their slots; slot -1 writes nothing.

    A float cache takes the values cast to its dtype; a uint8 cache (``quant`` given) takes fp8
    bytes, written through the uint8 view (CPU torch has no fp8 ``index_copy_``)."""
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    rows_k = _k_rows(slot_mapping // block_size, slot_mapping % block_size, block_size)
    rows = _rows_view(kv_cache)
    if quant is None:
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    else:
        assert kv_cache.dtype == torch.uint8, "an fp8 cache is stored as uint8"
        key = quantize_fp8(key, quant.k_scale_t, quant.fp8_dtype, quant.fp8_max)
        value = quantize_fp8(value, quant.v_scale_t, quant.fp8_dtype, quant.fp8_max)
    rows.index_copy_(0, rows_k, key)
    rows.index_copy_(0, rows_k + block_size, value)


def _read_rows(cache_rows: torch.Tensor, idx: torch.Tensor, quant: CacheQuant | None, scale_of: str) -> torch.Tensor:
    """Gather cache rows as float32 (dequantized for fp8: ``float32(q) * scale``)."""
    rows = cache_rows.index_select(0, idx)
    if quant is None:
        return rows.float()
    return dequantize_fp8(rows, getattr(quant, scale_of), quant.fp8_dtype)


@dataclass
class DecodeGroup:
    """Decode sequences of similar context length, attended in one padded call."""

    rows: torch.Tensor  # [B] query rows
    k_rows: torch.Tensor  # [B, L] cache row of each context key (padding: position 0's row)
    mask: torch.Tensor  # [B, 1, 1, L] additive: 0 where the key is real, -inf on padding


@dataclass
class AttentionPlan:
    """Gather indices for one step, shared by every layer (built once per step)."""

    decodes: list[DecodeGroup]
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (q_start, q_len, seq_len, K rows of positions)


# A decode group's longest context is at most this many times its shortest, so padding stays small.
_MAX_PAD_RATIO = 1.3


def _k_rows(blocks: torch.Tensor, offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """Row of a key in the cache viewed as ``[num_blocks * 2 * block_size, heads, head]``; V is ``+ block_size``."""
    return blocks * (2 * block_size) + offsets


def _rows_view(kv_cache: torch.Tensor) -> torch.Tensor:
    nb, _, bs, h, d = kv_cache.shape
    return kv_cache.view(nb * 2 * bs, h, d)


def _decode_group(
    seqs: list[int], starts: list[int], block_tables: torch.Tensor, seq_lens: list[int], block_size: int
) -> DecodeGroup:
    device = block_tables.device
    pos = torch.arange(max(seq_lens[i] for i in seqs), device=device).unsqueeze(0)
    lens = torch.tensor([seq_lens[i] for i in seqs], device=device).unsqueeze(1)
    real = pos < lens
    safe_pos = torch.where(real, pos, torch.zeros_like(pos))
    tables = block_tables[torch.tensor(seqs, device=device)]
    k_rows = _k_rows(tables.gather(1, safe_pos // block_size), safe_pos % block_size, block_size)
    mask = torch.zeros(real.shape, dtype=torch.float32, device=device).masked_fill_(~real, float("-inf"))
    rows = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device)
    return DecodeGroup(rows, k_rows, mask[:, None, None, :])


def plan_attention(
    block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int], block_size: int
) -> AttentionPlan:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    # Decodes sorted by context length, cut into groups whose padding is bounded.
    decode = sorted((i for i, n in enumerate(query_lens) if n == 1), key=lambda i: seq_lens[i])
    groups: list[list[int]] = []
    for i in decode:
        if groups and seq_lens[i] <= _MAX_PAD_RATIO * seq_lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    prefills = []
    for i, n in enumerate(query_lens):
        if n != 1:
            p = torch.arange(seq_lens[i], device=block_tables.device)
            k_rows = _k_rows(block_tables[i][p // block_size], p % block_size, block_size)
            prefills.append((starts[i], n, seq_lens[i], k_rows))
    return AttentionPlan(
        decodes=[_decode_group(g, starts, block_tables, seq_lens, block_size) for g in groups],
        prefills=prefills,
    )


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q: [B, Hq, Tq, D], k/v: [B, Hk, Tk, D] in fp32; GQA by head groups."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    plan: AttentionPlan | None = None,
    quant: CacheQuant | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context plus themselves.

    query: [T, Hq, D] (the tokens of all sequences back to back); sequence i owns ``query_lens[i]``
    tokens at positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``. K/V are read from the
    pages (dequantized when ``quant`` is given), softmax and accumulation run in float32; the
    query keeps its dtype until it is upcast; the result has the query's dtype.
    """
    if plan is None:
        plan = plan_attention(block_tables, query_lens, seq_lens, kv_cache.shape[2])
    out = torch.empty_like(query)
    cache_rows, block_size = _rows_view(kv_cache), kv_cache.shape[2]

    # Decodes: one padded call per group of similar lengths; padding keys are masked out.
    for g in plan.decodes:
        b, length = g.k_rows.shape
        flat = g.k_rows.flatten()
        k = _read_rows(cache_rows, flat, quant, "k_scale").view(b, length, *cache_rows.shape[1:]).transpose(1, 2)
        v = _read_rows(cache_rows, flat + block_size, quant, "v_scale").view(b, length, *cache_rows.shape[1:]).transpose(1, 2)
        q = query[g.rows].float().unsqueeze(2)  # [B, Hq, 1, D]
        out[g.rows] = _attend(q, k, v, g.mask, scale).squeeze(2).to(query.dtype)

    # Prefill chunks: one call each, causal with an offset for the cached context.
    for start, n, seq_len, k_rows in plan.prefills:
        k = _read_rows(cache_rows, k_rows, quant, "k_scale").transpose(0, 1).unsqueeze(0)
        v = _read_rows(cache_rows, k_rows + block_size, quant, "v_scale").transpose(0, 1).unsqueeze(0)
        q = query[start : start + n].float().transpose(0, 1).unsqueeze(0)
        if n == seq_len:  # no cached context: plain causal (lets SDPA take its fused path)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        else:
            q_pos = torch.arange(seq_len - n, seq_len, device=query.device).unsqueeze(1)
            mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= q_pos
            o = _attend(q, k, v, mask, scale)
        out[start : start + n] = o.squeeze(0).transpose(0, 1).to(query.dtype)
    return out


_LOG2E = 1.4426950408889634


def quantize_query_fp8(query: torch.Tensor, inv_q_scale: torch.Tensor) -> torch.Tensor:
    """vLLM's static per-tensor query quantization (``QuantFP8``, the CUDA op and the native one alike):
    ``e4m3(clamp(float32(q) * (1 / q_scale), -448, 448))``, round to nearest even."""
    return (query.float() * inv_q_scale.to(query.device)).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)


def _fp8_gemm_scores(q8: torch.Tensor, k8: torch.Tensor) -> torch.Tensor:
    """[Hq, n, L] float32 scores of e4m3 q8 [n, Hq, D] and k8 [L, Hq, D], one fp8 GEMM per head with
    fast accumulation (rows and keys zero-padded to multiples of 16, as the GEMM needs)."""
    n, hq, d = q8.shape
    length = k8.shape[0]
    pad = lambda x: -(-x // 16) * 16  # noqa: E731
    one = torch.ones((), dtype=torch.float32, device=q8.device)
    a = torch.zeros((pad(n), d), dtype=q8.dtype, device=q8.device)
    b = torch.zeros((pad(length), d), dtype=k8.dtype, device=k8.device)
    out = torch.empty((hq, n, length), dtype=torch.float32, device=q8.device)
    for h in range(hq):
        a[:n] = q8[:, h]
        b[:length] = k8[:, h]
        s = torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.float32, use_fast_accum=True)
        out[h] = s[:n, :length]
    return out


def paged_attention_fp8_query(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    quant: CacheQuant,
    tile_n: int,
    compute: torch.dtype = torch.float32,
    num_splits: int = 1,
    fp8_gemm_scores: bool = False,
) -> torch.Tensor:
    """Twin of the Triton kernel's quantized-query read of e4m3 pages (``quant.query_fp8``).

    Per sequence: Q8 = ``quantize_query_fp8``; S = Q8 K8^T (exact fp8 products, summed in ``compute``)
    times (scale log2 e)(q_scale k_scale), the log2 domain; causal; keys in tiles of ``tile_n`` from
    key 0, online softmax: m the running row max, P = 2^(S - (m - p_shift)) added into l before its
    e4m3 rounding, acc = acc 2^(m_old - m) + e4m3(P) V8; O = acc ((1 / l) v_scale) in the query's
    dtype. The P rounding depends on the running max, hence on ``tile_n``: the kernel's tile size
    makes the twin; ``compute`` float64 measures the twin's own fp32 noise. ``num_splits`` > 1
    (decode-only batches): the kernel's split-KV, each split's tiles (``cdiv(tiles, num_splits)`` a
    split) with their own running max, merged as its merge kernel does: sum 2^(m_s - M) (acc_s v_scale)
    / sum 2^(m_s - M) l_s. ``fp8_gemm_scores``: Q8 K8^T from torch's fp8 GEMM with fast accumulation
    instead (``torch._scaled_mm``; on Hopper the fp8 tensor cores' own limited-precision sums, which
    FlashAttention 3's and the kernel's wgmma tiles have too): the twin's spread under that hardware."""
    assert quant.fp8_dtype == torch.float8_e4m3fn
    assert num_splits == 1 or all(n == 1 for n in query_lens), "split-KV is for decode-only batches"
    dev = query.device
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    scale2 = ((f32(scale) * f32(_LOG2E)) * (quant.q_scale_t.cpu() * quant.k_scale_t.cpu())).to(compute).to(dev)
    shift = float(quant.p_shift)
    rows, block_size = _rows_view(kv_cache), kv_cache.shape[2]
    hq, hk = query.shape[1], kv_cache.shape[3]
    out = torch.empty_like(query)
    q8_codes = quantize_query_fp8(query, quant.inv_q_scale_t)
    q8 = q8_codes.to(compute)
    start = 0
    for i, (n, length) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(length, device=dev)
        k_rows = _k_rows(block_tables[i].long()[pos // block_size], pos % block_size, block_size)
        k8 = rows.index_select(0, k_rows).view(torch.float8_e4m3fn).to(compute).repeat_interleave(hq // hk, dim=1)
        v8 = rows.index_select(0, k_rows + block_size).view(torch.float8_e4m3fn).to(compute)
        v8 = v8.repeat_interleave(hq // hk, dim=1).transpose(0, 1)  # [Hq, L, D]
        if fp8_gemm_scores:
            k_codes = rows.index_select(0, k_rows).view(torch.float8_e4m3fn).repeat_interleave(hq // hk, dim=1)
            s = _fp8_gemm_scores(q8_codes[start : start + n], k_codes).to(compute) * scale2
        else:
            s = torch.einsum("qhd,khd->hqk", q8[start : start + n], k8) * scale2
        visible = pos[None, :] <= torch.arange(length - n, length, device=dev)[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        v_scale = quant.v_scale_t.to(dev).to(compute)
        tiles = -(-length // tile_n)
        per_split = -(-tiles // num_splits)
        parts = []
        for lo in range(0, tiles, per_split):
            m = torch.full((hq, n), float("-inf"), dtype=compute, device=dev)
            total = torch.zeros((hq, n), dtype=compute, device=dev)
            acc = torch.zeros((hq, n, query.shape[2]), dtype=compute, device=dev)
            for t0 in range(lo * tile_n, min(lo + per_split, tiles) * tile_n, tile_n):
                st = s[..., t0 : t0 + tile_n]
                m_new = torch.maximum(m, st.amax(-1))
                m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
                p = torch.exp2(st - (m_safe - shift)[..., None])
                alpha = torch.exp2(m - m_safe)
                total = total * alpha + p.sum(-1)
                p8 = p.to(torch.float8_e4m3fn).to(compute)
                acc = acc * alpha[..., None] + p8 @ v8[:, t0 : t0 + tile_n]
                m = m_new
            parts.append((m, total, acc))
        if num_splits == 1:
            m, total, acc = parts[0]
            inv = torch.where(total == 0, torch.zeros_like(total), 1.0 / total)
            o = acc * (inv * v_scale)[..., None]
        else:
            m_max = torch.stack([m for m, _, _ in parts]).amax(0)
            m_max = torch.where(m_max == float("-inf"), torch.zeros_like(m_max), m_max)
            w = [torch.exp2(m - m_max) for m, _, _ in parts]
            num = sum(acc * v_scale * wi[..., None] for (_, _, acc), wi in zip(parts, w))
            den = sum(t * wi for (_, t, _), wi in zip(parts, w))
            o = num / torch.where(den == 0, torch.ones_like(den), den)[..., None]
        out[start : start + n] = o.transpose(0, 1).to(query.dtype)
        start += n
    return out
