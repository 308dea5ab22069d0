"""Plain-torch ground truth for the KV cache ops: the paged store and paged attention.

KV cache per layer: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (index 0 = K, 1 = V).
Slot ``s`` lives in block ``s // block_size`` at offset ``s % block_size``; slot -1 is padding.
fp8 caches are ``torch.uint8`` bytes: stored ``fp8(clamp(x_fp32 / scale, -max, max))`` (round to
nearest even, saturating), read back as ``float32(q) * scale`` (vLLM's per-tensor convention).
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
    # the scales as float32 tensors on that device, made once per layer rather than per store
    k_scale_t: torch.Tensor = field(init=False, repr=False, compare=False)
    v_scale_t: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("k_scale", "v_scale"):
            object.__setattr__(self, f"{name}_t", torch.tensor(getattr(self, name), dtype=torch.float32, device=self.device))


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
