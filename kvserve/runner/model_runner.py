"""Model runner: scheduled batch -> tensors (token ids, positions, slot mapping, block tables),
forward pass, logits of the sampling positions, sampling."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.layers.attention import Attention, AttentionMetadata, decode_order
from kvserve.loader.weights import iterate_weights
from kvserve.logger import init_logger
from kvserve.models.registry import build_model
from kvserve.quant.kv_scales import KVScaleLoader
from kvserve.runner import memory
from kvserve.runner.block_table import BlockTable
from kvserve.runner.cuda_graphs import DecodeGraphs, fit_capture_sizes, graph_size
from kvserve.runner.sampler import Sampler, SampleResult, SamplingRow, gather_logprobs
from kvserve.runner.state_pool import StatePool, StateSpec
from kvserve.runner.transfer import rows_to_device, to_device
from kvserve.runner.warmup import warm_up_kernels

PromptLogprobRows = list[tuple[list[int], list[float], int]]
_PROMPT_LOGPROB_CHUNK = 512  # rows of full-vocabulary logits computed at once

logger = init_logger(__name__)


@dataclass
class PendingSamples:
    """One step's sampled tokens on their way to the host (async scheduling): the copy was
    queued behind the step; ``results`` waits for it."""

    request_ids: list[str]
    tokens: torch.Tensor  # host tensor, valid once ``event`` has completed
    event: torch.cuda.Event | None

    def results(self) -> dict[str, SampleResult]:
        if self.event is not None:
            self.event.synchronize()
        return {rid: SampleResult(t) for rid, t in zip(self.request_ids, self.tokens.tolist())}


def init_dummy_weights(model: torch.nn.Module, seed: int, low: float = -1e-3, high: float = 1e-3) -> None:
    """``--load-format dummy``: every parameter uniform in [low, high] (vLLM's DummyModelLoader
    range), seeded; norm weights too, so nothing is all zeros. For benchmarks only."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for p in model.parameters():
            if p.device not in gens:
                gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            if p.is_floating_point() and p.dtype != torch.float8_e4m3fn:
                p.uniform_(low, high, generator=gens[p.device])
        for m in model.modules():  # packed quantized weights (layers/quant_linear.py, layers/quant_experts.py)
            if hasattr(m, "init_dummy"):
                dev = next(m.parameters()).device
                m.init_dummy(gens.setdefault(dev, torch.Generator(device=dev).manual_seed(seed)))


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc, cc = config.model_config, config.cache_config
        self.device = config.device
        self.block_size = cc.block_size
        assert cc.kv_dtype is not None, "CacheConfig.kv_dtype is set by EngineArgs.create_engine_config"
        self.kv_dtype = cc.kv_dtype
        torch.manual_seed(mc.seed)
        qc = mc.quant_config
        quantized = qc is not None and qc.quantizes_weights

        t0 = time.perf_counter()
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(mc.dtype)
        try:
            with torch.device(self.device):
                self.model = build_model(mc.architecture, mc.hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        kept: set[str] = set()
        if quantized:
            from kvserve.layers.quantized_model import prepare_quantized_model

            assert qc is not None
            kept = prepare_quantized_model(self.model, qc, self.model.stacked_params,
                                           config.runner_config.attention_backend == "triton", mc.dtype)
        attention = {name: m for name, m in self.model.named_modules() if isinstance(m, Attention)}
        scales = KVScaleLoader(attention, cc.kv_quant)
        if mc.load_format == "dummy":
            init_dummy_weights(self.model, mc.seed)
        else:
            weights = iterate_weights(mc.model)
            if getattr(self.model, "is_hybrid", False):
                from kvserve.models.qwen3_next import renamed_weights

                weights = renamed_weights(weights)  # image-text checkpoints' prefixes, before the scales
            if quantized:
                from kvserve.loader.quantized_weights import dequantized_weights

                weights = dequantized_weights(weights, qc, kept)
            self.model.load_weights(scales.filter(weights))
        if quantized:
            from kvserve.layers.quantized_model import finalize_quantized_model

            # after loading or the dummy fill, before the memory plan (the W4A16 large-batch buffer)
            finalize_quantized_model(self.model, self.config.scheduler_config.max_num_batched_tokens, mc.dtype)
        scales.finish(self.kv_dtype)
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
        # hybrid models: the GDN layers' recurrent state, one slot per running sequence, in its own pool
        self.gdn_layers = list(self.model.gdn_layers()) if getattr(self.model, "is_hybrid", False) else []
        self.backend = config.runner_config.attention_backend
        if self.backend == "triton" and mc.dtype in (torch.bfloat16, torch.float16):
            # one Triton kernel each for the norms, rotary and SiLU-mul, grouped GEMMs for routed experts
            # (float32 keeps torch's ops); before the graph decision: fused experts can be captured
            for module in self.model.modules():
                if hasattr(module, "fused"):
                    module.fused = True
        capture = self._wants_graphs()
        # decode graphs of a hybrid model: one scratch state row for their padding rows (after the snapshots)
        num_scratch = 1 if capture and self.gdn_layers else 0
        num_slots = config.scheduler_config.max_num_seqs
        state_specs = [
            StateSpec(*layer.state_shapes(), conv_bytes_per_elem=torch.empty((), dtype=mc.dtype).element_size())
            for layer in self.gdn_layers
        ]
        per_seq = sum(spec.bytes_per_sequence for spec in state_specs)
        gpu_budget = self.device.type == "cuda" and cc.kv_cache_memory is None
        if gpu_budget:
            budget = memory.gpu_kv_budget(cc.gpu_memory_utilization, self._profile_peak_bytes(), self.device)
            if state_specs:  # the live states come first, at most half the budget (fewer sequences if need be)
                num_slots = memory.num_state_slots(num_slots, per_seq, budget - num_scratch * per_seq)
                config.scheduler_config.max_num_seqs = num_slots
                rc = config.runner_config
                rc.cudagraph_capture_sizes = fit_capture_sizes(rc.cudagraph_capture_sizes, num_slots)
            budget -= (num_slots + num_scratch) * per_seq
        else:
            budget = int(cc.kv_cache_memory or 0)
        # hybrid prefix caching ('align'): snapshot slots after the live ones, a snapshot every
        # ``snapshot_interval`` tokens (the KV manager keys them by block hash)
        self.num_snapshot_slots, self.snapshot_interval = 0, 0
        if state_specs and cc.mamba_cache_mode == "align":
            self.snapshot_interval = memory.snapshot_interval(
                self.kv_spec, state_specs[0].bytes_per_sequence, cc.mamba_block_size
            )
            self.num_snapshot_slots = memory.num_snapshot_slots(num_slots, per_seq, budget if gpu_budget else None)
            if self.num_snapshot_slots == 0:
                logger.warning("Prefix caching is disabled: not one recurrent-state snapshot fits in memory.")
            if gpu_budget:
                budget -= self.num_snapshot_slots * per_seq
        cc.num_blocks = memory.plan_num_blocks(self.kv_spec, budget, mc.max_model_len, cc.num_gpu_blocks_override)
        memory.log_plan(self.kv_spec, cc.num_blocks, mc.max_model_len, self.device, self.kv_dtype.name)
        self.block_table: BlockTable | None = None
        if self.backend == "triton":
            self.block_table = BlockTable(
                config.scheduler_config.max_num_seqs, -(-mc.max_model_len // cc.block_size), self.device
            )
        self.kv_caches = []
        for layer in self.model.attention_layers():
            # Zero-filled like vLLM's byte buffers (an fp8 cache starts as +0.0).
            cache = torch.zeros(
                (cc.num_blocks, 2, cc.block_size, mc.num_kv_heads, mc.head_size),
                dtype=self.kv_spec.dtype, device=self.device,
            )
            choice = config.runner_config.attention
            layer.bind_kv_cache(cache, self.kv_dtype, self.backend, choice.query_fp8, choice.p_shift)
            self.kv_caches.append(cache)

        self.state_pool: StatePool | None = None
        self.state_scratch_row: int | None = None
        if self.gdn_layers:
            self.state_pool = StatePool(num_slots)
            # snapshot slot i is row num_slots + i; the scratch row (decode graphs only) is the last
            rows = num_slots + self.num_snapshot_slots + num_scratch
            if num_scratch:
                self.state_scratch_row = rows - 1
            for layer in self.gdn_layers:
                conv_shape, ssm_shape = layer.state_shapes()
                layer.bind_state(
                    torch.zeros((rows, *conv_shape), dtype=mc.dtype, device=self.device),
                    torch.zeros((rows, *ssm_shape), dtype=torch.float32, device=self.device),
                    self.backend,
                )
            memory.log_state_pool(
                state_specs, num_slots, self.device, self.num_snapshot_slots, self.snapshot_interval, num_scratch
            )

        # one fused Triton kernel for temperature-only batches on CUDA (torch's ops elsewhere)
        self.sampler = Sampler(fused=self.device.type == "cuda")
        self.generators: dict[str, torch.Generator] = {}
        self._rows: dict[str, SamplingRow] = {}  # each live request's sampling row (see _sampling_rows)
        # async scheduling: the last step's sampled tokens stay on the device; a decode row whose
        # input is one of them (its position is past the known tokens) gathers it from here
        self._prev_tokens: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        self.host_state_requests: set[str] | None = None  # set by the engine (see EngineCore._sync_ids)
        if self.backend == "triton" and self.device.type == "cuda":
            warm_up_kernels(self)  # no request waits on a Triton compile later
        self.graphs: DecodeGraphs | None = None
        if capture:
            self.graphs = DecodeGraphs(self, config.runner_config.cudagraph_capture_sizes)
            self.graphs.capture()

    def _wants_graphs(self) -> bool:
        """Whether decode batches get CUDA graphs: not with --enforce-eager (always set off CUDA
        and for the reference backend), nor for a model whose forward cannot be captured (then
        enforce_eager is set, so that what the config reports is what runs)."""
        rc = self.config.runner_config
        if rc.enforce_eager or not rc.cudagraph_capture_sizes:
            return False
        if not self.model.supports_cuda_graphs:
            logger.info(
                "CUDA graphs are off for %s: its routed experts (MoE) read their token counts on the host, "
                "which a graph cannot capture.", self.config.model_config.architecture,
            )
            rc.enforce_eager = True
            return False
        return True

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
        self._rows.pop(request_id, None)
        if self.block_table is not None:
            self.block_table.remove(request_id)
        if self.state_pool is not None:
            self.state_pool.free(request_id)

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
        """Flatten the scheduled chunks into device tensors and the attention metadata."""
        bs = self.block_size
        ids: list[int] = []
        positions, slots, logits_idx = [], [], []
        query_lens, seq_lens = [], []
        triton = self.backend == "triton"
        if self.block_table is not None:
            for req in sched.preempted:  # its blocks are gone; it gets a row again when rescheduled
                self.block_table.remove(req.request_id)
        if self.state_pool is not None:
            for req in sched.preempted:  # its state is rebuilt by recompute when it is rescheduled
                self.state_pool.free(req.request_id)
        if not triton:
            max_blocks = max(len(s.block_ids) for s in sched.scheduled)
            tables = np.zeros((len(sched.scheduled), max_blocks), dtype=np.int64)
        offset = 0
        pending_dst: list[int] = []  # input rows whose token is on the device (async scheduling)
        pending_src: list[int] = []
        for row, s in enumerate(sched.scheduled):
            start, n = s.num_computed_tokens, s.num_new_tokens
            if not triton:
                tables[row, : len(s.block_ids)] = s.block_ids
            if n == 1:  # decode: no numpy per row
                known = s.request.all_token_ids
                if start < len(known):
                    ids.append(known[start])
                else:
                    ids.append(0)
                    pending_dst.append(offset)
                    pending_src.append(self._prev_rows[s.request.request_id])
                positions.append(start)
                slots.append(s.block_ids[start // bs] * bs + start % bs)
            else:
                ids.extend(s.request.all_token_ids[start : start + n])
                pos = np.arange(start, start + n, dtype=np.int64)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(s.block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
            query_lens.append(n)
            seq_lens.append(start + n)
            offset += n
            if s.samples:
                logits_idx.append(offset - 1)
        dev = self.device
        input_ids, pos_t, slot_mapping = rows_to_device((ids, positions, slots), torch.long, dev)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=(
                self.block_table.rows([s.request.request_id for s in sched.scheduled], [s.block_ids for s in sched.scheduled])
                if triton else to_device(tables, torch.long, dev)
            ),
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_size=bs,
        )
        if self.state_pool is not None:
            meta.state_slots, meta.has_initial_state = self._state_rows(sched)
        if triton:
            qsl = [0] + list(itertools.accumulate(query_lens))
            meta.max_query_len, meta.max_seq_len = max(query_lens), max(seq_lens)
            rows = [qsl, seq_lens]
            if meta.max_query_len == 1:  # decode-only: attention programs launch longest sequence first
                rows.append(decode_order(seq_lens))
            if meta.state_slots is not None:
                assert meta.has_initial_state is not None
                rows += [meta.state_slots, [int(h) for h in meta.has_initial_state]]
            on_device = rows_to_device(rows, torch.int32, dev)
            meta.query_start_loc, meta.seq_lens_t = on_device[:2]
            if meta.max_query_len == 1:
                meta.decode_order_t = on_device[2]
            if meta.state_slots is not None:
                meta.state_slots_t, meta.has_initial_state_t = on_device[-2:]
            if meta.max_query_len == 1 and dev.type == "cuda":
                # split-KV sized as in the CUDA graphs (by the padded batch size and max_model_len),
                # so eager and graph decode run the same attention kernels
                from kvserve.kernels.triton_attention import choose_num_splits

                mc = self.config.model_config
                num_seqs = len(query_lens)
                rows = graph_size(self.config.runner_config.cudagraph_capture_sizes, num_seqs) or num_seqs
                meta.num_splits = choose_num_splits(rows, mc.num_kv_heads, mc.max_model_len, dev)
        if pending_dst:
            assert self._prev_tokens is not None
            dst, src = rows_to_device((pending_dst, pending_src), torch.long, dev)
            input_ids[dst] = self._prev_tokens[src]
        return input_ids, pos_t, meta, logits_idx

    def _state_rows(self, sched: SchedulerOutput) -> tuple[list[int], list[bool]]:
        """Each scheduled sequence's state slot, and whether its state holds earlier tokens; a
        prefix-cache hit first gets its snapshot copied into its slot."""
        assert self.state_pool is not None
        slots, has_state = [], []
        restore_src, restore_dst = [], []
        for s in sched.scheduled:
            rid = s.request.request_id
            if s.restore_state_from is not None:
                restore_src.append(self.state_pool.num_slots + s.restore_state_from)
                restore_dst.append(self.state_pool.slot(rid))
            elif s.num_computed_tokens > 0 and not self.state_pool.holds(rid):
                raise RuntimeError(
                    f"request {rid!r} resumes at token {s.num_computed_tokens} without a recurrent state "
                    "(no live state slot and no snapshot to restore)"
                )
            slots.append(self.state_pool.slot(rid))
            has_state.append(s.num_computed_tokens > 0)
        if restore_src:
            self._copy_state_rows(restore_src, restore_dst)
        return slots, has_state

    def _save_state_snapshots(self, sched: SchedulerOutput) -> None:
        """After the step: copy the states of the sequences whose step ended on a snapshot position."""
        assert self.state_pool is not None
        src, dst = [], []
        for s in sched.scheduled:
            if s.save_state_to is not None:
                src.append(self.state_pool.slot(s.request.request_id))
                dst.append(self.state_pool.num_slots + s.save_state_to)
        if src:
            self._copy_state_rows(src, dst)

    def _copy_state_rows(self, src: list[int], dst: list[int]) -> None:
        """Copy conv and SSM state rows ``src`` -> ``dst`` in every GDN layer (queued on the stream)."""
        src_t, dst_t = rows_to_device((src, dst), torch.long, self.device)
        for layer in self.gdn_layers:
            layer.conv_state.index_copy_(0, dst_t, layer.conv_state.index_select(0, src_t))
            layer.ssm_state.index_copy_(0, dst_t, layer.ssm_state.index_select(0, src_t))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[dict[str, SampleResult], dict[str, PromptLogprobRows]]:
        """Run one step. Returns the sampled token of every request that reached its last known
        token, and prompt logprobs for the prompt positions this step computed (when asked)."""
        # the engine's set of live requests that need host state: empty means none asks for
        # prompt logprobs, and the per-request check is skipped
        wanted = self.host_state_requests is None or bool(self.host_state_requests)
        hidden, logits_idx, sampling, prompt_lps = self._forward(sched, wanted)
        if not sampling:
            return {}, prompt_lps
        logits = self.model.compute_logits(self._sampling_hidden(hidden, logits_idx))
        results = self.sampler(logits, self._sampling_rows(sampling))
        return {s.request.request_id: r for s, r in zip(sampling, results)}, prompt_lps

    @torch.inference_mode()
    def execute_async(self, sched: SchedulerOutput) -> PendingSamples | None:
        """Launch one step without waiting for it (async scheduling): the sampled tokens stay on
        the device as the next step's inputs and are copied to the host behind the step. Only
        for steps whose rows need no host-side logprobs (the engine checks)."""
        hidden, logits_idx, sampling, _ = self._forward(sched, False)
        if not sampling:
            return None
        logits = self.model.compute_logits(self._sampling_hidden(hidden, logits_idx))
        tokens, _ = self.sampler.sample_tokens(logits, self._sampling_rows(sampling))
        ids = [s.request.request_id for s in sampling]
        self._prev_tokens, self._prev_rows = tokens, {rid: i for i, rid in enumerate(ids)}
        if tokens.device.type != "cuda":
            return PendingSamples(ids, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingSamples(ids, host, event)

    def _sampling_hidden(self, hidden: torch.Tensor, logits_idx: list[int]) -> torch.Tensor:
        """The hidden states of the sampling positions (all of them in a decode-only step)."""
        if len(logits_idx) == hidden.shape[0]:
            return hidden  # every token samples: logits_idx is 0..T-1
        return hidden[to_device(logits_idx, torch.long, self.device)]

    def _sampling_rows(self, sampling: list) -> list[SamplingRow]:
        """Each sampling request's row, made once per request and kept (only its output count
        changes from step to step): a batch of 256 decodes would build 256 rows every step."""
        rows, cache = [], self._rows
        for s in sampling:
            req = s.request
            row = cache.get(req.request_id)
            if row is None or row.output_token_ids is not req.output_token_ids:  # new (or a reused id)
                params = req.sampling_params
                gen = None if params.seed is None else self._generator(req.request_id, params.seed)
                row = cache[req.request_id] = SamplingRow(params, gen, 0, req.prompt_token_ids, req.output_token_ids)
            row.num_output_tokens = len(req.output_token_ids) + req.num_pending
            rows.append(row)
        return rows

    def _forward(
        self, sched: SchedulerOutput, prompt_logprobs: bool
    ) -> tuple[torch.Tensor, list[int], list, dict[str, PromptLogprobRows]]:
        """Prepare and run the model: hidden states, the rows that sample, prompt logprobs."""
        input_ids, positions, meta, logits_idx = self.prepare(sched)
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        if self.num_snapshot_slots:
            self._save_state_snapshots(sched)
        prompt_lps = self._prompt_logprobs(sched, hidden) if prompt_logprobs else {}
        sampling = [s for s in sched.scheduled if s.samples]
        return hidden, logits_idx, sampling, prompt_lps

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: torch.Tensor) -> dict[str, PromptLogprobRows]:
        """Logprobs of prompt token p+1 given positions <= p, for the chunk's positions."""
        out: dict[str, PromptLogprobRows] = {}
        offset = 0
        for s in sched.scheduled:
            req, start, n = s.request, s.num_computed_tokens, s.num_new_tokens
            num = req.sampling_params.prompt_logprobs
            end = min(start + n, req.num_prompt_tokens - 1)  # last position that predicts a prompt token
            if num is not None and req.num_output_tokens == 0 and end > start:
                rows: PromptLogprobRows = []
                for a in range(start, end, _PROMPT_LOGPROB_CHUNK):
                    b = min(a + _PROMPT_LOGPROB_CHUNK, end)
                    logits = self.model.compute_logits(hidden[offset + a - start : offset + b - start]).float()
                    targets = req.prompt_token_ids[a + 1 : b + 1]
                    rows += gather_logprobs(torch.log_softmax(logits, dim=-1), targets, num)
                out[req.request_id] = rows
            offset += n
        return out
