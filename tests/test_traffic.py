"""``kvserve traffic``: the byte arithmetic by hand, presets, config parsing, CLI output, errors."""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from kvserve.tools.traffic import (
    PRESETS,
    ModelShape,
    add_parser,
    model_shape,
    prefill_read_tokens,
    run,
    shape_from_config,
    traffic,
)

TINY = ModelShape("tiny", num_layers=2, num_attention_layers=2, num_kv_heads=1, head_dim=4,
                  num_params=1000, weight_bytes=2000)
HYBRID = ModelShape("hybrid", num_layers=4, num_attention_layers=1, num_kv_heads=2, head_dim=8,
                    num_params=5000, weight_bytes=10000, state_bytes=300)

QWEN36_27B_CONFIG = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 24,
        "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 17408, "vocab_size": 248320,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "mamba_ssm_dtype": "float32", "attn_output_gate": True, "dtype": "bfloat16",
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)],
    },
}
SMOLLM2_CONFIG = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                  "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
                  "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
LLAMA_8B_CONFIG = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                   "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def _cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["traffic", *argv])


def test_tiny_shape_by_hand():
    # kv bytes per token: 2 (K,V) * 1 head * 4 dims * 2 bytes * 2 layers = 32 (bf16), 16 (fp8)
    r = traffic(TINY, input_len=10, output_len=4, concurrency=3, kv_cache_dtype="bfloat16", q_tile=4)
    b = r.bf16
    assert b.kv_bytes_per_token == 32 and r.fp8.kv_bytes_per_token == 16
    assert b.request_kv_write == (10 + 4) * 32
    assert b.request_prefill_kv_read == (4 + 8 + 10) * 32  # query tiles end at 4, 8, 10
    assert b.request_decode_kv_read == (11 + 12 + 13 + 14) * 32
    assert b.request_kv_resident == 16 * 32  # 14 tokens in one 16-token page
    assert asdict(b.prefill) == {"weights": 2000, "kv_write": 320, "kv_read": 704, "state": 0, "tokens": 10}
    # mean decode context 10 + (4 + 1) / 2 = 12.5 tokens, 3 requests
    assert asdict(b.decode_mean) == {"weights": 2000, "kv_write": 96, "kv_read": 1200, "state": 0, "tokens": 3}
    assert asdict(b.decode_last) == {"weights": 2000, "kv_write": 96, "kv_read": 3 * 14 * 32, "state": 0, "tokens": 3}
    assert b.prefill.total == 2000 + 320 + 704
    assert b.prefill.kv_share == pytest.approx(1024 / 3024)
    assert r.memory_s(b.prefill) == pytest.approx(3024 / 4.1e12)
    assert r.compute_s(b.prefill) == pytest.approx(2 * 1000 * 10 / 750e12)


def test_chunked_prefill_and_hybrid_state_by_hand():
    # chunks of 5 with tiles of 2: [0,5) tiles end 2, 4, 5; [5,10) tiles end 7, 9, 10
    assert prefill_read_tokens(10, 5, 2) == 11 + 26
    assert prefill_read_tokens(10, 4, 4) == 4 + 8 + 10  # tile = chunk: chunk j reads (j+1)*C tokens
    r = traffic(HYBRID, input_len=10, output_len=2, concurrency=2, prefill_chunk=5, q_tile=2, block_size=4)
    kv = 2 * 2 * 8 * 2 * 1  # 64 bytes per token
    assert r.bf16.kv_bytes_per_token == kv and r.prefill_chunk == 5 and r.q_tile == 2
    p = r.bf16.prefill
    assert (p.weights, p.kv_write, p.kv_read, p.state) == (2 * 10000, 10 * kv, 37 * kv, 3 * 300)
    d = r.bf16.decode_last
    assert (d.weights, d.kv_write, d.kv_read, d.state) == (10000, 2 * kv, 2 * 12 * kv, 2 * 2 * 300)
    assert r.bf16.request_kv_resident == 12 * kv


@pytest.mark.parametrize("isl,chunk,tile", [(1, 1, 1), (7, 3, 2), (100, 0, 128), (1000, 256, 64), (1025, 512, 100)])
def test_prefill_reads_match_a_row_by_row_count(isl, chunk, tile):
    chunk = chunk or isl
    naive = 0
    for c0 in range(0, isl, chunk):
        ce = min(c0 + chunk, isl)
        naive += sum(min(t + tile, ce) for t in range(c0, ce, tile))
    assert prefill_read_tokens(isl, chunk, min(tile, chunk)) == naive


