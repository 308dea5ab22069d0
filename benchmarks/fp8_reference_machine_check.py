"""Does another CPU reproduce the golden references' fp32 arithmetic, and with it the fp8 files?

The shipped fp8 references (Oracle C) carry the fp32 rounding of the machine that made them, which
an fp8 cache amplifies (docs/KV_CACHE.md). This script, run on any machine with the default model:
1. replays Oracle B (transformers fp32, token by token) on a few prompts and prints the largest
   |delta logprob| against ``golden_public_hf_fp32.jsonl`` (0.0 = the same arithmetic);
2. runs ``kvserve parity --teacher-forced`` (reference backend on the CPU) against the shipped fp8
   files and prints the summary lines.

    python benchmarks/fp8_reference_machine_check.py --model DIR [--eval ../shared/eval] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch


def oracle_b_max_delta(model_dir: str, eval_dir: Path, ids: list[str]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    prompts = {p["id"]: p for p in map(json.loads, open(eval_dir / "golden_public.jsonl"))}
    refs = {r["id"]: r for r in map(json.loads, open(eval_dir / "golden_public_hf_fp32.jsonl"))}
    out: dict[str, float] = {}
    for rid in ids:
        ref = refs[rid]
        cache, x, worst = DynamicCache(config=model.config), torch.tensor([prompts[rid]["prompt_token_ids"]]), 0.0
        with torch.no_grad():
            for i, t in enumerate(ref["output_token_ids"]):
                lp = torch.log_softmax(model(x, past_key_values=cache, use_cache=True).logits[0, -1].float(), -1)
                worst = max(worst, abs(float(lp[t]) - ref["top_logprobs"][i][0][1]))
                x = torch.tensor([[t]])
        out[rid] = worst
    return out


def teacher_forced(model_dir: str, eval_dir: Path, reference: str, kv: str) -> str:
    from kvserve.tools import parity

    rows = parity.run_teacher_forced(str(eval_dir / "golden_public.jsonl"), str(eval_dir / reference),
                                     dict(model=model_dir, dtype="float32", kv_cache_dtype=kv, device="cpu",
                                          kv_cache_memory=1 << 30))
    return parity.teacher_forced_line(parity.summarize_teacher_forced(rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--eval", default=str(Path(__file__).resolve().parents[2] / "shared" / "eval"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ev = Path(a.eval)
    result: dict = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()}
    t0 = time.time()
    result["oracle_b_max_delta"] = oracle_b_max_delta(a.model, ev, ["pub_01_fact_capital", "pub_05_translate_fr",
                                                                   "pub_12_define_photosynthesis"])
    print(json.dumps(result), flush=True)
    for ref, kv in [("golden_public_fp8_e4m3_scale1.jsonl", "fp8_e4m3"), ("golden_public_fp8_e5m2_scale1.jsonl", "fp8_e5m2"),
                    ("golden_public_fp8_e4m3_scale1.jsonl", "auto"), ("golden_public_vllm_fp32.jsonl", "auto")]:
        result[f"{ref}:{kv}"] = teacher_forced(a.model, ev, ref, kv)
        print(ref, kv, result[f"{ref}:{kv}"], flush=True)
    result["wall_s"] = time.time() - t0
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
