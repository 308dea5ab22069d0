"""GPU-only (H200): the triton backend with CUDA graphs against the reference backend, graphs
against eager, and graph replay with padded batches. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# different prompt lengths and output lengths: decode batches shrink 6 -> 1 (graph padding)
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * n) % 500 + 3 for i in range(n)]} for n in (5, 37, 64, 130, 300, 17)]
MAX_TOKENS = (40, 7, 25, 3, 33, 18)


def _tokens(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.llm_engine.kv_manager.check_invariants()
    return [list(o.outputs[0].token_ids) for o in outs]


def _llm(folder, **kw) -> LLM:
    return LLM(str(folder), kv_cache_memory=1 << 26, max_num_seqs=8, max_model_len=512, **kw)


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_triton_with_graphs_gives_reference_tokens_fp32(make_tiny_model, kv):
    """kvserve's own triton name reads the pages as the reference does (dequantized K and V, the query
    kept); ``auto`` would take TRITON_ATTN here, whose e4m3 read quantizes the query (other numerics)."""
    folder = make_tiny_model("qwen3")
    ref = _tokens(_llm(folder, dtype="float32", kv_cache_dtype=kv, attention_backend="reference"))
    llm = _llm(folder, dtype="float32", kv_cache_dtype=kv, attention_backend="triton")
    runner = llm.llm_engine.runner
    assert runner.backend == "triton" and runner.graphs is not None
    assert runner.graphs.sizes == [1, 2, 4, 8]
    replays: list[int] = []
    real_run = runner.graphs.run

    def spy(input_ids, positions, meta):
        replays.append(len(meta.query_lens))
        return real_run(input_ids, positions, meta)

    runner.graphs.run = spy
    assert _tokens(llm) == ref
    assert {3, 5, 6} & set(replays), f"padded decode batches should replay graphs, saw {sorted(set(replays))}"


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_graphs_equal_eager_bf16(make_tiny_model, kv):
    folder = make_tiny_model("llama", num_attention_heads=8, num_key_value_heads=2, hidden_size=256, head_dim=128)
    eager = _tokens(_llm(folder, dtype="bfloat16", kv_cache_dtype=kv, enforce_eager=True))
    graphs = _tokens(_llm(folder, dtype="bfloat16", kv_cache_dtype=kv))
    assert graphs == eager


def test_enforce_eager_captures_nothing(make_tiny_model):
    llm = _llm(make_tiny_model("llama"), dtype="bfloat16", enforce_eager=True)
    assert llm.llm_engine.runner.graphs is None


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_async_scheduling_equals_sync_with_graphs(make_tiny_model, kv):
    """fp32 model, triton + CUDA graphs: async scheduling (device-side input tokens, one step in
    flight, wasted rows after stops) gives the serial engine's tokens, seeded sampling included."""
    folder = make_tiny_model("qwen3")
    first = _tokens(_llm(folder, dtype="float32", kv_cache_dtype=kv, async_scheduling=False))
    stops = sorted({t[2] for t in first if len(t) > 2})[:2]

    def run(async_scheduling):
        llm = _llm(folder, dtype="float32", kv_cache_dtype=kv, async_scheduling=async_scheduling)
        assert llm.llm_engine.async_scheduling is async_scheduling
        params = [SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=n, stop_token_ids=stops)
                  for i, n in enumerate(MAX_TOKENS)]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        eng = llm.llm_engine
        eng.kv_manager.check_invariants()
        assert eng.kv_manager.num_free_blocks == eng.kv_manager.pool.num_blocks
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]

    sync, asyn = run(False), run(True)
    assert asyn == sync
    assert any(r == "stop" for _, r in sync)


def _nvfp4_export(make_tiny_model, tmp_path, arch: str, **cfg):
    from kvserve.tools.modelopt_export import export_modelopt

    return export_modelopt(make_tiny_model(arch, seed=3, **cfg), tmp_path / f"{arch}-nvfp4", "NVFP4",
                           kv_cache_quant_algo=None, calibration_tokens=32)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "qwen3_5_moe"])
