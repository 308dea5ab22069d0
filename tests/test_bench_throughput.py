"""``kvserve bench throughput`` (kvserve/bench/throughput.py): workloads, byte counts, the CPU run
of a small grid on the tiny model (JSON fields, sane numbers, both KV dtypes, the PNG)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvserve.bench import throughput as tp


def test_nano_vllm_workload_matches_nano_vllm_bench():
    """nano-vllm bench.py: seed(0); prompts [[randint(0, 10000) ...] for randint(100, 1024)]; then
    max_tokens randint(100, 1024) per request -- the same stream, the same order."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    outs = [random.randint(100, 1024) for _ in range(256)]
    reqs = tp.nano_vllm_requests()
    assert len(reqs) == 256
    assert [r.prompt_token_ids for r in reqs] == prompts
    assert [r.output_len for r in reqs] == outs
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.output_len <= 1024 for r in reqs)
    # a subset is the first N of the same 256
    sub = tp.nano_vllm_requests(16)
    assert [(r.prompt_token_ids, r.output_len) for r in sub] == [(r.prompt_token_ids, r.output_len) for r in reqs[:16]]
    # tiny vocabularies: ids capped
    small = tp.nano_vllm_requests(4, lengths=(4, 8, 6), max_token_id=511)
    assert all(0 <= t <= 511 for r in small for t in r.prompt_token_ids)
    assert all(4 <= len(r.prompt_token_ids) <= 8 and 4 <= r.output_len <= 6 for r in small)


def test_make_workloads_pairs_and_validates():
    wls = tp.make_workloads("random", 3, [8, 16], [4])
    assert [(w.input_len, w.output_len) for w in wls] == [(8, 4), (16, 4)]
    reqs = wls[1].requests(512)
    assert len(reqs) == 3 and all(len(r.prompt_token_ids) == 16 and r.output_len == 4 for r in reqs)
    assert all(0 <= t < 512 for r in reqs for t in r.prompt_token_ids)
    assert wls[1].requests(512) is reqs  # drawn once
    with pytest.raises(ValueError, match="same number"):
        tp.make_workloads("random", 3, [8, 16, 32], [4, 5])
    with pytest.raises(ValueError, match="--dataset"):
        tp.make_workloads("sharegpt", 3, [8], [4])
    (nano,) = tp.make_workloads("nano-vllm", 5, [8], [4])
    assert nano.describe()["nano_vllm_lengths"] == [100, 1024, 1024]


def test_decode_weight_bytes_tied_and_untied():
    class M(torch.nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.tie_word_embeddings = tied
            self.embed = torch.nn.Embedding(100, 8)
            self.proj = torch.nn.Linear(8, 8, bias=False)

    untied = M(False)
    total, read = tp.decode_weight_bytes(untied)
    assert total == (100 * 8 + 64) * 4 and read == 64 * 4
    total, read = tp.decode_weight_bytes(M(True))
    assert read == total == (100 * 8 + 64) * 4


def test_decode_roofline_reads_the_routed_experts_a_batch_goes_to():
    """A MoE model's decode roofline counts the routed experts the batch is expected to touch (uniform
    routing, ``traffic.expected_experts_touched``), not all of them; the experts' bytes come from the
    blocks' ``experts`` modules (two layers of 8 experts, top-2, here)."""
    from types import SimpleNamespace

    from kvserve.models.qwen3_next import SparseMoeBlock
    from kvserve.tools.traffic import expected_experts_touched

    cfg = SimpleNamespace(num_experts_per_tok=2, hidden_size=16, num_experts=8, moe_intermediate_size=4,
                          shared_expert_intermediate_size=4)
    model = torch.nn.Sequential(SparseMoeBlock(cfg, True), SparseMoeBlock(cfg, True), torch.nn.Linear(16, 16))
    e, k, xb = tp.routed_expert_bytes(model)
    assert (e, k, xb) == (8, 2, 2 * 8 * 3 * 16 * 4 * 4)  # 2 layers x 8 experts x (2I H + H I) fp32 numbers
    assert tp.routed_expert_bytes(torch.nn.Linear(4, 4)) == (0, 0, 0)
    steps = [(3, 1e-3, 10)] * 4  # decode-only steps of batch 3 at context 10
    w = 100_000
    dense = tp.decode_stats(steps, 1e9, w, 8)
    moe = tp.decode_stats(steps, 1e9, w, 8, {"num_experts": e, "top_k": k, "bytes": xb})
    assert dense["decode_weight_bytes"] == w
    assert moe["decode_weight_bytes"] == w - xb + round(xb * expected_experts_touched(8, 2, 3) / 8)
    assert moe["decode_roofline_ms"] == pytest.approx((moe["decode_weight_bytes"] + 10 * 8) / 1e9 * 1e3)
    # a hybrid: each sequence's recurrent state is read and written once a step
    layer = SimpleNamespace(state_shapes=lambda: ((6, 3), (2, 4, 5)))
    runner = SimpleNamespace(gdn_layers=[layer, layer], config=SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.bfloat16)))
    per_seq = tp.state_bytes_per_sequence(runner)
    assert per_seq == 2 * (6 * 3 * 2 + 2 * 4 * 5 * 4) and tp.state_bytes_per_sequence(SimpleNamespace()) == 0
    hybrid = tp.decode_stats(steps, 1e9, w, 8, state_bytes=per_seq)
    assert hybrid["decode_state_bytes"] == 2 * 3 * per_seq
    assert hybrid["decode_roofline_ms"] == pytest.approx((w + 10 * 8 + 2 * 3 * per_seq) / 1e9 * 1e3)


