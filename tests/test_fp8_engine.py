"""The engine with an fp8 KV cache vs transformers with fake-quantized K/V (the golden set's Oracle C).

The oracle replaces every new post-RoPE key and value, in prefill and in each decode step, by
``float(fp8(clamp(x / s, -max, max))) * s``, so attention reads exactly what an fp8 cache holds.
kvserve must match it through one-shot prefill, chunked prefill, prefix-cache hits and preemption,
while plain fp32 attention (no fake quant) must be measurably different (the test discriminates).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8_checkpoints import make_fp8_checkpoint
from kvserve import LLM, SamplingParams
from kvserve.tools.fp8_reference import fake_quant_cache_class

KV_MEM = 1 << 22
ATOL = 2e-3  # an element that lands on the neighbouring fp8 code moves a logprob by ~1e-3

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")]


def fake_quant_logprobs(folder: Path, ids: list[int], fmt: str, k_scales: list[float], v_scales: list[float],
                        decode_from: int) -> torch.Tensor:
    """Oracle C: HF fp32, K/V fake-quantized when written (``fmt`` "none": plain fp32); prefill
    ``ids[:decode_from]`` in one pass, then one token per forward. Returns [len(ids), vocab]."""
    from transformers import AutoModelForCausalLM, DynamicCache

    cache_cls = DynamicCache if fmt == "none" else fake_quant_cache_class(fmt.removeprefix("fp8_"), k_scales, v_scales)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cache = cache_cls(config=model.config)
    rows = []
    with torch.no_grad():
        out = model(torch.tensor([ids[:decode_from]]), past_key_values=cache, use_cache=True)
        rows.append(out.logits[0])
        for i in range(decode_from, len(ids)):
            out = model(torch.tensor([[ids[i]]]), past_key_values=cache, use_cache=True)
            rows.append(out.logits[0])
    return torch.log_softmax(torch.cat(rows).float(), dim=-1)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(out, oracle_rows: torch.Tensor, plain_rows: torch.Tensor) -> float:
    """Our sampled-token logprobs equal the oracle's; returns the largest gap to plain fp32."""
    prompt, comp = list(out.prompt_token_ids), out.outputs[0]
    start = len(prompt) - 1
    worst_plain = 0.0
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row, plain = oracle_rows[start + i], plain_rows[start + i]
        assert float(row.max()) - float(row[tok]) <= ATOL, f"step {i}: token {tok} is not the oracle's argmax"
        for tid, lp in entry.items():
            assert abs(lp.logprob - float(row[tid])) <= ATOL, (
                f"step {i} token {tid}: ours {lp.logprob:.5f}, oracle {float(row[tid]):.5f}"
            )
            worst_plain = max(worst_plain, abs(lp.logprob - float(plain[tid])))
    return worst_plain


def check_against_oracle(outs, folder: Path, fmt: str, k_scales: list[float], v_scales: list[float]) -> None:
    """Every output's logprobs equal Oracle C's (its prompt in one pass, then its tokens one by one),
    and differ from plain fp32 attention by more than 5 x ATOL somewhere (the check discriminates)."""
    worst_plain = 0.0
    for out in outs:
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        decode_from = len(out.prompt_token_ids)
        oracle = fake_quant_logprobs(folder, ids, fmt, k_scales, v_scales, decode_from)
        plain = fake_quant_logprobs(folder, ids, "none", k_scales, v_scales, decode_from)
        worst_plain = max(worst_plain, _check(out, oracle, plain))
    assert worst_plain > 5 * ATOL, f"fp8 and fp32 attention are indistinguishable here ({worst_plain})"


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("path", ["oneshot", "chunked", "prefix_cached", "preempted"])
def test_fp8_engine_matches_fake_quant_oracle(make_tiny_model, tmp_path, fmt, path):
    base = make_tiny_model("llama", seed=3)
    n_layers = 2
    k_scales, v_scales = [1.0] * n_layers, [1.0] * n_layers
    folder = base
    if fmt == "fp8_e4m3":  # scaled: a ModelOpt checkpoint with per-layer scales, resolved by auto
        k_scales, v_scales = [0.011, 0.017], [0.0043, 0.009]
        folder = make_fp8_checkpoint(base, tmp_path / "ckpt", "modelopt", k_scales, v_scales)
    kw: dict = dict(kv_cache_memory=KV_MEM, kv_cache_dtype="auto" if fmt == "fp8_e4m3" else fmt)
    prompts = [_prompt(11, 40), _prompt(12, 23)]
    max_tokens = 12
    if path == "chunked":
        kw.update(max_num_batched_tokens=7, max_num_seqs=2)
    if path == "preempted":  # 6 blocks of 16 tokens; four requests of 3 blocks each
        kw.update(num_gpu_blocks_override=6, max_model_len=64, max_num_seqs=4)
        prompts = [_prompt(20 + i, n) for i, n in enumerate([21, 27, 18, 30])]
        max_tokens = 16
    if path == "prefix_cached":
        prompts = [prompts[0], prompts[0][:33] + _prompt(13, 9)]
    llm = LLM(str(folder), **kw)
    assert llm.llm_engine.runner.kv_caches[0].dtype == torch.uint8
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3, ignore_eos=True)
    if path == "prefix_cached":
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        assert outs[1].num_cached_tokens == 32
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if path == "preempted":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    check_against_oracle(outs, folder, fmt, k_scales, v_scales)
    eng = llm.llm_engine
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.pool.num_blocks


def test_bf16_explicit_cache_ignores_checkpoint_scales(make_tiny_model, tmp_path):
    """An explicit float cache on an fp8 checkpoint: scales unused, outputs equal the plain model's."""
    base = make_tiny_model("llama", seed=3)
    folder = make_fp8_checkpoint(base, tmp_path / "ckpt", "modelopt", [0.011, 0.017], [0.0043, 0.009])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    p = [{"prompt_token_ids": _prompt(5, 30)}]
    a = LLM(str(folder), kv_cache_memory=KV_MEM, kv_cache_dtype="bfloat16")
    b = LLM(str(base), kv_cache_memory=KV_MEM, kv_cache_dtype="bfloat16")
    assert a.llm_engine.runner.kv_caches[0].dtype == torch.bfloat16
    assert all(layer.cache_quant is None for layer in a.llm_engine.runner.model.attention_layers())
    assert a.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids == b.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids
