"""The triton attention backend inside the engine (CPU: Triton interpreter), its flags, and the
dummy weight loader. Kernel-level checks live in test_triton_kernels.py; CUDA graphs in
test_gpu_triton.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineArgs, cudagraph_capture_sizes
from triton_support import skip_without_triton_device

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks. " * 3,
    "def main():\n    return 42\n",
    "The quick brown fox jumps over the lazy dog. Paged attention",  # shares a cached prefix
]


def _run(folder, backend: str, kv: str, preemptions: list[int] | None = None, **kw) -> list[list[int]]:
    llm = LLM(
        str(folder), attention_backend=backend, kv_cache_dtype=kv, dtype="float32", max_num_seqs=4,
        max_num_batched_tokens=16, **{"kv_cache_memory": 1 << 22, **kw},
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 12, 5, 7)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.llm_engine.kv_manager.check_invariants()
    if preemptions is not None:
        preemptions.append(llm.llm_engine.scheduler.num_preemptions)
    return [list(o.outputs[0].token_ids) for o in outs]


@skip_without_triton_device()
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_triton_backend_gives_the_reference_tokens(make_tiny_model, kv, one_thread):
    """Chunked prefill (16-token budget), a prefix-cache hit, decodes of shrinking batches: the
    fused store + unified kernel give the reference backend's greedy tokens, float and fp8 caches."""
    folder = make_tiny_model("qwen3")
    ref = _run(folder, "reference", kv)
    assert _run(folder, "triton", kv) == ref
    assert len({tuple(t) for t in ref}) == len(ref)  # distinct outputs: the check can fail


@skip_without_triton_device()
def test_quantized_query_backend_gives_its_twins_tokens(make_tiny_model, one_thread, monkeypatch):
    """TRITON_ATTN over e4m3 pages (vLLM's read on CUDA: the query quantized, P unscaled) in the engine,
    through chunked prefill, a prefix hit and decodes, gives the greedy tokens of the reference engine
    whose attention is the quantized-query twin (with the kernel's key tile for each batch)."""
    from kvserve.kernels import reference, triton_attention

    folder = make_tiny_model("qwen3")
    reads = []
    kernel = triton_attention.paged_attention

    def spy(*args, **kw):
        quant = kw["quant"] if "quant" in kw else args[8]  # (the layer passes it ninth)
        reads.append((quant.query_fp8, quant.p_shift))
        return kernel(*args, **kw)

    monkeypatch.setattr(triton_attention, "paged_attention", spy)
    got = _run(folder, "TRITON_ATTN", "fp8_e4m3")
    assert reads and set(reads) == {(True, 0)}

    def twin(query, kv_cache, block_tables, query_lens, seq_lens, scale, plan=None, quant=None):
        quant = dataclasses.replace(quant, query_fp8=True, p_shift=0)
        tile = triton_attention.fp8_query_key_tile(query, kv_cache, max(query_lens), False)
        return reference.paged_attention_fp8_query(query, kv_cache, block_tables, query_lens, seq_lens, scale, quant,
                                                   tile)

    assert _run(folder, "triton", "fp8_e4m3") != got  # the dequantizing read's tokens differ: the check can fail
    monkeypatch.setattr(reference, "paged_attention", twin)
    assert _run(folder, "reference", "fp8_e4m3") == got


def test_warm_up_token_counts_cover_store_tiles_and_integer_specializations():
    """Powers of two (every store tile size), the step budget, one odd count."""
    from kvserve.runner.warmup import warm_up_token_counts

    assert warm_up_token_counts(24) == [1, 2, 4, 8, 16, 23, 24]
    assert warm_up_token_counts(33) == [1, 2, 4, 8, 16, 32, 33]
    assert warm_up_token_counts(2) == [1, 2]
    assert warm_up_token_counts(1) == [1]


@skip_without_triton_device()
def test_kernel_warm_up_writes_no_kv_and_leaves_generation_unchanged(make_tiny_model, one_thread):
    """The start-up warm-up (run on CUDA; here called directly) runs every dummy step, prefill
    chunks split at max_model_len, without writing one KV byte; generation afterwards gives the
    reference backend's tokens."""
    from kvserve.runner.warmup import warm_up_kernels, warm_up_token_counts

    folder = make_tiny_model("qwen3")
    ref = _run(folder, "reference", "fp8_e4m3", max_model_len=80)
    llm = LLM(
        str(folder), attention_backend="triton", kv_cache_dtype="fp8_e4m3", dtype="float32", max_num_seqs=4,
        max_num_batched_tokens=96, max_model_len=80, kv_cache_memory=1 << 22,
    )
    runner = llm.llm_engine.runner
    gen = torch.Generator().manual_seed(5)
    for cache in runner.kv_caches:  # random bytes, so a stray write shows
        cache.copy_(torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8))
    before = [c.clone() for c in runner.kv_caches]
    free = llm.llm_engine.kv_manager.num_free_blocks
    assert warm_up_kernels(runner) == len(warm_up_token_counts(96)) + 2
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))
    assert llm.llm_engine.kv_manager.num_free_blocks == free
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 12, 5, 7)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == ref


