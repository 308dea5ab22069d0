"""End-to-end numerics: kvserve's greedy tokens and logprobs vs Hugging Face transformers.

Every test runs the engine on token-id prompts, then teacher-forces the transformers model on
prompt + our output ids and checks, at each generated position, that our token is HF's argmax and
that our logprobs (sampled token and top-5) equal HF's fp32 log_softmax within 1e-4. The engine is
driven through the paths that touch the KV cache differently: one-shot prefill, chunked prefill
across block boundaries, prefix-cache hits (including blocks written by decode), and preemption
followed by recompute. Afterwards the KV pool must be completely free again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams

ARCHS = ("llama", "qwen2", "qwen3")
VOCAB = 512  # conftest's tiny vocab_size
# transformers' own float32 logprobs (top-6) lie at most 1.1e-5 from its float64 ones on these tiny
# dense models (3 architectures x seeds 0 and 3, sequences of 69-110 tokens, AVX2 and scalar CPU
# code paths, 2026-12-01): 1e-4 is 9x the reference's own spread
ATOL = 1e-4
TOP_K = 5
KV_MEM = 1 << 22  # 4 MiB: hundreds of blocks for the tiny models

_hf_cache: dict[tuple[str, torch.dtype], Any] = {}


pytestmark = pytest.mark.usefixtures("one_thread")


def hf_model(folder: Path, dtype: torch.dtype = torch.float32):
    key = (str(folder), dtype)
    if key not in _hf_cache:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        model.eval()
        _hf_cache[key] = model
    return _hf_cache[key]


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] fp32 log-softmax of HF's logits for a teacher-forced sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def rand_prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=TOP_K, ignore_eos=True)


def make_llm(folder: Path, **kwargs: Any) -> LLM:
    kwargs.setdefault("kv_cache_memory", KV_MEM)
    return LLM(str(folder), **kwargs)


def record_steps(llm: LLM) -> list[list[tuple[str, int, int]]]:
    """Wrap the runner so every step's (request id, computed before, new tokens) is recorded."""
    runner = llm.llm_engine.runner
    original = runner.execute
    steps: list[list[tuple[str, int, int]]] = []

    def execute(sched):
        steps.append([(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in sched.scheduled])
        return original(sched)

    runner.execute = execute
    return steps


def assert_pool_free(llm: LLM) -> None:
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.pool.num_blocks
    eng.kv_manager.check_invariants()


def assert_matches_hf(model, out, max_tokens: int, atol: float = ATOL) -> None:
    """Our greedy tokens are HF's argmax; our sampled/top-k logprobs equal HF's within ``atol``."""
    prompt = list(out.prompt_token_ids)
    comp = out.outputs[0]
    ids = list(comp.token_ids)
    assert len(ids) == max_tokens, f"request {out.request_id}: {len(ids)} tokens, expected {max_tokens}"
    assert comp.finish_reason == "length"
    assert comp.logprobs is not None and len(comp.logprobs) == len(ids)
    lp_all = hf_logprobs(model, prompt + ids)
    start = len(prompt) - 1
    cumulative = 0.0
    for i, (tok, entry) in enumerate(zip(ids, comp.logprobs)):
        row = lp_all[start + i]
        where = f"request {out.request_id} step {i}"
        best = float(row.max())
        # greedy: our token is HF's argmax (a different token only within a numerical tie)
        assert tok == int(row.argmax()) or best - float(row[tok]) <= atol, (
            f"{where}: ours {tok} (HF lp {float(row[tok]):.6f}) vs HF argmax {int(row.argmax())} ({best:.6f})"
        )
        assert tok in entry, f"{where}: sampled token missing from logprobs"
        assert entry[tok].rank == 1, f"{where}: greedy token rank {entry[tok].rank}"
        # the sampled token is top-1, so the dict holds exactly the top-k
        assert len(entry) == TOP_K, f"{where}: {len(entry)} logprob entries"
        for tid, lp in entry.items():
            assert 0 <= tid < VOCAB
            assert abs(lp.logprob - float(row[tid])) <= atol, (
                f"{where}: token {tid} logprob {lp.logprob:.6f} vs HF {float(row[tid]):.6f}"
            )
        by_rank = sorted(entry.items(), key=lambda kv: kv[1].rank)
        assert [lp.rank for _, lp in by_rank] == list(range(1, TOP_K + 1))
        hf_top_v, hf_top_i = row.topk(TOP_K + 1)
        for r, (tid, lp) in enumerate(by_rank):
            # rank r holds HF's r-th best token, or one tied with it
            assert tid == int(hf_top_i[r]) or abs(float(row[tid]) - float(hf_top_v[r])) <= atol, (
                f"{where}: rank {r + 1} is {tid}, HF has {int(hf_top_i[r])}"
            )
            if r:
                assert lp.logprob <= by_rank[r - 1][1].logprob
        # nothing better than our worst top-k entry was left out
        assert float(hf_top_v[TOP_K]) <= by_rank[-1][1].logprob + atol
        cumulative += entry[tok].logprob
    assert comp.cumulative_logprob == pytest.approx(cumulative, abs=1e-6 * len(ids) + 1e-9)


# ---- (a) one-shot prefill -------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_single_prefill_then_decode(make_tiny_model, arch):
    folder = make_tiny_model(arch)
    llm = make_llm(folder)
    steps = record_steps(llm)
    prompt = rand_prompt(11, 29)
    [out] = llm.generate({"prompt_token_ids": prompt}, greedy(10), use_tqdm=False)
    # the whole prompt in the first step, then one token per decode step
    assert steps[0] == [("0", 0, len(prompt))]
    assert all(s == [("0", len(prompt) + j, 1)] for j, s in enumerate(steps[1:]))
    assert len(steps) == 10
    assert out.prompt_token_ids == prompt
    assert out.num_cached_tokens == 0
    assert_matches_hf(hf_model(folder), out, 10)
    assert_pool_free(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prompts_of_different_lengths(make_tiny_model, arch):
    """Several requests in one step: prefills of different lengths, then mixed-length decodes."""
    folder = make_tiny_model(arch)
    llm = make_llm(folder, block_size=16)
    prompts = [rand_prompt(100 + i, n) for i, n in enumerate((1, 16, 17, 40, 5))]
    max_tokens = [7, 3, 9, 5, 12]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [greedy(m) for m in max_tokens], use_tqdm=False
    )
    model = hf_model(folder)
    for out, prompt, m in zip(outs, prompts, max_tokens):
        assert out.prompt_token_ids == prompt
        assert_matches_hf(model, out, m)
    assert_pool_free(llm)


# ---- (b) chunked prefill across block boundaries --------------------------------------------
@pytest.mark.parametrize("budget", [7, 13])
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_across_blocks(make_tiny_model, arch, budget):
    folder = make_tiny_model(arch)
    llm = make_llm(folder, block_size=16, max_num_batched_tokens=budget, max_num_seqs=2)
    steps = record_steps(llm)
    prompts = [rand_prompt(200 + budget, 53), rand_prompt(300 + budget, 38)]
    max_tokens = [6, 9]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [greedy(m) for m in max_tokens], use_tqdm=False
    )
    # prefill of each prompt came in several chunks, never above the budget, and some chunk
    # started mid-block and crossed into the next one
    for rid, prompt in (("0", prompts[0]), ("1", prompts[1])):
        chunks = [(c, n) for s in steps for r, c, n in s if r == rid and c < len(prompt)]
        assert len(chunks) > 1
        assert sum(n for _, n in chunks) == len(prompt)
        assert all(n <= budget for _, n in chunks)
        assert any(c % 16 and c // 16 != (c + n - 1) // 16 for c, n in chunks)
    assert all(sum(n for _, _, n in s) <= budget for s in steps)
    # a decode of one request shared a step with a prefill chunk of the other
    assert any(len(s) == 2 and {n == 1 for _, _, n in s} == {True, False} for s in steps)
    model = hf_model(folder)
    for out, m in zip(outs, max_tokens):
        assert_matches_hf(model, out, m)
    assert_pool_free(llm)


# ---- (c) prefix-cache hits ------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_after_prefix_cache_hits(make_tiny_model, arch):
    folder = make_tiny_model(arch)
    bs = 16
    llm = make_llm(folder, block_size=bs, enable_prefix_caching=True)
    model = hf_model(folder)
    common = rand_prompt(400, 35)
    prompt_a = common + rand_prompt(401, 6)  # 41 tokens
    prompt_b = common + rand_prompt(402, 11)  # shares 2 full blocks with A

    [out_a] = llm.generate({"prompt_token_ids": prompt_a}, greedy(12), use_tqdm=False)
    assert out_a.num_cached_tokens == 0
    assert_matches_hf(model, out_a, 12)
    assert_pool_free(llm)

    [out_b] = llm.generate({"prompt_token_ids": prompt_b}, greedy(8), use_tqdm=False)
    assert out_b.num_cached_tokens > 0
    assert out_b.num_cached_tokens == (len(common) // bs) * bs
    assert_matches_hf(model, out_b, 8)
    assert_pool_free(llm)

    # a follow-up turn: A's prompt + A's output + more. A computed KV for 41 + 12 - 1 = 52
    # tokens, so its block 2 (positions 32..47) holds KV written by decode steps 1..7.
    prompt_c = prompt_a + list(out_a.outputs[0].token_ids) + rand_prompt(403, 5)
    [out_c] = llm.generate({"prompt_token_ids": prompt_c}, greedy(7), use_tqdm=False)
    computed_a = len(prompt_a) + 12 - 1
    assert out_c.num_cached_tokens == bs * min(computed_a // bs, (len(prompt_c) - 1) // bs) == 48
    assert_matches_hf(model, out_c, 7)

    # the exact same prompt again: everything but the last (partial or full) block's tail is cached
    [out_a2] = llm.generate({"prompt_token_ids": prompt_a}, greedy(12), use_tqdm=False)
    assert out_a2.num_cached_tokens == ((len(prompt_a) - 1) // bs) * bs
    assert out_a2.outputs[0].token_ids == out_a.outputs[0].token_ids
    for e1, e2 in zip(out_a.outputs[0].logprobs, out_a2.outputs[0].logprobs):
        assert e1.keys() == e2.keys()
        for tid in e1:
            assert abs(e1[tid].logprob - e2[tid].logprob) <= ATOL
    assert_pool_free(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prefix_concurrent_requests(make_tiny_model, arch):
    """Requests sharing a prefix in one generate call (hits on blocks written in the same step
    or by a running request) still match HF; with a small budget the prefill is chunked."""
    folder = make_tiny_model(arch)
    llm = make_llm(folder, block_size=16, max_num_batched_tokens=24, max_num_seqs=3)
    common = rand_prompt(500, 50)
    prompts = [common + rand_prompt(501 + i, 3 + 4 * i) for i in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6), use_tqdm=False)
    model = hf_model(folder)
    for out in outs:
        assert_matches_hf(model, out, 6)
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert_pool_free(llm)


# ---- (d) preemption and recompute -----------------------------------------------------------
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_preempted_requests_resume_correctly(make_tiny_model, arch, prefix_caching):
    folder = make_tiny_model(arch)
    llm = make_llm(
        folder,
        block_size=16,
        max_model_len=64,
        num_gpu_blocks_override=6,
        max_num_seqs=4,
        enable_prefix_caching=prefix_caching,
    )
    assert llm.llm_engine.kv_manager.pool.num_blocks == 6
    steps = record_steps(llm)
    prompt_lens = [21, 27, 18, 30]
    max_tokens = [24, 20, 30, 16]  # each request ends at 45..48 tokens: 3 blocks; 4 x 3 > 6
    prompts = [rand_prompt(600 + i, n) for i, n in enumerate(prompt_lens)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [greedy(m) for m in max_tokens], use_tqdm=False
    )
    assert llm.llm_engine.scheduler.num_preemptions > 0
    # some request lost its KV after generating tokens and was recomputed: a later step restarts
    # below what it had computed, and that one prefill covers prompt + generated tokens
    resumed_with_outputs = False
    for rid, prompt in enumerate(prompts):
        done = 0
        for s in steps:
            for r, c, n in s:
                if r == str(rid):
                    if c < done and n > 1 and c + n > len(prompt):
                        resumed_with_outputs = True
                    done = c + n
    assert resumed_with_outputs
    model = hf_model(folder)
    for out, prompt, m in zip(outs, prompts, max_tokens):
        assert out.prompt_token_ids == prompt
        assert_matches_hf(model, out, m)
    assert_pool_free(llm)


# ---- (e) config variants --------------------------------------------------------------------
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-rope-llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-rope-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama-gqa4": ("llama", {"num_key_value_heads": 1}),
    "llama-bias-headdim32": ("llama", {"attention_bias": True, "mlp_bias": True, "head_dim": 32}),
    "qwen2-tied-mha": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "qwen2-gqa4": ("qwen2", {"num_key_value_heads": 1}),
    "qwen3-tied-gqa4": ("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen3-mha-bias": ("qwen3", {"num_key_value_heads": 4, "attention_bias": True}),
}


@pytest.mark.parametrize("arch,overrides", list(VARIANTS.values()), ids=list(VARIANTS))
def test_config_variants(make_tiny_model, arch, overrides):
    folder = make_tiny_model(arch, seed=3, **overrides)
    model = hf_model(folder)
    cfg = model.config
    # the override really reached the checkpoint
    if overrides.get("tie_word_embeddings"):
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if "rope_parameters" in overrides:
        assert cfg.rope_parameters["rope_type"] == overrides["rope_parameters"]["rope_type"]
    if "num_key_value_heads" in overrides:
        assert cfg.num_key_value_heads == overrides["num_key_value_heads"]

    llm = make_llm(folder, block_size=16, max_num_batched_tokens=32, max_num_seqs=2)
    hf_cfg = llm.llm_engine.config.model_config.hf_config
    assert bool(hf_cfg.tie_word_embeddings) == bool(overrides.get("tie_word_embeddings", False))
    # 90 tokens run past original_max_position_embeddings=64 of the llama3 variant
    prompts = [rand_prompt(700, 90), rand_prompt(701, 19)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8), use_tqdm=False)
    for out in outs:
        assert_matches_hf(model, out, 8)
    assert_pool_free(llm)


# ---- (f) bfloat16 smoke ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype,kv_cache_dtype", [("bfloat16", "auto"), ("float32", "bfloat16")])
@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_smoke(make_tiny_model, arch, dtype, kv_cache_dtype):
    """bf16 weights (HF bf16 reference), or fp32 weights over a bf16 KV cache (HF fp32 reference).
    Numerics differ from the reference, so only: the first greedy token agrees (unless a bf16
    near-tie), logprobs are close, and no later pick is clearly worse than HF's best."""
    folder = make_tiny_model(arch)
    llm = make_llm(
        folder, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=16, max_num_batched_tokens=16, max_num_seqs=2
    )
    assert llm.llm_engine.runner.kv_caches[0].dtype == torch.bfloat16
    weight_dtype = getattr(torch, dtype)
    assert next(llm.llm_engine.runner.model.parameters()).dtype == weight_dtype
    prompts = [rand_prompt(800, 37), rand_prompt(801, 12)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6), use_tqdm=False)
    model = hf_model(folder, weight_dtype)
    for out, prompt in zip(outs, prompts):
        ids = list(out.outputs[0].token_ids)
        assert len(ids) == 6
        lp = hf_logprobs(model, prompt + ids)
        first = lp[len(prompt) - 1]
        best = float(first.max())
        assert ids[0] == int(first.argmax()) or best - float(first[ids[0]]) < 0.02, (
            f"first token {ids[0]} vs HF {int(first.argmax())}"
        )
        ours = out.outputs[0].logprobs[0][ids[0]].logprob
        assert abs(ours - float(first[ids[0]])) < 0.1
        for i, tok in enumerate(ids):
            row = lp[len(prompt) - 1 + i]
            assert float(row.max()) - float(row[tok]) < 0.25, f"step {i}"
            for tid, entry in out.outputs[0].logprobs[i].items():
                assert abs(entry.logprob - float(row[tid])) < 0.2, f"step {i} token {tid}"
    assert_pool_free(llm)


# ---- everything at once ---------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("arch", ARCHS)
def test_random_workload_matches_hf(make_tiny_model, arch, seed):
    """Many requests of random lengths, some sharing prefixes, with a small token budget and a
    small pool: chunked prefills, decodes, prefix hits and preemptions interleave freely."""
    folder = make_tiny_model(arch)
    g = torch.Generator().manual_seed(1000 + seed)
    max_model_len = 96
    llm = make_llm(
        folder,
        block_size=16,
        max_model_len=max_model_len,
        num_gpu_blocks_override=9,
        max_num_batched_tokens=20,
        max_num_seqs=5,
    )
    steps = record_steps(llm)
    prefixes = [rand_prompt(2000 + 10 * seed + j, 33) for j in range(2)]
    prompts, max_tokens = [], []
    for i in range(10):
        n = int(torch.randint(1, 50, (1,), generator=g))
        tail = rand_prompt(3000 + 100 * seed + i, n)
        prompt = prefixes[i % 2] + tail if i % 3 else tail
        prompts.append(prompt)
        max_tokens.append(min(int(torch.randint(1, 24, (1,), generator=g)), max_model_len - len(prompt)))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [greedy(m) for m in max_tokens], use_tqdm=False
    )
    assert len(steps) > 10
    model = hf_model(folder)
    for out, prompt, m in zip(outs, prompts, max_tokens):
        assert out.prompt_token_ids == prompt
        assert_matches_hf(model, out, m)
    assert any(o.num_cached_tokens for o in outs)
    assert_pool_free(llm)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_sliding_window_configs(make_tiny_model, arch):
    """kvserve attends to the full context in every layer, so a checkpoint that really uses
    sliding-window layers is refused instead of answering differently from HF; with the flag off
    (window size still in config.json) HF uses full attention too and the outputs match."""
    folder = make_tiny_model(arch, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert "sliding_attention" in hf_model(folder).config.layer_types
    with pytest.raises(ValueError, match="[Ss]liding-window"):
        make_llm(folder)
    folder = make_tiny_model(arch, use_sliding_window=False, sliding_window=8, max_window_layers=1)
    llm = make_llm(folder)
    [out] = llm.generate({"prompt_token_ids": rand_prompt(900, 30)}, greedy(5), use_tqdm=False)
    assert_matches_hf(hf_model(folder), out, 5)
    assert_pool_free(llm)