def test_w4a16_with_graphs_gives_the_reference_backends_tokens_fp32(make_tiny_model, tmp_path, arch):
    """An NVFP4 export on the triton backend (every all-NVFP4 Linear on the W4A16 GEMM, the MoE's
    routed experts on the grouped one; decode in CUDA graphs except for the MoE, stream-K tile
    counters inside them) gives the reference backend's tokens, which multiply by the same weights
    dequantized once (float32: only the summation order differs)."""
    from kvserve.layers.quant_experts import NVFP4Experts
    from kvserve.layers.quant_linear import NVFP4Linear

    folder = _nvfp4_export(make_tiny_model, tmp_path, arch)
    ref = _tokens(_llm(folder, dtype="float32", attention_backend="reference"))
    llm = _llm(folder, dtype="float32")
    runner = llm.llm_engine.runner
    assert runner.backend == "triton" and (runner.graphs is not None) == (arch != "qwen3_5_moe")
    mods = list(runner.model.modules())
    assert any(isinstance(m, NVFP4Linear) for m in mods)
    assert any(isinstance(m, NVFP4Experts) for m in mods) == (arch == "qwen3_5_moe")
    assert _tokens(llm) == ref


def test_w4a16_graphs_equal_eager_bf16(make_tiny_model, tmp_path):
    """bf16: the W4A16 GEMM's PTX decode replayed in CUDA graphs gives eager's tokens (the stream-K
    parts are summed in program order, so replays are deterministic)."""
    folder = _nvfp4_export(make_tiny_model, tmp_path, "llama", num_attention_heads=8, num_key_value_heads=2,
                           hidden_size=256, head_dim=128)
    eager = _tokens(_llm(folder, dtype="bfloat16", enforce_eager=True))
    assert _tokens(_llm(folder, dtype="bfloat16")) == eager


def test_fp8_layers_take_their_inputs_from_the_gate_and_norm_kernels(make_tiny_model, tmp_path, monkeypatch):
    """A MIXED_PRECISION export of a tiny Qwen3.5 (the 27B's recipe: attention and GDN projections
    FP8) on the triton backend, bf16: the gated attention's output gate and the GDN's gated norm
    write their FP8 o_proj / out_proj's quantized input themselves (fewer quantiser launches), and
    the tokens are those of the same engine with the two-launch chain patched back in."""
    from kvserve.kernels import triton_layers
    from kvserve.layers.gdn import GatedDeltaNet
    from kvserve.layers.quant_linear import FP8Linear
    from kvserve.models.qwen3_next import GatedAttentionBlock
    from kvserve.tools.modelopt_export import export_modelopt

    folder = export_modelopt(make_tiny_model("qwen3_5", seed=3), tmp_path / "mixed", "MIXED_PRECISION",
                             kv_cache_quant_algo=None, calibration_tokens=32)
    calls = []
    quant = triton_layers.fp8_static_quant
    monkeypatch.setattr(triton_layers, "fp8_static_quant", lambda x, inv: calls.append(1) or quant(x, inv))
    llm = _llm(folder, dtype="bfloat16", enforce_eager=True)
    mods = list(llm.llm_engine.runner.model.modules())
    assert any(isinstance(m, GatedDeltaNet) and isinstance(m.out_proj, FP8Linear) for m in mods)
    assert any(isinstance(m, GatedAttentionBlock) and isinstance(m.o_proj, FP8Linear) and m.fused for m in mods)
    fused, fused_calls = _tokens(llm), len(calls)
    del llm
    monkeypatch.setattr(GatedDeltaNet, "_norm_and_project",
                        lambda self, out, z, dtype: self.out_proj(self.norm(out, z).reshape(out.shape[0], -1)))
    monkeypatch.setattr(GatedAttentionBlock, "_gate_and_project",
                        lambda self, out, gate, dtype: self.o_proj(triton_layers.sigmoid_gate(out, gate)))
    calls.clear()
    chain = _tokens(_llm(folder, dtype="bfloat16", enforce_eager=True))
    assert fused == chain
    assert 0 < fused_calls < len(calls)
