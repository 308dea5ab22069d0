"""CUDA graphs for decode-only batches (vLLM's capture sizes; ``--enforce-eager`` turns them off).

One graph of the model forward per capture size, captured largest first into one shared memory
pool. A decode batch of ``n`` sequences replays the smallest graph of size ``>= n``: its inputs are
copied into static buffers, the rows past ``n`` are padding (slot -1 writes nothing, sequence length
0 reads nothing), and the first ``n`` rows of the output are returned. Only the triton backend is
captured (the reference backend has data-dependent shapes)."""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

import torch

from kvserve.layers.attention import AttentionMetadata
from kvserve.logger import init_logger

if TYPE_CHECKING:
    from kvserve.runner.runner_view import RunnerView

logger = init_logger(__name__)


class DecodeGraphs:
    def __init__(self, runner: "RunnerView", sizes: list[int]) -> None:
        self.runner = runner
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        mc = runner.config.model_config
        self.max_model_len = mc.max_model_len
        self.max_blocks = -(-mc.max_model_len // runner.block_size)
        self.num_kv_heads = mc.num_kv_heads
        dev, n = runner.device, self.max_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        from kvserve.kernels.triton_attention import choose_num_splits

        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_lens=[1] * size,
            seq_lens=[1] * size,
            block_size=self.runner.block_size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens_t=self.seq_lens[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            # fixed per graph: sized for the longest context, empty parts exit at once
            num_splits=choose_num_splits(size, self.num_kv_heads, self.max_model_len, self.runner.device),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        pool = None
        model = self.runner.model
        for size in reversed(self.sizes):
            meta = self._meta(size)
            model(self.input_ids[:size], self.positions[:size], meta)  # warm-up: compiles the kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = model(self.input_ids[:size], self.positions[:size], meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[size], self.outputs[size] = graph, out
        torch.cuda.synchronize()
        logger.info(
            "Captured CUDA graphs for %d decode batch sizes (%d..%d) in %.1f s, %.2f GiB",
            len(self.sizes), self.sizes[0], self.max_size, time.perf_counter() - t0,
            (free_before - torch.cuda.mem_get_info()[0]) / (1 << 30),
        )

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A decode-only batch that a captured graph holds."""
        return (
            meta.max_query_len == 1
            and len(meta.query_lens) <= self.max_size
            and meta.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the smallest graph that holds the batch; returns the batch's hidden states."""
        n = len(meta.query_lens)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        assert meta.seq_lens_t is not None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens_t)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(0)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.graphs[size].replay()
        return self.outputs[size][:n]
