"""Kernel warm-up at start (triton backend): every Triton kernel variant a run can meet is compiled
before the first request, as vLLM's start-up dummy runs do, so no request waits on a JIT compile
mid-serving (on the H200 the e2e benchmark's first batch otherwise waited ~1.4 s more for its first
token; benchmarks/HISTORY.md).

Which variants exist: the store picks its tokens per program from the token count (powers of two,
``triton_store.store_plan``), the attention kernel has a prefill, a decode and a split-KV decode
variant, and Triton specializes integer arguments on 1 / multiples of 16 / the rest. So the
warm-up runs dummy forwards of ``n`` tokens for ``n`` = 1, 2, 4, ... ``max_num_batched_tokens``
and one odd count, each as prefill chunks plus one decode row, then decode-only batches of one
and of ``max_num_seqs`` rows, and the fused sampler. Nothing is written to the KV cache (every
slot is -1, which the store skips) and no block is allocated; the pages it reads are ignored."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from kvserve.layers.attention import AttentionMetadata
from kvserve.logger import init_logger

if TYPE_CHECKING:
    from kvserve.runner.runner_view import RunnerView

logger = init_logger(__name__)


def warm_up_token_counts(max_num_batched_tokens: int) -> list[int]:
    """Token counts of the mixed warm-up batches: powers of two up to the step budget, the
    budget itself and one odd count above 2 (for Triton's integer specializations)."""
    counts = {1 << i for i in range(max_num_batched_tokens.bit_length()) if 1 << i <= max_num_batched_tokens}
    counts.add(max_num_batched_tokens)
    odd = max_num_batched_tokens - 1 if max_num_batched_tokens % 2 == 0 else max_num_batched_tokens
    if odd > 2:
        counts.add(odd)
    return sorted(counts)


def _batch(runner: "RunnerView", query_lens: list[int], num_splits: int | None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Dummy inputs of one step: sequences with no cached context, slots -1 (no KV writes)."""
    dev, bs = runner.device, runner.block_size
    n = sum(query_lens)
    positions = torch.cat([torch.arange(q, dtype=torch.long, device=dev) for q in query_lens])
    width = max(1, -(-max(query_lens) // bs))
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.long, device=dev),
        block_tables=torch.zeros((len(query_lens), width), dtype=torch.int32, device=dev),
        query_lens=list(query_lens),
        seq_lens=list(query_lens),
        block_size=bs,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens_t=torch.tensor(query_lens, dtype=torch.int32, device=dev),
        max_query_len=max(query_lens),
        max_seq_len=max(query_lens),
        num_splits=num_splits,
    )
    if meta.max_query_len == 1:  # the decode kernels as the runner launches them (ordered)
        meta.decode_order_t = torch.arange(len(query_lens), dtype=torch.int32, device=dev)
    if runner.state_pool is not None:  # hybrid models: fresh states (the slots are rewritten at each start)
        meta.state_slots = [i % runner.state_pool.num_slots for i in range(len(query_lens))]
        meta.has_initial_state = [False] * len(query_lens)
        meta.state_slots_t = torch.tensor(meta.state_slots, dtype=torch.int32, device=dev)
        meta.has_initial_state_t = torch.zeros(len(query_lens), dtype=torch.int32, device=dev)
    return torch.zeros(n, dtype=torch.long, device=dev), positions, meta


@torch.inference_mode()
def warm_up_kernels(runner: "RunnerView") -> int:
    """Run the warm-up forwards (see the module docstring); returns how many ran."""
    t0 = time.perf_counter()
    sc, mc = runner.config.scheduler_config, runner.config.model_config
    batches: list[tuple[list[int], int | None]] = []
    longest = max(1, mc.max_model_len - 1)  # positions stay inside the model's length
    for n in warm_up_token_counts(sc.max_num_batched_tokens):
        if n <= 2:
            batches.append(([n], None))
            continue
        chunks, left = [], n - 1  # prefill chunks of at most max_model_len - 1 tokens, one decode row
        while left:
            chunks.append(min(left, longest))
            left -= chunks[-1]
        batches.append((chunks + [1], None))
    # decode-only batches run eager when graphs are off (or too small); split and not split
    for rows in sorted({1, sc.max_num_seqs}):
        splits = None
        if runner.device.type == "cuda":
            from kvserve.kernels.triton_attention import choose_num_splits

            splits = choose_num_splits(rows, mc.num_kv_heads, mc.max_model_len, runner.device)
        batches.append(([1] * rows, splits))
    for query_lens, splits in batches:
        ids, positions, meta = _batch(runner, query_lens, splits)
        hidden = runner.model(ids, positions, meta)
        last = torch.tensor([sum(query_lens[: i + 1]) - 1 for i in range(len(query_lens))], device=runner.device)
        logits = runner.model.compute_logits(hidden[last])
    if runner.sampler.fused:
        from kvserve.kernels.triton_sampling import gumbel_argmax

        # one row (vocabulary split over programs) and the last batch (maybe one program a row)
        for part in (logits[:1], logits):
            rows = part.shape[0]
            zeros = torch.zeros(rows, dtype=torch.int32, device=runner.device)
            gumbel_argmax(part, torch.full((rows,), 0.7, device=runner.device), zeros, zeros)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    logger.info("Warmed up the kernels with %d dummy steps in %.1f s", len(batches), time.perf_counter() - t0)
    return len(batches)
