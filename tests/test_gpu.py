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