@skip_without_triton_device()
def test_triton_backend_survives_preemption(make_tiny_model, one_thread):
    """A pool too small for all four requests preempts and recomputes; tokens do not change."""
    folder = make_tiny_model("llama")
    roomy = _run(folder, "triton", "fp8_e4m3")
    count: list[int] = []
    tight = _run(folder, "triton", "fp8_e4m3", count, num_gpu_blocks_override=6, max_model_len=96)
    assert count[0] > 0, "the pool was meant to force preemption"
    assert tight == roomy


@skip_without_triton_device()
def test_triton_backend_with_async_scheduling_and_preemption(make_tiny_model, one_thread):
    """Async scheduling (device-side input tokens) and the persistent block table through
    preemption and recompute: the serial reference backend's tokens."""
    folder = make_tiny_model("llama")
    ref = _run(folder, "reference", "auto")
    count: list[int] = []
    got = _run(folder, "triton", "auto", count, num_gpu_blocks_override=6, max_model_len=96, async_scheduling=True)
    assert count[0] > 0
    assert got == ref


def test_block_table_writes_only_new_entries_and_follows_reallocation():
    from kvserve.runner.block_table import BlockTable

    bt = BlockTable(max_rows=2, max_blocks=4, device=torch.device("cpu"))
    a, b = [7, 3], [5]
    assert bt.rows(["a", "b"], [a, b]).tolist() == [[7, 3, 0, 0], [5, 0, 0, 0]]
    a.append(9)  # a decode filled a block: one new entry
    assert bt.rows(["b", "a"], [b, a]).tolist() == [[5, 0, 0, 0], [7, 3, 9, 0]]
    a2 = [4]  # "a" preempted and re-allocated: a new list, written from the start
    assert bt.rows(["a"], [a2]).tolist()[0][:1] == [4]
    bt.remove("b")
    assert bt.rows(["c"], [[8, 8]]).tolist() == [[8, 8, 0, 0]]  # b's row reused
    assert set(bt.row_of) == {"a", "c"}
    assert bt.synced[bt.row_of["c"]] == 2 and bt.source[bt.row_of["a"]] is a2
    assert bool((bt.table.numpy() == bt.host).all())  # the device copy mirrors the host


def test_cudagraph_capture_sizes_follow_vllm():
    sizes = cudagraph_capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))
    big = cudagraph_capture_sizes(1024)
    assert big[-1] == 512 and big[big.index(256) + 1] == 272  # multiples of 16 past 256, capped at 512
    assert cudagraph_capture_sizes(10) == [1, 2, 4, 8, 10]  # max_num_seqs itself gets a graph
    assert cudagraph_capture_sizes(256, 64)[-1] == 64
    with pytest.raises(ValueError, match="max_cudagraph_capture_size must be non-negative, got -1"):
        cudagraph_capture_sizes(8, -1)


def test_cpu_runs_eager_with_the_reference_backend(tiny):
    cfg = EngineArgs(model=str(tiny), device="cpu", kv_cache_memory=1 << 22).create_engine_config()
    assert cfg.runner_config.attention_backend == "reference"
    assert cfg.runner_config.enforce_eager


def test_unknown_load_format_is_rejected(tiny):
    with pytest.raises(ValueError, match=r"Unknown load_format: 'pt'.*'auto', 'safetensors', 'dummy'"):
        EngineArgs(model=str(tiny), device="cpu", load_format="pt", kv_cache_memory=1 << 22).create_engine_config()


def test_dummy_weights_are_random_and_seeded(tiny):
    """--load-format dummy: no checkpoint read, every parameter uniform in [-1e-3, 1e-3], not zeros."""
    a = LLM(str(tiny), load_format="dummy", kv_cache_memory=1 << 22, seed=3)
    b = LLM(str(tiny), load_format="dummy", kv_cache_memory=1 << 22, seed=3)
    real = LLM(str(tiny), kv_cache_memory=1 << 22)
    pa = dict(a.llm_engine.runner.model.named_parameters())
    pb = dict(b.llm_engine.runner.model.named_parameters())
    pr = dict(real.llm_engine.runner.model.named_parameters())
    for name, p in pa.items():
        assert p.abs().max() <= 1e-3 and p.abs().max() > 0, name
        assert p.unique().numel() > min(10, p.numel() // 2), name
        assert torch.equal(p, pb[name]), name
        assert not torch.equal(p, pr[name]), name
    out = a.generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
