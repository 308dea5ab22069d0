"""Plain-torch ground truth for the KV cache ops: the paged store and paged attention.

KV cache per layer: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (index 0 = K, 1 = V).
Slot ``s`` lives in block ``s // block_size`` at offset ``s % block_size``; slot -1 is padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ([T, kv_heads, head]) into their slots; slot -1 writes nothing."""
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    rows_k = _k_rows(slot_mapping // block_size, slot_mapping % block_size, block_size)
    rows = _rows_view(kv_cache)
    rows.index_copy_(0, rows_k, key.to(kv_cache.dtype))
    rows.index_copy_(0, rows_k + block_size, value.to(kv_cache.dtype))


@dataclass
class AttentionPlan:
    """Gather indices for one step, shared by every layer (built once per step)."""

    decode_rows: torch.Tensor  # [Bd] query rows of the decode sequences
    decode_k_rows: torch.Tensor  # [Bd, L] cache row of each context key (padding: position 0's row)
    decode_mask: torch.Tensor  # [Bd, 1, 1, L] True where the key is real
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (q_start, q_len, seq_len, K rows of positions)


def _k_rows(blocks: torch.Tensor, offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """Row of a key in the cache viewed as ``[num_blocks * 2 * block_size, heads, head]``; V is ``+ block_size``."""
    return blocks * (2 * block_size) + offsets


def _rows_view(kv_cache: torch.Tensor) -> torch.Tensor:
    nb, _, bs, h, d = kv_cache.shape
    return kv_cache.view(nb * 2 * bs, h, d)


def plan_attention(
    block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int], block_size: int
) -> AttentionPlan:
    device = block_tables.device
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    decode = [i for i, n in enumerate(query_lens) if n == 1]
    max_len = max((seq_lens[i] for i in decode), default=1)
    pos = torch.arange(max_len, device=device)
    if decode:
        lens = torch.tensor([seq_lens[i] for i in decode], device=device)
        mask = pos.unsqueeze(0) < lens.unsqueeze(1)
        safe_pos = torch.where(mask, pos.unsqueeze(0), torch.zeros_like(pos).unsqueeze(0))
        tables = block_tables[torch.tensor(decode, device=device)]
        rows = _k_rows(tables.gather(1, safe_pos // block_size), safe_pos % block_size, block_size)
    else:
        mask = torch.zeros(0, max_len, dtype=torch.bool, device=device)
        rows = torch.zeros(0, max_len, dtype=torch.long, device=device)
    prefills = []
    for i, n in enumerate(query_lens):
        if n != 1:
            p = torch.arange(seq_lens[i], device=device)
            k_rows = _k_rows(block_tables[i][p // block_size], p % block_size, block_size)
            prefills.append((starts[i], n, seq_lens[i], k_rows))
    return AttentionPlan(
        decode_rows=torch.tensor([starts[i] for i in decode], dtype=torch.long, device=device),
        decode_k_rows=rows,
        decode_mask=mask[:, None, None, :],
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
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context plus themselves.

    query: [T, Hq, D] (the tokens of all sequences back to back); sequence i owns ``query_lens[i]``
    tokens at positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``. K/V are read from the
    pages, softmax and accumulation run in float32; the result has the query's dtype.
    """
    if plan is None:
        plan = plan_attention(block_tables, query_lens, seq_lens, kv_cache.shape[2])
    out = torch.empty_like(query)
    cache_rows, block_size = _rows_view(kv_cache), kv_cache.shape[2]

    # Decodes: one batched call over the padded contexts; padding keys are masked out.
    if plan.decode_rows.numel():
        b, length = plan.decode_k_rows.shape
        flat = plan.decode_k_rows.flatten()
        k = cache_rows.index_select(0, flat).float().view(b, length, *cache_rows.shape[1:]).transpose(1, 2)
        v = cache_rows.index_select(0, flat + block_size).float().view(b, length, *cache_rows.shape[1:]).transpose(1, 2)
        q = query[plan.decode_rows].float().unsqueeze(2)  # [B, Hq, 1, D]
        out[plan.decode_rows] = _attend(q, k, v, plan.decode_mask, scale).squeeze(2).to(query.dtype)

    # Prefill chunks: one call each, causal with an offset for the cached context.
    for start, n, seq_len, k_rows in plan.prefills:
        k = cache_rows.index_select(0, k_rows).float().transpose(0, 1).unsqueeze(0)
        v = cache_rows.index_select(0, k_rows + block_size).float().transpose(0, 1).unsqueeze(0)
        q = query[start : start + n].float().transpose(0, 1).unsqueeze(0)
        if n == seq_len:  # no cached context: plain causal (lets SDPA take its fused path)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        else:
            q_pos = torch.arange(seq_len - n, seq_len, device=query.device).unsqueeze(1)
            mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= q_pos
            o = _attend(q, k, v, mask, scale)
        out[start : start + n] = o.squeeze(0).transpose(0, 1).to(query.dtype)
    return out
