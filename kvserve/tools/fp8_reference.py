"""Regenerate the golden set's fp8 reference (Oracle C) on this machine, with transformers.

``../shared/eval/README.md`` defines it: greedy decoding in fp32 transformers, token by token,
where every new post-RoPE key and every new value (prefill and each decode step) is replaced by
``float32(fp8(clamp(x / s, -max, max))) * s`` before attention reads it. Records are written in the
golden format ``{"id", "output_token_ids", "text", "finish_reason", "top_logprobs"}``.

Why regenerate: an fp8 cache turns ulp-level fp32 differences (another CPU's matmul or
transcendental kernels) into different fp8 codes, so a reference computed on another machine
carries that machine's noise. Against a reference made here, the comparison measures kvserve.

The recipe's own spread: the same recipe run as one pass over prompt + reference output (what
``kvserve parity --teacher-forced`` does) differs from the token-by-token run by ulp-level matmul
differences that fp8 rounding amplifies; how much depends on the CPU's kernels (98.6% of steps
agree on one 2-core AVX2 machine, 97.5% on a CI machine). ``--spread`` prints that line, the
noise floor any engine's teacher-forced comparison against this reference sits on.

    python -m kvserve.tools.fp8_reference --prompts P.jsonl --model DIR --fp8 e4m3 \\
        [--kv-scales kv_scales_scaled.json] --out ref.jsonl [--spread]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.tools.parity import (TeacherForcedSummary, read_jsonl, reference_logprobs, summarize_teacher_forced,
                                  teacher_forced_line, teacher_forced_row)

FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
EOS_ID = 2


def fake_quant_cache_class(fp8: str, k_scales: list[float], v_scales: list[float]) -> type:
    """A ``DynamicCache`` whose ``update`` fake-quantizes the new K/V of each layer (Oracle C)."""
    from transformers import DynamicCache

    dtype, fmax = FORMATS[fp8]

    class FakeQuantCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[override]
            ks = torch.tensor(k_scales[layer_idx], dtype=torch.float32)
            vs = torch.tensor(v_scales[layer_idx], dtype=torch.float32)
            key_states = (key_states / ks).clamp(-fmax, fmax).to(dtype).to(torch.float32) * ks
            value_states = (value_states / vs).clamp(-fmax, fmax).to(dtype).to(torch.float32) * vs
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return FakeQuantCache


def _top5(logprobs: torch.Tensor) -> list[list[float]]:
    """The 5 best ``[token_id, logprob]``, highest first, equal logprobs by token id."""
    values, ids = logprobs.topk(16)
    pairs = sorted(zip(ids.tolist(), values.tolist()), key=lambda p: (-p[1], p[0]))
    return [[t, v] for t, v in pairs[:5]]


def generate(model: Any, prompt_ids: list[int], cache_cls: type, max_tokens: int = 64) -> dict[str, Any]:
    """Greedy, one token per forward after a single-pass prefill; stops on EOS (included)."""
    cache = cache_cls(config=model.config)
    x = torch.tensor([prompt_ids])
    out: list[int] = []
    tops: list[list[list[float]]] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(x, past_key_values=cache, use_cache=True).logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            token = int(logits.argmax())
            out.append(token)
            tops.append(_top5(lp))
            if token == EOS_ID:
                break
            x = torch.tensor([[token]])
    return {"output_token_ids": out, "top_logprobs": tops, "finish_reason": "stop" if out[-1] == EOS_ID else "length"}


def _load(model_dir: str | Path, fp8: str, kv_scales: str | Path | None) -> tuple[Any, type]:
    """The fp32 sdpa model and the recipe's cache class (per-layer scales, else 1.0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa").eval()
    n = model.config.num_hidden_layers
    if kv_scales:
        layers = json.loads(Path(kv_scales).read_text())["layers"]
        k_scales, v_scales = [x["k_scale"] for x in layers], [x["v_scale"] for x in layers]
    else:
        k_scales, v_scales = [1.0] * n, [1.0] * n
    return model, fake_quant_cache_class(fp8, k_scales, v_scales)


@dataclass(frozen=True)
class RecipeSpread:
    """The recipe run one pass against its token-by-token reference, as parity's teacher-forced mode."""

    summary: TeacherForcedSummary
    near_ties: int  # steps where the reference token and the best other token are within ``tie_margin``


def recipe_spread(prompts_path: str | Path, reference_path: str | Path, model_dir: str | Path, fp8: str,
                  kv_scales: str | Path | None = None, tie_margin: float = 2e-4) -> RecipeSpread:
    """Teacher-forced figures of the recipe itself (one pass with the fake-quant cache) against
    ``reference_path``; ``near_ties`` counts the steps an engine within ``tie_margin / 2`` of the
    one-pass logprobs could flip."""
    model, cache_cls = _load(model_dir, fp8, kv_scales)
    refs = {r["id"]: r for r in read_jsonl(reference_path)}
    rows, near = [], 0
    for p in read_jsonl(prompts_path):
        ref = refs[p["id"]]
        out, n = [int(t) for t in ref["output_token_ids"]], len(p["prompt_token_ids"])
        with torch.no_grad():
            logits = model(torch.tensor([list(p["prompt_token_ids"]) + out]), past_key_values=cache_cls(config=model.config),
                           use_cache=True).logits[0, n - 1:n - 1 + len(out)].float()
        lp = torch.log_softmax(logits, dim=-1)
        ours = lp[torch.arange(len(out)), torch.tensor(out)]
        top1 = lp.max(dim=-1).values
        best_other = lp.scatter(1, torch.tensor(out)[:, None], float("-inf")).max(dim=-1).values
        near += int(((ours - best_other).abs() <= tie_margin).sum())
        rows.append(teacher_forced_row(p["id"], reference_logprobs(ref), ours.tolist(), top1.tolist()))
    return RecipeSpread(summarize_teacher_forced(rows), near)


def make_reference(prompts_path: str | Path, model_dir: str | Path, fp8: str, kv_scales: str | Path | None,
                   out_path: str | Path, max_tokens: int = 64) -> None:
    from transformers import AutoTokenizer

    model, cache_cls = _load(model_dir, fp8, kv_scales)
    has_tokenizer = any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    tok = AutoTokenizer.from_pretrained(str(model_dir)) if has_tokenizer else None  # else ids only, text ""
    with open(prompts_path) as f, open(out_path, "w") as out:
        for line in f:
            if not line.strip():
                continue
            p = json.loads(line)
            rec = generate(model, p["prompt_token_ids"], cache_cls, max_tokens)
            text = tok.decode(rec["output_token_ids"], skip_special_tokens=True) if tok else ""
            rec = {"id": p["id"], **rec, "text": text}
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvserve.tools.fp8_reference", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--model", required=True, help="HF checkpoint folder (fp32 weights)")
    ap.add_argument("--fp8", choices=sorted(FORMATS), required=True)
    ap.add_argument("--kv-scales", default=None, help="kv_scales_scaled.json-style per-layer scales (default 1.0)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    ap.add_argument("--spread", action="store_true",
                    help="then print the recipe's own teacher-forced spread against the file it wrote")
    a = ap.parse_args(argv)
    make_reference(a.prompts, a.model, a.fp8, a.kv_scales, a.out, a.max_tokens)
    if a.spread:
        s = recipe_spread(a.prompts, a.out, a.model, a.fp8, a.kv_scales)
        print(f"recipe spread ({s.near_ties} near-tie steps): {teacher_forced_line(s.summary)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