@pytest.mark.parametrize("shape", [TINY, HYBRID, *PRESETS.values()])
@pytest.mark.parametrize("isl,osl,n", [(1, 1, 1), (1024, 1024, 64), (333, 77, 5)])
def test_fp8_halves_every_kv_quantity_and_nothing_else(shape, isl, osl, n):
    r = traffic(shape, isl, osl, n, "fp8")
    b, q = r.bf16, r.fp8
    for f in ("kv_bytes_per_token", "request_kv_write", "request_prefill_kv_read", "request_decode_kv_read",
              "request_kv_resident"):
        assert getattr(b, f) == 2 * getattr(q, f), f
    for step in ("prefill", "decode_mean", "decode_last"):
        sb, sq = getattr(b, step), getattr(q, step)
        assert sb.kv_write == 2 * sq.kv_write and sb.kv_read == 2 * sq.kv_read
        assert (sb.weights, sb.state, sb.tokens) == (sq.weights, sq.state, sq.tokens)
        assert r.compute_s(sb) == r.compute_s(sq)
        assert r.change_pct(step) < 0


def test_presets():
    q = model_shape("qwen3.6-27b")
    assert (q.num_layers, q.num_attention_layers, q.num_kv_heads, q.head_dim) == (64, 16, 4, 256)
    assert q.kv_bytes_per_token(2) == 65536 and q.weight_bytes == 2 * q.num_params
    assert 25e9 < q.num_params < 27e9 and q.state_bytes == 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4)
    nv = model_shape("nvidia/Qwen3.6-27B-NVFP4")
    assert nv.name == "qwen3.6-27b-nvfp4" and 0.6 < nv.weight_bytes / nv.num_params < 0.75
    assert model_shape("Qwen/Qwen3.6-27B") == q == model_shape("qwen3.5-27b")
    s = model_shape("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (s.num_layers, s.num_attention_layers, s.num_kv_heads, s.head_dim) == (30, 30, 3, 64)
    assert s.num_params == 134_515_008 and s.weight_bytes == 2 * 134_515_008  # tied: the table is the lm_head
    ll = model_shape("llama-3.1-8b")
    assert (ll.num_attention_layers, ll.num_kv_heads, ll.head_dim) == (32, 8, 128)
    assert ll.num_params + 128256 * 4096 == 8_030_261_248  # reported size = read params + input embedding


@pytest.mark.parametrize("cfg,preset", [(QWEN36_27B_CONFIG, "qwen3.6-27b"), (SMOLLM2_CONFIG, "smollm2-135m"),
                                        (LLAMA_8B_CONFIG, "llama-3.1-8b")])
def test_config_estimate_reproduces_the_presets(cfg, preset):
    s, p = shape_from_config(cfg, preset), PRESETS[preset]
    assert (s.num_layers, s.num_attention_layers, s.num_kv_heads, s.head_dim) == \
           (p.num_layers, p.num_attention_layers, p.num_kv_heads, p.head_dim)
    assert (s.num_params, s.weight_bytes, s.state_bytes) == (p.num_params, p.weight_bytes, p.state_bytes)


def test_hybrid_config_json_folder_and_path(tmp_path):
    cfg = {"model_type": "qwen3_next", "num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128, "vocab_size": 100,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
           "layer_types": ["linear_attention", "full_attention", "linear_attention",
                           "linear_attention", "linear_attention", "full_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = model_shape(str(tmp_path))
    assert replace(s, name="") == replace(model_shape(str(tmp_path / "config.json")), name="")
    assert (s.num_layers, s.num_attention_layers, s.num_kv_heads, s.head_dim) == (6, 2, 2, 32)
    assert s.kv_bytes_per_token(1) == 2 * 2 * 32 * 2
    conv = 2 * 2 * 16 + 4 * 16
    assert s.state_bytes == 4 * (conv * 3 * 2 + 4 * 16 * 16 * 4)  # conv state bf16, SSM state fp32 (as kvserve keeps it)
    # without layer_types, full_attention_interval 3 puts full attention at layers 2 and 5
    cfg.pop("layer_types")
    cfg["full_attention_interval"] = 3
    assert shape_from_config(cfg).num_attention_layers == 2
    # nested text_config is read
    assert shape_from_config({"model_type": "x", "text_config": cfg}).num_attention_layers == 2


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    header, off = {}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * off)


def test_weight_bytes_from_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B_CONFIG))
    _write_safetensors(tmp_path / "model-1.safetensors", {
        "model.embed_tokens.weight": ("BF16", [10, 4], 80),  # untied: gathered, not read
        "model.layers.0.mlp.up_proj.weight": ("U8", [4, 2], 8),
        "model.layers.0.mlp.up_proj.weight_scale": ("F8_E4M3", [4, 1], 4),
    })
    _write_safetensors(tmp_path / "model-2.safetensors", {
        "lm_head.weight": ("BF16", [10, 4], 80),
        "model.norm.weight": ("F32", [4], 16),  # fp32 is served as bf16
        "mtp.fc.weight": ("BF16", [4, 4], 32),
        "model.visual.blocks.0.weight": ("BF16", [4, 4], 32),
    })
    s = model_shape(str(tmp_path))
    assert s.weight_bytes == 8 + 4 + 80 + 8 and s.num_params == PRESETS["llama-3.1-8b"].num_params


