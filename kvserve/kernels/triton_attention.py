"""Triton unified paged attention over bf16/fp16/fp32 or fp8 pages (API stub; kernel in progress).

paged_attention(query [T, Hq, D], kv_cache [NB, 2, BS, Hk, D] (uint8 bytes for fp8),
                block_tables [B, M] int32, query_start_loc [B + 1] int32, seq_lens [B] int32,
                scale, max_query_len, max_seq_len, quant=None, out=None, num_splits=None) -> [T, Hq, D]
Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1], at positions
seq_lens[i] - query_len_i .. seq_lens[i] - 1 (causal over its cached context plus itself), exactly
as kernels.reference.paged_attention with query_lens/seq_lens lists.
"""
