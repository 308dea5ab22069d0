"""Plain-torch ground truth for the KV cache ops: the paged store and paged attention.

KV cache per layer: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (index 0 = K, 1 = V).
Slot ``s`` lives in block ``s // block_size`` at offset ``s % block_size``; slot -1 is padding.
"""

from __future__ import annotations

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
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_cache[blocks, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value.to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first ``seq_len`` positions: [seq_len, kv_heads, head]."""
    num_blocks = -(-seq_len // kv_cache.shape[2])
    pages = kv_cache[block_ids[:num_blocks]]  # [n, 2, bs, h, d]
    k = pages[:, 0].flatten(0, 1)[:seq_len]
    v = pages[:, 1].flatten(0, 1)[:seq_len]
    return k, v


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
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context plus themselves.

    query: [T, Hq, D] (the tokens of all sequences back to back); sequence i owns ``query_lens[i]``
    tokens at positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``. Softmax and
    accumulation run in float32; the result has the query's dtype.
    """
    out = torch.empty_like(query)
    decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)

    # Decodes: one batched call over the padded context; padding keys are masked out.
    if decode_rows:
        max_len = max(seq_lens[i] for i in decode_rows)
        ks, vs, masks = [], [], []
        for i in decode_rows:
            k, v = gather_kv(kv_cache, block_tables[i], seq_lens[i])
            pad = max_len - seq_lens[i]
            ks.append(F.pad(k, (0, 0, 0, 0, 0, pad)))
            vs.append(F.pad(v, (0, 0, 0, 0, 0, pad)))
            masks.append(torch.arange(max_len) < seq_lens[i])
        k = torch.stack(ks).float().transpose(1, 2)
        v = torch.stack(vs).float().transpose(1, 2)
        rows = torch.tensor([starts[i] for i in decode_rows])
        q = query[rows].float().unsqueeze(2)  # [B, Hq, 1, D]
        mask = torch.stack(masks)[:, None, None, :]
        out[rows] = _attend(q, k, v, mask, scale).squeeze(2).to(query.dtype)

    # Prefill chunks: one call each, causal with an offset for the cached context.
    for i, n in enumerate(query_lens):
        if n == 1:
            continue
        k, v = gather_kv(kv_cache, block_tables[i], seq_lens[i])
        q = query[starts[i] : starts[i] + n].float().transpose(0, 1).unsqueeze(0)
        k = k.float().transpose(0, 1).unsqueeze(0)
        v = v.float().transpose(0, 1).unsqueeze(0)
        ctx = seq_lens[i] - n
        q_pos = torch.arange(ctx, seq_lens[i]).unsqueeze(1)
        mask = torch.arange(seq_lens[i]).unsqueeze(0) <= q_pos
        o = _attend(q, k, v, mask, scale)
        out[starts[i] : starts[i] + n] = o.squeeze(0).transpose(0, 1).to(query.dtype)
    return out