def test_cli_human_table_marks_the_requested_dtype(capsys):
    assert run(_cli("--model", "qwen3.6-27b", "--input-len", "1024", "--output-len", "1024",
                    "--kv-cache-dtype", "fp8_e4m3")) == 0
    out = capsys.readouterr().out
    assert "bf16" in out and "fp8 *" in out and "KV read by prefill attention" in out
    assert "288.00 MiB" in out and "144.00 MiB" in out


def _walk(d, path=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{path}{k}.")
        else:
            yield f"{path}{k}", v


def test_cli_json_is_one_object_with_integer_bytes(capsys):
    assert run(_cli("--model", "qwen3.6-27b", "--input-len", "1024", "--output-len", "1024",
                    "--concurrency", "64", "--json")) == 0
    out = capsys.readouterr().out
    d = json.loads(out)
    assert out.count("\n") == 1 and d["selected"] == "bf16" and d["kv_cache_dtype"] == "auto"
    fields = dict(_walk(d))
    byte_keys = [k for k in fields if k.rsplit(".", 1)[-1] in
                 {"weights", "kv_write", "kv_read", "state", "total", "weight_bytes", "state_bytes",
                  "kv_bytes_per_token", "request_kv_write", "request_prefill_kv_read",
                  "request_decode_kv_read", "request_kv_resident"}]
    assert len(byte_keys) == 2 + 2 * (5 + 3 * 5)
    assert all(type(fields[k]) is int for k in byte_keys)
    assert d["bf16"]["prefill"]["kv_read"] == 288 << 20 and d["fp8"]["prefill"]["kv_read"] == 144 << 20
    assert d["bf16"]["decode_last"]["kv_read"] == 64 * 2048 * 65536


def test_hybrid_snapshot_interval_is_vllms_and_doubles_with_fp8(capsys):
    """Hybrid prefix caching: a state snapshot every 784 tokens with bf16 pages, 1,568 with fp8 (the
    granularity vLLM logs for the 27B), each snapshot 3x the KV bytes of its interval; none for a
    model without recurrent state."""
    r = traffic(model_shape("qwen3.6-27b"), 1024, 16, 1)
    assert (r.bf16.snapshot_interval, r.fp8.snapshot_interval) == (784, 1568)
    assert traffic(model_shape("llama-3.1-8b"), 1024, 16, 1).fp8.snapshot_interval == 0
    assert run(_cli("--model", "qwen3.6-27b", "--input-len", "1024", "--output-len", "16")) == 0
    out = capsys.readouterr().out
    assert "tokens between state snapshots" in out and "1,568" in out and "3.00" in out
    assert run(_cli("--model", "llama-3.1-8b", "--input-len", "1024", "--output-len", "16")) == 0
    assert "state snapshots" not in capsys.readouterr().out


def test_worked_example_qwen36_27b_isl_1024():
    r = traffic(model_shape("qwen3.6-27b"), 1024, 1024, 1, "fp8")
    p = r.bf16.prefill
    assert (p.kv_write, p.kv_read) == (64 << 20, 288 << 20)
    assert p.kv_share < 0.0075 and -0.40 < r.change_pct("prefill") < -0.30
    assert r.compute_s(p) > 5 * r.memory_s(p)  # prefill at ISL 1024 is matmul-bound
    assert r.change_pct("prefill", roofline=True) == 0.0


@pytest.mark.parametrize("kwargs,bad", [
    ({"input_len": -5}, "input_len -5"), ({"output_len": 0}, "output_len 0"),
    ({"concurrency": 0}, "concurrency 0"), ({"kv_cache_dtype": "int8"}, "'int8'"),
    ({"bandwidth": 0.0}, "bandwidth 0.0"), ({"q_tile": -1}, "q_tile -1"), ({"block_size": 0}, "block_size 0"),
])
def test_bad_values_name_the_value_and_what_is_accepted(kwargs, bad):
    args = {"input_len": 8, "output_len": 8, **kwargs}
    with pytest.raises(ValueError) as e:
        traffic(TINY, **args)
    assert bad in str(e.value) and ("expected" in str(e.value) or "Supported" in str(e.value))


def test_bad_models(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'qwen9-1t'.*qwen3.6-27b"):
        model_shape("qwen9-1t")
    with pytest.raises(ValueError, match="has no config.json"):
        model_shape(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="'hidden_size'"):
        model_shape(str(tmp_path))


def test_module_needs_no_torch():
    code = ("import importlib.util, sys; "
            "s = importlib.util.spec_from_file_location('t', sys.argv[1]); m = importlib.util.module_from_spec(s); "
            "sys.modules['t'] = m; s.loader.exec_module(m); "
            "m.format_report(m.traffic(m.model_shape('qwen3.6-27b'), 1024, 1024, 64, 'fp8')); "
            "assert 'torch' not in sys.modules")
    src = Path(__file__).parents[1] / "kvserve" / "tools" / "traffic.py"
    res = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


# ---- mixture of experts: a step reads the experts its tokens go to --------------------------------
def test_expected_experts_touched_matches_uniform_routing_by_sampling():
    """E (1 - (1 - k/E)^T) against the mean number of distinct experts T tokens pick, each its k
    uniformly without repetition (20,000 draws: the sample mean's standard error is < 0.02 here)."""
    import random

    from kvserve.tools.traffic import expected_experts_touched

    assert expected_experts_touched(256, 8, 0) == 0.0 and expected_experts_touched(256, 8, 1) == pytest.approx(8)
    assert expected_experts_touched(256, 8, 8192) == pytest.approx(256)
    rng = random.Random(0)
    for e, k, t in ((16, 2, 5), (64, 8, 3), (256, 8, 32)):
        draws = 20_000
        mean = sum(len({x for _ in range(t) for x in rng.sample(range(e), k)}) for _ in range(draws)) / draws
        assert abs(mean - expected_experts_touched(e, k, t)) < 0.1, (e, k, t, mean)


MOE_CONFIG = {  # a tiny Qwen3.5-MoE-shaped text config: 4 layers (1 full attention), 8 experts, top-2
    "model_type": "qwen3_5_moe_text", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "tie_word_embeddings": False,
}


def test_moe_shape_reads_the_experts_a_step_goes_to():
    from kvserve.tools.traffic import expected_experts_touched

    s = shape_from_config(MOE_CONFIG, "moe")
    per_layer = 8 * 3 * 64 * 32  # routed experts of one layer (the router and the shared expert apart)
    assert (s.num_experts, s.experts_per_token, s.expert_params) == (8, 2, 4 * per_layer)
    assert s.expert_bytes == 2 * s.expert_params and s.weight_bytes == 2 * s.num_params
    rest = s.weight_bytes - s.expert_bytes
    assert s.step_weight_bytes(1) == rest + s.expert_bytes * 2 // 8
    assert s.step_weight_bytes(3) == rest + round(s.expert_bytes * expected_experts_touched(8, 2, 3) / 8)
    assert s.active_params == s.num_params - s.expert_params * 6 / 8
    r = traffic(s, 100, 10, 3, prefill_chunk=64)  # chunks of 64 and 36 tokens: nearly every expert each
    assert r.bf16.prefill.weights == s.step_weight_bytes(64) + s.step_weight_bytes(36)
    assert r.bf16.decode_mean.weights == r.bf16.decode_last.weights == s.step_weight_bytes(3)
    assert r.compute_s(r.bf16.decode_mean) == pytest.approx(2 * s.active_params * 3 / r.flops)
    dense = shape_from_config({**MOE_CONFIG, "num_experts": 0, "intermediate_size": 128}, "dense")
    assert dense.num_experts == 0 and dense.step_weight_bytes(1) == dense.weight_bytes


def test_moe_checkpoint_counts_its_routed_experts_bytes(tmp_path):
    """From a checkpoint's safetensors: the routed experts' tensors (per expert or stacked), not the
    shared expert's, are the experts' share of the bytes."""
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(MOE_CONFIG))
    t = {"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64, dtype=torch.bfloat16),
         "model.layers.0.mlp.experts.1.down_proj.weight": torch.zeros(64, 32, dtype=torch.float32),  # counted as bf16
         "model.layers.1.mlp.experts.gate_up_proj": torch.zeros(8, 64, 64, dtype=torch.bfloat16),
         "model.layers.0.mlp.shared_expert.gate_proj.weight": torch.zeros(32, 64, dtype=torch.bfloat16),
         "model.layers.0.mlp.gate.weight": torch.zeros(8, 64, dtype=torch.bfloat16),
         "lm_head.weight": torch.zeros(1000, 64, dtype=torch.bfloat16)}
    save_file(t, str(tmp_path / "model.safetensors"))
    s = model_shape(str(tmp_path))
    assert s.expert_bytes == 2 * (32 * 64 + 64 * 32 + 8 * 64 * 64)
    assert s.weight_bytes == s.expert_bytes + 2 * (32 * 64 + 8 * 64 + 1000 * 64)
