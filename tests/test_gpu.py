"""GPU-only checks (run on the H200; skipped elsewhere): the vLLM-style memory planner and the
engine on CUDA giving the same greedy tokens as on CPU."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 37, 64, 130)]


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_gpu_memory_utilization_sizes_the_pool(make_tiny_model):
    folder = make_tiny_model("llama")
    free_before, total = torch.cuda.mem_get_info()
    used_before = total - free_before
    llm = LLM(str(folder), gpu_memory_utilization=0.5, dtype="float32")
    eng = llm.llm_engine
    spec = eng.runner.kv_spec
    kv_bytes = eng.config.cache_config.num_blocks * spec.block_bytes
    # the KV pool takes the budget: 0.5 x total minus what was in use and the activation peak
    assert kv_bytes <= 0.5 * total - used_before
    assert kv_bytes >= 0.4 * total - used_before
    assert all(c.device.type == "cuda" for c in eng.runner.kv_caches)
    gpu = _tokens(llm)
    del llm, eng
    torch.cuda.empty_cache()
    cpu = _tokens(LLM(str(folder), device="cpu", dtype="float32", kv_cache_memory=1 << 24))
    assert gpu == cpu


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_on_cuda_stores_the_same_bytes_as_on_cpu(make_tiny_model, kv_cache_dtype):
    """The reference store on CUDA (true division, RNE, saturation) writes the bytes the CPU writes,
    and an fp8 pool holds exactly twice the blocks of a bf16 one for the same budget."""
    from kvserve.kernels.reference import CacheQuant, quantize_fp8

    fp8 = torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else torch.float8_e5m2
    fmax = 448.0 if fp8 == torch.float8_e4m3fn else 57344.0
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1 << 16, generator=g) * torch.logspace(-5, 4, 1 << 16)
    for scale in (1.0, 0.0048438, 0.181):
        cpu = quantize_fp8(x, scale, fp8, fmax)
        gpu = quantize_fp8(x.cuda(), scale, fp8, fmax).cpu()
        assert torch.equal(cpu, gpu)
    folder = make_tiny_model("llama")
    budget = 1 << 24
    llm = LLM(str(folder), kv_cache_dtype=kv_cache_dtype, kv_cache_memory=budget, dtype="float32")
    bf16 = LLM(str(folder), kv_cache_dtype="bfloat16", kv_cache_memory=budget, dtype="float32")
    assert llm.llm_engine.config.cache_config.num_blocks == 2 * bf16.llm_engine.config.cache_config.num_blocks
    assert llm.llm_engine.runner.kv_caches[0].dtype == torch.uint8
    assert isinstance(llm.llm_engine.runner.model.attention_layers()[0].cache_quant, CacheQuant)
    gpu_tokens = _tokens(llm)
    del llm, bf16
    torch.cuda.empty_cache()
    cpu_tokens = _tokens(LLM(str(folder), device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype,
                             kv_cache_memory=budget))
    assert gpu_tokens == cpu_tokens
