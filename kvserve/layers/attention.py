"""Attention layer over the paged KV cache: stores this step's K/V, then attends.

Each layer owns its cache tensor, its per-tensor scales (``k_scale``, ``v_scale``, ``q_scale``: the
query's, used where vLLM's FLASH_ATTN / TRITON_ATTN read e4m3 pages with a quantized query;
``prob_scale`` is kept for vLLM parity) and its kernels: ``reference`` (plain torch, any device) or
``triton`` (fused store + unified paged attention kernels; CUDA, or the Triton interpreter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvserve.kernels import reference
from kvserve.quant.kv_cache_dtype import KVCacheDtype


def decode_order(seq_lens: list[int]) -> list[int]:
    """A decode batch's sequences longest first (ties in batch order): the order the triton
    kernel's programs launch in, so the short ones fill in behind the long ones at the end."""
    return sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)  # (stable; ~12 us at 256)


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what each sequence attends to (built by the runner)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks] (int64 reference, int32 triton)
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context + new tokens per sequence
    block_size: int = 16
    # triton backend: the same lengths as device tensors, and the batch maxima
    query_start_loc: torch.Tensor | None = None  # [num_seqs + 1] int32
    seq_lens_t: torch.Tensor | None = None  # [num_seqs] int32
    max_query_len: int = 0
    max_seq_len: int = 0
    num_splits: int | None = None  # split-KV parts (None: chosen per batch; fixed in CUDA graphs)
    decode_order_t: torch.Tensor | None = None  # decode-only batches: [num_seqs] int32, longest first
    # hybrid models (Gated DeltaNet layers): each sequence's recurrent-state slot and whether its
    # state holds earlier tokens (num_computed_tokens > 0) or starts from zeros
    state_slots: list[int] | None = None
    has_initial_state: list[bool] | None = None
    state_slots_t: torch.Tensor | None = None  # the same as int32 device tensors (triton backend)
    has_initial_state_t: torch.Tensor | None = None
    _plan: reference.AttentionPlan | None = None
    _gdn_chunks: Any = None  # kernels.triton_gdn.ChunkPlan

    @property
    def gdn_chunks(self) -> Any:
        """The GDN prefill's chunk plan (triton backend), built once per step for all layers."""
        if self._gdn_chunks is None:
            from kvserve.kernels.triton_gdn import plan_chunks

            assert self.query_start_loc is not None
            self._gdn_chunks = plan_chunks(self.query_lens, self.query_start_loc.device)
        return self._gdn_chunks

    @property
    def plan(self) -> reference.AttentionPlan:
        """Gather indices for the reference backend, built once per step for all layers."""
        if self._plan is None:
            self._plan = reference.plan_attention(self.block_tables, self.query_lens, self.seq_lens, self.block_size)
        return self._plan


def head_geometry(cfg: Any) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of a Hugging Face config: ``num_key_value_heads``
    defaults to the query heads, ``head_dim`` to hidden_size / heads."""
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


class Attention(nn.Module):
    """Multi-head / grouped-query attention of one layer; owns that layer's KV cache tensor."""

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float, layer_idx: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner
        self.k_scale = self.v_scale = self.q_scale = self.prob_scale = 1.0  # set after loading
        self.cache_quant: reference.CacheQuant | None = None  # set by bind_kv_cache for fp8
        self.backend = "reference"

    def bind_kv_cache(
        self, kv_cache: torch.Tensor, kv_dtype: KVCacheDtype, backend: str = "reference",
        query_fp8: bool = False, p_shift: int = 0,
    ) -> None:
        """Attach this layer's pages and kernels; an fp8 cache (uint8 bytes) also fixes the
        store/read scales and, with ``query_fp8`` (triton kernels, e4m3 pages), the quantized-query
        read with P scaled by 2^p_shift (``attention_backend.AttentionBackend``)."""
        assert not query_fp8 or backend == "triton", "the quantized-query read runs in the triton kernels"
        self.kv_cache = kv_cache
        self.backend = backend
        self.cache_quant = None
        if kv_dtype.is_fp8:
            assert kv_dtype.fp8_dtype is not None
            self.cache_quant = reference.CacheQuant(
                kv_dtype.fp8_dtype, kv_dtype.fp8_max, self.k_scale, self.v_scale, kv_cache.device,
                query_fp8=query_fp8 and kv_dtype.fp8_dtype == torch.float8_e4m3fn, q_scale=self.q_scale,
                p_shift=p_shift,
            )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq * D]."""
        assert self.kv_cache is not None, "KV cache not bound"
        if self.backend == "triton":
            from kvserve.kernels import triton_attention, triton_store

            triton_store.store_kv(k, v, self.kv_cache, meta.slot_mapping, self.cache_quant)
            assert meta.query_start_loc is not None and meta.seq_lens_t is not None
            out = triton_attention.paged_attention(
                q, self.kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens_t, self.scale,
                meta.max_query_len, meta.max_seq_len, self.cache_quant, num_splits=meta.num_splits,
                order=meta.decode_order_t,
            )
            return out.flatten(1)
        reference.store_kv(k, v, self.kv_cache, meta.slot_mapping, self.cache_quant)
        out = reference.paged_attention(
            q, self.kv_cache, meta.block_tables, meta.query_lens, meta.seq_lens, self.scale, meta.plan,
            self.cache_quant,
        )
        return out.flatten(1)
