"""kvserve parity: the comparison rules on synthetic records, and the real CLI on the golden set."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.tools.parity import ParityRow, compare, summary_line


def _ref(ids, tops):
    return {"id": "x", "output_token_ids": ids, "top_logprobs": tops}


def test_exact_match():
    row = compare("x", [5, 6, 2], _ref([5, 6, 2], [[[5, -0.1]], [[6, -0.2]], [[2, -0.3]]]), 0.01)
    assert row.status == "match" and row.diverge_at is None


def test_near_tie_and_divergence_use_the_reference_gap():
    tops = [[[5, -0.1], [9, -3.0]], [[6, -0.700], [7, -0.705], [8, -2.0]]]
    tie = compare("x", [5, 7], _ref([5, 6], tops), 0.01)
    assert (tie.status, tie.diverge_at) == ("near-tie", 1)
    assert tie.gap == pytest.approx(0.005)
    real = compare("x", [5, 8], _ref([5, 6], tops), 0.01)
    assert real.status == "diverged" and real.gap == pytest.approx(1.3)
    # our token outside the reference's top-k: a real divergence with no measurable gap
    outside = compare("x", [5, 42], _ref([5, 6], tops), 0.01)
    assert outside.status == "diverged" and outside.gap is None
    # a wider margin turns the 0.005 gap... and only that one... into a tie
    assert compare("x", [5, 8], _ref([5, 6], tops), 2.0).status == "near-tie"


def test_length_mismatch_is_a_divergence_at_the_shorter_end():
    tops = [[[5, -0.1]], [[6, -0.2]], [[2, -0.3]]]
    row = compare("x", [5, 6], _ref([5, 6, 2], tops), 0.01)
    assert row.status == "diverged" and row.diverge_at == 2


def test_summary_line_format():
    rows = [ParityRow("a", "match", 1, 1), ParityRow("b", "near-tie", 1, 1, 0, 0.001), ParityRow("c", "diverged", 1, 1, 0)]
    assert summary_line(rows) == "parity: 1/3 exact, 1 near-tie, 1 diverged"


def test_cli_exit_code_follows_divergences(tmp_path, make_tiny_model):
    """Against a reference that is the engine's own output, exit 0; a corrupted reference, exit 1."""
    from kvserve import LLM, SamplingParams

    folder = make_tiny_model("llama")
    prompts = [{"id": f"p{i}", "prompt_token_ids": list(range(3 + i, 30 + 2 * i))} for i in range(3)]
    llm = LLM(str(folder), kv_cache_memory=1 << 24)
    outs = llm.generate([{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, logprobs=5), use_tqdm=False)
    refs = []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        tops = [[[t, lp.logprob] for t, lp in sorted(d.items(), key=lambda kv: -kv[1].logprob)] for d in c.logprobs]
        refs.append({"id": p["id"], "output_token_ids": list(c.token_ids), "top_logprobs": tops})
    ppath, rpath = tmp_path / "p.jsonl", tmp_path / "r.jsonl"
    ppath.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    rpath.write_text("".join(json.dumps(r) + "\n" for r in refs))
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "parity", "--prompts", str(ppath),
           "--reference", str(rpath), "--model", str(folder), "--max-tokens", "8", "--kv-cache-memory", str(1 << 24)]
    ok = subprocess.run(cmd, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().splitlines()[-1] == "parity: 3/3 exact, 0 near-tie, 0 diverged"

    refs[1]["output_token_ids"][4] = (refs[1]["output_token_ids"][4] + 1) % 400
    rpath.write_text("".join(json.dumps(r) + "\n" for r in refs))
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode == 1
    assert bad.stdout.strip().splitlines()[-1] == "parity: 2/3 exact, 0 near-tie, 1 diverged"


@pytest.mark.slow
def test_golden_set_is_token_exact_against_vllm_fp32(shared_eval, default_model_path):
    """The issue's acceptance run: all 24 golden prompts in one batch, fp32, vs vLLM 0.32 fp32."""
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "parity",
           "--prompts", str(shared_eval / "golden_public.jsonl"),
           "--reference", str(shared_eval / "golden_public_vllm_fp32.jsonl"),
           "--dtype", "float32", "--model", str(default_model_path), "--kv-cache-memory", str(1 << 30)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1] == "parity: 24/24 exact, 0 near-tie, 0 diverged"
