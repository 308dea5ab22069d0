"""Probe (to history): why the CUDA FP8 run's greedy tokens leave the CPU run's (margins, logprob gaps)."""
import torch
import pytest
from kvserve import LLM, SamplingParams
from tests.test_modelopt_load import PROMPTS, export  # noqa: F401


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_probe_fp8_diag(export, monkeypatch):  # noqa: F811
    from kvserve.layers import quant_linear

    folder = export("llama", "FP8", kv=None)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    runs = {}
    for device in ("cuda", "cpu"):
        if device == "cpu":
            monkeypatch.setattr(quant_linear, "FP8_GEMM_DEVICES", ("cuda", "cpu"))
        llm = LLM(str(folder), dtype="float32", kv_cache_memory=1 << 22, max_num_seqs=4, device=device)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        runs[device] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
        del llm
    for i, ((tc, lc), (tp, lp)) in enumerate(zip(runs["cuda"], runs["cpu"])):
        print("prompt", i, "cuda", tc, "cpu", tp)
        for s, (a, b) in enumerate(zip(lc, lp)):
            top = sorted(b.items(), key=lambda kv: -kv[1].logprob)
            margin = top[0][1].logprob - top[1][1].logprob
            common = [t for t in a if t in b]
            gap = max(abs(a[t].logprob - b[t].logprob) for t in common) if common else None
            print(f"  step {s}: cuda {tc[s]} cpu {tp[s]} cpu margin {margin:.2e} max lp gap {gap}")
            if tc[s] != tp[s]:
                break
