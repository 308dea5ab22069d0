"""fp8 KV cache on the real model and the golden set (slow): the issue's accuracy acceptance.

The golden fp8 files (Oracle C) were computed on another machine. An fp8 cache turns that
machine's ulp-level fp32 differences into different fp8 codes, so on this machine even the
reference recipe itself (transformers, token by token) misses the shipped files by more than the
teacher-forced bounds. What is checked here:

1. kvserve's teacher-forced logprobs equal the transformers recipe run here (fake-quantized K/V,
   one pass over prompt + output), within 1e-4: kvserve computes the reference's formula.
2. Against Oracle C regenerated on this machine (``kvserve.tools.fp8_reference``, the README's
   recipe), ``kvserve parity --teacher-forced`` meets the issue's bounds: e4m3 and e5m2 with
   scale 1.0, and the scaled e4m3 through synthetic ModelOpt and compressed-tensors checkpoints
   resolved by ``--kv-cache-dtype auto``. Where this machine's arithmetic puts the recipe's own
   spread (the recipe run one pass, as teacher forcing does, against its token-by-token file)
   outside those bounds, the bound is that spread (see ``_bounds``): on a 2-core AVX2 machine the
   spread is 98.6% / p50 5.7e-3 / p90 4.7e-2 (e4m3) and the issue's bounds apply, on a CI machine
   it was 97.5% / 9.1e-3 / 7.3e-2, which no engine can beat. A float32 cache fails the same
   bounds, so they still discriminate.
3. Against the shipped files, an fp8 cache is much closer than a float32 cache, which fails the
   bounds (the measure discriminates). (fp32 against vLLM fp32, essentially exact: test_parity.py.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8_checkpoints import make_fp8_checkpoint, scaled_kv_scales

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")]

E4M3_BOUNDS = ("--min-agree", "0.98", "--max-p50", "1e-2", "--max-p90", "1e-1")
E5M2_BOUNDS = ("--min-agree", "0.97", "--max-p50", "1.5e-2", "--max-p90", "1.5e-1")
_LAST = re.compile(r"^teacher-forced: (\d+)/(\d+) steps agree, p50 (\S+), p90 (\S+), p99 (\S+)$")


def _tf(prompts: Path, reference: Path, model: Path, kv_dtype: str, *bounds: str) -> tuple[int, str, tuple]:
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "parity", "--teacher-forced",
           "--prompts", str(prompts), "--reference", str(reference), "--dtype", "float32",
           "--kv-cache-dtype", kv_dtype, "--model", str(model), "--kv-cache-memory", str(1 << 30), *bounds]
    res = subprocess.run(cmd, capture_output=True, text=True)
    m = _LAST.match(res.stdout.strip().splitlines()[-1]) if res.stdout.strip() else None
    assert m, res.stdout[-2000:] + res.stderr[-2000:]
    agree, steps = int(m.group(1)), int(m.group(2))
    return res.returncode, res.stdout + res.stderr, (agree / steps, *(float(m.group(i)) for i in (3, 4, 5)))


def _bounds(issue: tuple[str, ...], spread) -> tuple[str, ...]:
    """The issue's bounds, loosened to the recipe's own spread where this machine's is wider: kvserve
    equals the one-pass recipe within 1e-4 a step (the first test), so p50 / p90 get +1e-4 and the
    agreement loses the steps whose top two tokens are within 2e-4 (``spread.near_ties``)."""
    want = dict(zip(issue[::2], map(float, issue[1::2])))
    s = spread.summary
    return ("--min-agree", f"{min(want['--min-agree'], (s.agree - spread.near_ties) / s.steps):.6f}",
            "--max-p50", f"{max(want['--max-p50'], s.p50 + 1e-4):.3e}",
            "--max-p90", f"{max(want['--max-p90'], s.p90 + 1e-4):.3e}")


@pytest.fixture(scope="session")
def local_reference(tmp_path_factory, shared_eval, default_model_path):
    """``local_reference(fp8, scaled) -> path``: Oracle C regenerated here (once per session)."""
    from kvserve.tools.fp8_reference import make_reference

    made: dict[tuple[str, bool], Path] = {}
    folder = tmp_path_factory.mktemp("fp8-refs")

    def get(fp8: str, scaled: bool = False) -> Path:
        if (fp8, scaled) not in made:
            out = folder / f"ref_{fp8}_{'scaled' if scaled else 'scale1'}.jsonl"
            scales = shared_eval / "kv_scales_scaled.json" if scaled else None
            make_reference(shared_eval / "golden_public.jsonl", default_model_path, fp8, scales, out)
            made[(fp8, scaled)] = out
        return made[(fp8, scaled)]

    return get


@pytest.fixture(scope="session")
def local_bounds(shared_eval, default_model_path, local_reference):
    """``local_bounds(fp8, scaled, issue_bounds) -> (bounds, spread)`` against ``local_reference``."""
    from kvserve.tools.fp8_reference import recipe_spread

    spreads: dict[tuple[str, bool], object] = {}

    def get(fp8: str, scaled: bool, issue: tuple[str, ...]) -> tuple[tuple[str, ...], object]:
        if (fp8, scaled) not in spreads:
            scales = shared_eval / "kv_scales_scaled.json" if scaled else None
            spreads[(fp8, scaled)] = recipe_spread(shared_eval / "golden_public.jsonl", local_reference(fp8, scaled),
                                                   default_model_path, fp8, scales)
        return _bounds(issue, spreads[(fp8, scaled)]), spreads[(fp8, scaled)]

    return get


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_teacher_forced_logprobs_equal_the_transformers_recipe(shared_eval, default_model_path, fp8):
    """An exactness check, not a tolerance: on one machine kvserve's reference backend computes K/V
    with the same torch ops as transformers' sdpa path, so both quantize the same bits (measured
    2026-12-01, transformers 5.17 and 5.24, AVX2 and scalar CPU paths: max |d| 0 for e4m3, 4e-6
    for e5m2). fp8 rounding amplifies any other op order (the same recipe with eager attention:
    p50 2e-2, max 0.3-1.8), so a failure here after a transformers upgrade means its attention path
    changed order: re-derive the bound from the recipe run two ways, do not just widen it."""
    from transformers import AutoModelForCausalLM

    from kvserve import LLM, SamplingParams
    from kvserve.tools.fp8_reference import fake_quant_cache_class

    wanted = {"pub_01_fact_capital", "pub_05_translate_fr", "pub_09_utf8_emoji_accents", "pub_19_summarize_short",
              "pub_21_long_wrenfield"}
    prompts = [p for p in map(json.loads, open(shared_eval / "golden_public.jsonl")) if p["id"] in wanted]
    refs = {r["id"]: r for r in map(json.loads, open(shared_eval / f"golden_public_fp8_{fp8}_scale1.jsonl"))}
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    cache_cls = fake_quant_cache_class(fp8, [1.0] * 30, [1.0] * 30)
    llm = LLM(str(default_model_path), dtype="float32", kv_cache_dtype=f"fp8_{fp8}", kv_cache_memory=1 << 30)
    worst = 0.0
    for p in prompts:
        out_ids = refs[p["id"]]["output_token_ids"]
        ids, n = p["prompt_token_ids"] + out_ids, len(p["prompt_token_ids"])
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids]), past_key_values=cache_cls(config=model.config),
                                         use_cache=True).logits[0].float(), dim=-1)
        ours = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                            use_tqdm=False)[0].prompt_logprobs
        for i, t in enumerate(out_ids):
            worst = max(worst, abs(ours[n + i][t].logprob - float(lp[n - 1 + i, t])))
    assert worst <= 1e-4, f"kvserve vs the transformers fake-quant recipe: max |d logprob| {worst:.2e}"


@pytest.mark.parametrize("fp8,bounds", [("e4m3", E4M3_BOUNDS), ("e5m2", E5M2_BOUNDS)])
def test_fp8_meets_the_bounds_against_a_reference_made_here(shared_eval, default_model_path, local_reference,
                                                           local_bounds, fp8, bounds):
    bounds, spread = local_bounds(fp8, False, bounds)
    rc, out, stats = _tf(shared_eval / "golden_public.jsonl", local_reference(fp8), default_model_path, f"fp8_{fp8}", *bounds)
    assert rc == 0, f"bounds {bounds} (recipe spread {spread})\n{out[-2500:]}"
    # ...and a float32 cache fails the same bounds against the same reference
    rc_auto, out_auto, _ = _tf(shared_eval / "golden_public.jsonl", local_reference(fp8), default_model_path, "auto", *bounds)
    assert rc_auto == 1 and "bound failed" in out_auto, f"bounds {bounds} (recipe spread {spread})\n{out_auto[-1500:]}"


@pytest.mark.parametrize("form", ["modelopt", "compressed-tensors"])
def test_scaled_checkpoint_resolves_fp8_and_meets_the_bounds(shared_eval, default_model_path, local_reference,
                                                             local_bounds, tmp_path, form):
    k, v = scaled_kv_scales(shared_eval)
    folder = make_fp8_checkpoint(default_model_path, tmp_path / form, form, k, v)
    bounds, spread = local_bounds("e4m3", True, E4M3_BOUNDS)
    rc, out, stats = _tf(shared_eval / "golden_public.jsonl", local_reference("e4m3", scaled=True), folder, "auto", *bounds)
    assert rc == 0, f"bounds {bounds} (recipe spread {spread})\n{out[-2500:]}"
    assert out.count("kv_cache_dtype=fp8_e4m3 (from the checkpoint (") == 1
    assert "KV cache scales: loaded for 30/30 attention layers" in out


def test_shipped_fp8_file_tells_fp8_from_a_float_cache(shared_eval, default_model_path):
    """Against the shipped e4m3 file (another machine's arithmetic, which the recipe's spread
    absorbs): fp8 meets the bounds loosened to that spread and is far closer than a float32 cache,
    which fails them."""
    from kvserve.tools.fp8_reference import recipe_spread

    ref = shared_eval / "golden_public_fp8_e4m3_scale1.jsonl"
    prompts = shared_eval / "golden_public.jsonl"
    spread = recipe_spread(prompts, ref, default_model_path, "e4m3")
    bounds = _bounds(E4M3_BOUNDS, spread)
    rc8, out8, fp8 = _tf(prompts, ref, default_model_path, "fp8_e4m3", *bounds)
    rc32, out32, f32 = _tf(prompts, ref, default_model_path, "auto", *bounds)
    assert rc8 == 0, f"bounds {bounds} (recipe spread {spread})\n{out8[-2500:]}"
    assert rc32 == 1 and "bound failed" in out32, f"bounds {bounds} (recipe spread {spread})\n{out32[-1500:]}"
    assert fp8[0] >= f32[0] + 0.02, (fp8, f32)  # agreement
    assert fp8[1] <= f32[1] / 2 and fp8[2] <= f32[2] / 1.5, (fp8, f32)  # p50, p90


def test_bounds_loosen_only_to_a_wider_recipe_spread():
    """The issue's bounds stand where the recipe's spread is inside them; a wider spread replaces each
    bound it exceeds (with kvserve's 1e-4 and the near-tie steps as slack), and only that bound."""
    from kvserve.tools.fp8_reference import RecipeSpread
    from kvserve.tools.parity import TeacherForcedSummary

    tight = RecipeSpread(TeacherForcedSummary(1239, 1222, 1.8e-2, 0.54, 5.7e-3, 4.7e-2, 0.16), near_ties=3)
    assert _bounds(E4M3_BOUNDS, tight) == ("--min-agree", "0.980000", "--max-p50", "1.000e-02", "--max-p90", "1.000e-01")
    wide = RecipeSpread(TeacherForcedSummary(1238, 1207, 2.5e-2, 0.37, 9.1e-3, 1.2e-1, 0.19), near_ties=2)
    assert _bounds(E4M3_BOUNDS, wide) == ("--min-agree", f"{1205 / 1238:.6f}", "--max-p50", "1.000e-02",
                                          "--max-p90", "1.201e-01")
