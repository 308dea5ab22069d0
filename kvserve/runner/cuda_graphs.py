"""CUDA graphs for decode-only batches (vLLM's capture sizes; ``--enforce-eager`` turns them off).

One graph of the model forward per capture size, captured largest first into one shared memory
pool. A decode batch of ``n`` sequences replays the smallest graph of size ``>= n``: its inputs are
copied into static buffers, the rows past ``n`` are padding (slot -1 writes nothing, sequence length
0 reads nothing), and the first ``n`` rows of the output are returned. Only the triton backend is
captured (the reference backend has data-dependent shapes).

Hybrid models (Gated DeltaNet layers) also get static recurrent-state slot and has-initial-state
buffers. The GDN kernels write every row's state back, so padding rows point at the scratch slot,
a state row past the live and snapshot rows that no sequence owns, and start from zeros (the
scratch row is never read): a padded replay changes only its live sequences' states. State copies
(prefix-cache restores before the step, snapshots after it) stay outside the graphs, queued on
the same stream."""

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


def graph_size(sizes: list[int], n: int) -> int | None:
    """The smallest capture size (``sizes`` ascending) that holds a decode batch of ``n`` rows;
    None when ``n`` is larger than all of them."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def fit_capture_sizes(sizes: list[int], max_num_seqs: int) -> list[int]:
    """Capture sizes for a lowered ``max_num_seqs`` (hybrid models whose states do not all fit):
    those below it, and ``max_num_seqs`` itself in place of the larger ones."""
    if not sizes or sizes[-1] <= max_num_seqs:
        return list(sizes)
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


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
        self.arange = torch.arange(n, dtype=torch.int32, device=dev)
        self.decode_order = self.arange.clone()  # the batch's rows longest first, then the padding rows
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=dev)
        # hybrid models: each row's state slot (padding rows: the scratch slot) and whether it is read
        self.scratch_slot = runner.state_scratch_row
        self.state_slots: torch.Tensor | None = None
        self.has_initial_state: torch.Tensor | None = None
        if runner.state_pool is not None:
            assert self.scratch_slot is not None, "hybrid decode graphs need a scratch state row for padding"
            self.state_slots = torch.full((n,), self.scratch_slot, dtype=torch.int32, device=dev)
            self.has_initial_state = torch.zeros(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        from kvserve.kernels.triton_attention import choose_num_splits

        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_lens=[1] * size,
            seq_lens=[1] * size,
            block_size=self.runner.block_size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens_t=self.seq_lens[:size],
            decode_order_t=self.decode_order[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            # fixed per graph: sized for the longest context, empty parts exit at once
            num_splits=choose_num_splits(size, self.num_kv_heads, self.max_model_len, self.runner.device),
        )
        if self.state_slots is not None and self.has_initial_state is not None:
            # the triton GDN path reads the device tensors; the host lists only describe the capture
            meta.state_slots, meta.has_initial_state = [self.scratch_slot] * size, [False] * size
            meta.state_slots_t, meta.has_initial_state_t = self.state_slots[:size], self.has_initial_state[:size]
        return meta

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

    def load_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy a decode batch into the static buffers (queued on the stream, after whatever
        produced its inputs) and reset the padding rows; returns the graph size to replay."""
        n = len(meta.query_lens)
        size = graph_size(self.sizes, n)
        assert size is not None and meta.seq_lens_t is not None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens_t)
        self.decode_order[:n].copy_(meta.decode_order_t if meta.decode_order_t is not None else self.arange[:n])
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if self.state_slots is not None and self.has_initial_state is not None:
            assert meta.state_slots_t is not None and meta.has_initial_state_t is not None
            self.state_slots[:n].copy_(meta.state_slots_t)
            self.has_initial_state[:n].copy_(meta.has_initial_state_t)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(0)
            self.decode_order[n:size].copy_(self.arange[n:size])
            if self.state_slots is not None and self.has_initial_state is not None:
                self.state_slots[n:size].fill_(self.scratch_slot)
                self.has_initial_state[n:size].fill_(0)
        return size

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the smallest graph that holds the batch; returns the batch's hidden states."""
        size = self.load_inputs(input_ids, positions, meta)
        self.graphs[size].replay()
        return self.outputs[size][: len(meta.query_lens)]
