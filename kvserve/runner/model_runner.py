"""Model runner: scheduled batch -> tensors (token ids, positions, slot mapping, block tables),
forward pass, logits of the sampling positions, sampling."""

from __future__ import annotations

import time

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.layers.attention import AttentionMetadata
from kvserve.loader.weights import iterate_weights
from kvserve.logger import init_logger
from kvserve.models.registry import build_model
from kvserve.runner import memory
from kvserve.runner.sampler import Sampler, SampleResult, SamplingRow

logger = init_logger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc, cc = config.model_config, config.cache_config
        self.device = config.device
        self.block_size = cc.block_size
        torch.manual_seed(mc.seed)

        t0 = time.perf_counter()
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(mc.dtype)
        try:
            with torch.device(self.device):
                self.model = build_model(mc.architecture, mc.hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.load_weights(iterate_weights(mc.model))
        self.model.eval()
        logger.info(
            "Loaded %s (%s) from %s in %.1f s", mc.architecture, str(mc.dtype).replace("torch.", ""),
            mc.model, time.perf_counter() - t0,
        )

        self.kv_spec = memory.KVCacheSpec(
            num_layers=len(self.model.attention_layers()),
            block_size=cc.block_size,
            num_kv_heads=mc.num_kv_heads,
            head_size=mc.head_size,
            dtype=memory.kv_cache_torch_dtype(cc, mc),
        )
        if self.device.type == "cuda" and cc.kv_cache_memory is None:
            budget = memory.gpu_kv_budget(cc.gpu_memory_utilization, self._profile_peak_bytes(), self.device)
        else:
            budget = int(cc.kv_cache_memory or 0)
        cc.num_blocks = memory.plan_num_blocks(self.kv_spec, budget, mc.max_model_len, cc.num_gpu_blocks_override)
        memory.log_plan(self.kv_spec, cc.num_blocks, mc.max_model_len, self.device)
        self.kv_caches = []
        for layer in self.model.attention_layers():
            cache = torch.empty(
                (cc.num_blocks, 2, cc.block_size, mc.num_kv_heads, mc.head_size),
                dtype=self.kv_spec.dtype, device=self.device,
            )
            layer.kv_cache = cache
            self.kv_caches.append(cache)

        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}

    def _profile_peak_bytes(self) -> int:
        """Activation peak of one max-size step, measured before the KV cache exists (GPU)."""
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        n = self.config.scheduler_config.max_num_batched_tokens
        hidden = torch.zeros(n, self.config.model_config.hf_config.hidden_size, dtype=self.config.model_config.dtype, device=self.device)
        logits = self.model.compute_logits(hidden[: self.config.scheduler_config.max_num_seqs])
        del hidden, logits
        peak = torch.cuda.max_memory_allocated(self.device) - base
        return int(peak * 4)  # a conservative factor for the layer activations not run here

    def remove_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[request_id] = gen
        return gen

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        ids: list[int] = []
        positions, slots, logits_idx = [], [], []
        query_lens, seq_lens = [], []
        max_blocks = max(len(s.block_ids) for s in sched.scheduled)
        tables = np.zeros((len(sched.scheduled), max_blocks), dtype=np.int64)
        offset = 0
        for row, s in enumerate(sched.scheduled):
            start, n = s.num_computed_tokens, s.num_new_tokens
            ids.extend(s.request.all_token_ids[start : start + n])
            pos = np.arange(start, start + n, dtype=np.int64)
            table = np.asarray(s.block_ids, dtype=np.int64)
            tables[row, : len(table)] = table
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            seq_lens.append(start + n)
            offset += n
            if s.samples:
                logits_idx.append(offset - 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_size=bs,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        return input_ids, pos_t, meta, logits_idx

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> dict[str, SampleResult]:
        """Run one step; returns the sampled token of every request that reached its last known token."""
        input_ids, positions, meta, logits_idx = self.prepare(sched)
        hidden = self.model(input_ids, positions, meta)
        sampling = [s for s in sched.scheduled if s.samples]
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(logits_idx, device=self.device)])
        rows = [
            SamplingRow(
                s.request.sampling_params,
                self._generator(s.request.request_id, s.request.sampling_params.seed),
                s.request.num_output_tokens,
            )
            for s in sampling
        ]
        results = self.sampler(logits, rows)
        return {s.request.request_id: r for s, r in zip(sampling, results)}