def test_copy_bandwidth_cpu():
    bw = tp.measure_copy_bandwidth("cpu", nbytes=4 << 20, iters=2)
    assert bw["bytes"] == 4 << 20 and bw["bytes_per_s"] > 1e8 and bw["GBps"] == bw["bytes_per_s"] / 1e9


def test_cli_grid_on_tiny_model(tiny, tmp_path, one_thread, capsys):
    from kvserve.entrypoints.cli import main

    out_json, out_png = tmp_path / "tp.json", tmp_path / "tp.png"
    rc = main([
        "bench", "throughput", "--model", str(tiny), "--dtype", "bfloat16", "--kv-cache-memory", str(1 << 24),
        "--kv-cache-dtype", "bfloat16,fp8", "--concurrency", "2,4", "--input-len", "8,16", "--output-len", "5,3",
        "--num-prompts", "6", "--num-warmup", "2", "--warmup-output-len", "2", "--copy-bw-bytes", str(4 << 20),
        "--json", str(out_json), "--plot", str(out_png),
    ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| kv dtype | conc | workload |" in printed
    assert out_png.is_file() and out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(out_json.read_text())
    assert doc["copy_bandwidth"]["bytes_per_s"] > 0
    points = doc["points"]
    assert len(points) == 2 * 2 * 2  # kv dtypes x concurrency x workloads
    assert {p["kv_cache_dtype_resolved"] for p in points} == {"bfloat16", "fp8"}
    assert {p["concurrency"] for p in points} == {2, 4}
    assert {(p["input_len"], p["output_len"]) for p in points} == {(8, 5), (16, 3)}
    for p in points:
        assert p["engine"]["max_num_seqs"] == p["concurrency"]
        assert p["engine"]["kv_cache_dtype"] == p["kv_cache_dtype_resolved"]
        assert p["num_requests"] == 6 and p["warmup_requests"] == 2
        assert p["output_tokens"] == 6 * p["output_len"] and p["prompt_tokens"] == 6 * p["input_len"]
        assert p["elapsed_s"] > 0 and p["num_preemptions"] == 0
        assert p["requests_per_s"] == pytest.approx(6 / p["elapsed_s"])
        assert p["output_tok_s"] == pytest.approx(p["output_tokens"] / p["elapsed_s"])
        assert 0 < p["output_tok_s"] < p["total_tok_s"]
        for m in ("ttft", "tpot", "itl"):
            assert 0 < p[f"p50_{m}_ms"] <= p[f"p90_{m}_ms"] <= p[f"p99_{m}_ms"]
            assert p[f"mean_{m}_ms"] > 0
        # every request has the same output length, so the mean gap between a request's tokens is
        # the mean of the requests' TPOTs
        assert p["mean_itl_ms"] == pytest.approx(p["mean_tpot_ms"], rel=1e-9)
        # the first token cannot come after the end of the run
        assert p["p99_ttft_ms"] <= p["elapsed_s"] * 1e3 + 1e-6
        # decode-only steps: the largest batch is the concurrency (6 requests, 2 or 4 at a time)
        assert p["decode_batch"] == p["concurrency"] and p["decode_steps"] >= 1
        assert p["decode_step_ms_mean"] > 0 and p["decode_step_ms_median"] > 0
        assert p["decode_mean_context_tokens"] > p["input_len"] * p["decode_batch"] - 1
        assert 0 < p["decode_roofline_ms"] and p["decode_roofline_fraction"] > 0
        kvb = p["engine"]["kv_bytes_per_token"]
        assert p["decode_kv_bytes_mean"] == pytest.approx(p["decode_mean_context_tokens"] * kvb)
    by_kv = {p["kv_cache_dtype_resolved"]: p["engine"]["kv_bytes_per_token"] for p in points}
    # 2 layers x K,V x 2 kv heads x head 16: 2 bytes (bf16) vs 1 byte (fp8) per element
    assert by_kv == {"bfloat16": 2 * 2 * 2 * 16 * 2, "fp8": 2 * 2 * 2 * 16}


def test_run_requests_checks_lengths_and_restores_scheduler(tiny, one_thread):
    eng = tp.build_engine(dict(model=str(tiny), kv_cache_memory=1 << 24, max_model_len=64))
    sched = eng.scheduler
    with pytest.raises(ValueError, match="max_model_len=64"):
        tp.run_requests(eng, [tp.BenchRequest([1] * 60, 10)])
    res = tp.run_requests(eng, tp.nano_vllm_requests(3, lengths=(4, 9, 7), max_token_id=511), temperature=0.6)
    assert res["num_requests"] == 3 and res["temperature"] == 0.6
    assert "schedule" not in sched.__dict__  # the observer is gone
    assert not eng.has_unfinished_requests()
